// CPU backward, FlashAttention-2 style (the steps of a block pair: backward_block_pair.h). Every
// gradient element is summed by exactly one task in a fixed order: bitwise identical results at
// any thread count, no atomics, no per-thread partial sums. Two schedules, chosen from the shapes:
//
// - One pass (float32, float64, with enough (batch, KV head) items to share between threads): a
//   task owns a (batch, KV head) with every query head of its GQA group and walks its key blocks
//   once, a tile of them at a time (as many as fit half of L2): K_j^T and V_j^T packed once,
//   dK_j and dV_j summed over the query blocks that see them, and each pair's dS K_j added to
//   dQ_i in the dq output itself, which only this task writes. 5 block products a pair, as in
//   FlashAttention-2.
// - Two passes (few items, or bfloat16/float16): tasks own a (batch, KV head, key block) and
//   accumulate dK_j, dV_j; then tasks own a (batch, query head, query block) and accumulate dQ_i.
//   Pass 2 recomputes S and dP once more: 7 block products, for parallelism over blocks.
//
// delta is usually rowsum(dO o O); but for bfloat16/float16 O was rounded to 8 or 11 bits, and
// that rounding error would reach every dS = P o (dP - delta), hence dQ and dK, most visibly
// where a row sees few keys. There the dQ pass runs first and computes delta exactly as
// sum_j P_ij dP_ij in float32, using dQ_i = scale (sum_j P_ij dP_ij K_j - delta_i sum_j P_ij K_j)
// so that it needs delta only at the end (one more block product); the dK, dV pass then uses it.
// (Under softcap, P_ij here is P_ij g_ij; score_modifiers.h, softmax_gradient_row.)
#include "backward_block_pair.h"
#include "dispatch.h"
#include "kernel_api.h"
#include "row_ops.h"
#include "schedule.h"

#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>

#include <array>
#include <cmath>
#include <vector>

namespace causal_attention::cpu::CPU_CAPABILITY {
namespace {

template <typename scalar_t, typename gemm_t>
class BackwardKernel {
  using acc_t = at::opmath_type<scalar_t>;
  using Pair = BlockPairGradients<scalar_t, gemm_t>;
  using Scratch = typename Pair::Scratch;
  // float32/float64 outputs are exact enough for delta = rowsum(dO o O); see the file comment.
  static constexpr bool kDeltaFromOutput = std::is_same_v<scalar_t, acc_t>;

 public:
  explicit BackwardKernel(const BackwardTensors& t)
      : delta_(padded_query_rows(AttentionDims(t))),
        dsinks_(t.dsinks),
        pair_(t, block_sizes(t.q.size(3), t.v.size(3)), delta_.data()),
        dims_(pair_.dims),
        blocks_(pair_.blocks) {}

  void run() {
    gradients();
    if (pair_.modifiers.has_sinks()) {
      sink_gradients();
    }
  }

 private:
  void gradients() {
    if constexpr (kDeltaFromOutput) {
      compute_delta_from_output();
      if (dims_.batch * dims_.heads_kv >= kMinOnePassItems) {
        const int64_t tile = backward_key_tile_blocks(dims_, blocks_);
        // A (batch, KV head) costs its visible pairs, plus its rows and keys.
        const auto cost = [&](int64_t bh_kv, int64_t) {
          const int64_t b = bh_kv / dims_.heads_kv;
          return dims_.rows_q(b) + dims_.rows_k(b) +
                 dims_.visible_pairs(b, 0, dims_.rows_q(b), 0, dims_.rows_k(b));
        };
        schedule_head_blocks(
            dims_, dims_.batch * dims_.heads_kv, 1, cost,
            [&] { return Scratch(dims_, blocks_, tile); },
            [&](int64_t bh_kv, int64_t, Scratch& s) { one_pass(bh_kv, tile, s); });
        return;
      }
    }
    const auto make_scratch = [this] { return Scratch(dims_, blocks_, /*tile=*/1); };
    // A query block costs its visible pairs plus its rows; zero past the end of a packed
    // sequence.
    const auto query_block_cost = [&](int64_t bh, int64_t block) -> int64_t {
      const int64_t b = bh / dims_.heads_q, q0 = block * blocks_.query_rows;
      const int64_t rows = std::min(blocks_.query_rows, dims_.rows_q(b) - q0);
      return rows <= 0 ? 0 : rows + dims_.visible_pairs(b, q0, q0 + rows, 0, dims_.rows_k(b));
    };
    schedule_head_blocks(dims_, dims_.batch * dims_.heads_q,
                         ceil_div(dims_.len_q, blocks_.query_rows), query_block_cost, make_scratch,
                         [&](int64_t bh, int64_t block, Scratch& s) {
                           query_block_gradient(bh, block * blocks_.query_rows, s);
                         });
    // A key block costs its visible pairs plus its keys.
    const auto key_block_cost = [&](int64_t bh_kv, int64_t block) -> int64_t {
      const int64_t b = bh_kv / dims_.heads_kv, k0 = block * blocks_.keys;
      const int64_t cols = std::min(blocks_.keys, dims_.rows_k(b) - k0);
      return cols <= 0 ? 0
                       : cols + dims_.visible_pairs(b, dims_.first_row_seeing(b, k0),
                                                    dims_.rows_q(b), k0, k0 + cols);
    };
    schedule_head_blocks(dims_, dims_.batch * dims_.heads_kv, ceil_div(dims_.len_k, blocks_.keys),
                         key_block_cost, make_scratch,
                         [&](int64_t bh_kv, int64_t block, Scratch& s) {
                           key_tile_gradients(bh_kv, block * blocks_.keys, 1, /*with_dq=*/false, s);
                         });
  }

  // dsink_h = -sum over the rows of head h of exp(sink_h - lse) delta: the sink's probability
  // times the row's delta = dO . O, since d out / d sink = -P_sink out. Summed per head in a
  // fixed order.
  void sink_gradients() const {
    acc_t* dsinks = dsinks_.data_ptr<acc_t>();
    at::parallel_for(0, dims_.heads_q, 1, [&](int64_t begin, int64_t end) {
      for (int64_t h = begin; h < end; ++h) {
        const acc_t sink = pair_.modifiers.sink(h);
        acc_t sum = 0;
        for (int64_t b = 0; b < dims_.batch; ++b) {
          const acc_t* lse = pair_.lse.row(b, h, 0);
          const acc_t* delta = delta_.data() + (b * dims_.heads_q + h) * dims_.len_q;
          for (int64_t r = 0; r < dims_.rows_q(b); ++r) {
            sum += std::exp(sink - lse[r * pair_.lse.row_stride]) * delta[r];
          }
        }
        dsinks[h] = -sum;
      }
    });
  }

  // One delta per query row of every (batch, query head), the longest sequence's rows each.
  static int64_t padded_query_rows(const AttentionDims& d) { return d.batch * d.heads_q * d.len_q; }

  // delta = rowsum(dO o O) in acc_t, one value per query row: O(Lq) memory.
  void compute_delta_from_output() {
    at::parallel_for(0, dims_.batch * dims_.heads_q, 1, [&](int64_t begin, int64_t end) {
      for (int64_t bh = begin; bh < end; ++bh) {
        const int64_t b = bh / dims_.heads_q, h = bh % dims_.heads_q;
        for (int64_t r = 0; r < dims_.rows_q(b); ++r) {
          delta_[bh * dims_.len_q + r] =
              dot_row<acc_t>(pair_.out.row(b, h, r), pair_.grad_out.row(b, h, r), dims_.value_dim);
        }
      }
    });
  }

  // One (batch, KV head), every gradient of it: dQ accumulates in dq (of dtype acc_t here).
  void one_pass(int64_t bh_kv, int64_t tile, Scratch& s) const {
    const int64_t b = bh_kv / dims_.heads_kv, h_kv = bh_kv % dims_.heads_kv;
    const int64_t D = dims_.head_dim;
    for (int64_t h = h_kv * dims_.group(); h < (h_kv + 1) * dims_.group(); ++h) {
      for (int64_t r = 0; r < dims_.rows_q(b); ++r) {
        std::fill_n(pair_.dq.row(b, h, r), D, scalar_t(0));
      }
    }
    for (int64_t k0 = 0; k0 < dims_.rows_k(b); k0 += tile * blocks_.keys) {
      key_tile_gradients(bh_kv, k0, tile, /*with_dq=*/true, s);
    }
    for (int64_t h = h_kv * dims_.group(); h < (h_kv + 1) * dims_.group(); ++h) {
      for (int64_t r = 0; r < dims_.rows_q(b); ++r) {
        scale_row(pair_.dq.row(b, h, r), D, pair_.scale);
      }
    }
  }

  // dK_j and dV_j of the `tile` key blocks from k0, summed over every query row (of every query
  // head in the group) that sees them, in a fixed order; with `with_dq`, also dQ_i += dS K_j of
  // each pair. A query block meets the tile's key blocks one after the other, so that its rows
  // (and dQ_i) stream in once per tile, not once per key block.
  void key_tile_gradients(int64_t bh_kv, int64_t k0, int64_t tile, bool with_dq, Scratch& s) const {
    const int64_t b = bh_kv / dims_.heads_kv, h_kv = bh_kv % dims_.heads_kv;
    const int64_t tile_end = std::min(dims_.rows_k(b), k0 + tile * blocks_.keys);
    std::array<typename Pair::KeyOperands, kMaxKeyTileBlocks> ko;
    for (int64_t t = 0; k0 + t * blocks_.keys < tile_end; ++t) {
      const int64_t kj = k0 + t * blocks_.keys, cols = std::min(blocks_.keys, tile_end - kj);
      ko[t] = pair_.key_operands(b, h_kv, kj, cols, t, s);
      std::fill_n(s.key_gradient(t, dims_), cols * dims_.head_dim, acc_t(0));
      std::fill_n(s.value_gradient(t, dims_), cols * dims_.value_dim, acc_t(0));
    }
    // The query blocks with a row that sees a key of the tile.
    const int64_t first_q0 =
        dims_.first_row_seeing(b, k0) / blocks_.query_rows * blocks_.query_rows;
    const int64_t rows_end = dims_.rows_seeing_before(b, tile_end);
    for (int64_t h = h_kv * dims_.group(); h < (h_kv + 1) * dims_.group(); ++h) {
      for (int64_t q0 = first_q0; q0 < rows_end; q0 += blocks_.query_rows) {
        const int64_t rows = std::min(blocks_.query_rows, dims_.rows_q(b) - q0);
        const int64_t key_begin = dims_.key_begin(b, q0);
        const int64_t key_end = std::min(tile_end, dims_.key_end(b, q0 + rows - 1));
        for (int64_t t = 0; k0 + t * blocks_.keys < key_end; ++t) {
          const int64_t kj = k0 + t * blocks_.keys, cols = std::min(blocks_.keys, tile_end - kj);
          // Blocks before the window of every row, or that the key mask hides, get zeros.
          if (kj + cols > key_begin && dims_.kept_keys(b, kj, cols) > 0) {
            pair_gradients(b, h, q0, rows, kj, cols, ko[t], t, with_dq, s);
          }
        }
      }
    }
    for (int64_t t = 0; k0 + t * blocks_.keys < tile_end; ++t) {
      const int64_t kj = k0 + t * blocks_.keys, cols = std::min(blocks_.keys, tile_end - kj);
      for (int64_t c = 0; c < cols; ++c) {
        store_scaled_row(s.key_gradient(t, dims_) + c * dims_.head_dim, dims_.head_dim, pair_.scale,
                         pair_.dk.row(b, h_kv, kj + c));
        store_scaled_row(s.value_gradient(t, dims_) + c * dims_.value_dim, dims_.value_dim,
                         acc_t(1), pair_.dv.row(b, h_kv, kj + c));
      }
    }
  }

  // One block pair: dV_j, dK_j into the tile's accumulators t, and dQ_i into dq.
  void pair_gradients(int64_t b, int64_t h, int64_t q0, int64_t rows, int64_t k0, int64_t cols,
                      const typename Pair::KeyOperands& ko, int64_t t, bool with_dq,
                      Scratch& s) const {
    // The query operands are made per pair: the B operands below may reuse their scratch.
    const auto qo = pair_.query_operands(b, h, q0, rows, s);
    pair_.probabilities_and_gradients(b * dims_.heads_q + h, qo, ko, q0, rows, k0, cols,
                                      /*with_delta=*/true, s);
    pair_.add_value_gradient(b, h, q0, rows, k0, cols, s.value_gradient(t, dims_), s);
    pair_.add_key_gradient(b, h, q0, rows, k0, cols, s.key_gradient(t, dims_), s);
    if constexpr (kDeltaFromOutput) {
      if (with_dq) {
        pair_.add_query_product(s.ds.data(), b, h / dims_.group(), q0, rows, k0, cols,
                                pair_.dq.row(b, h, q0), pair_.dq.row_stride, s);
      }
    }
  }

  // Pass 2 of two: dQ of one query block, summed over its visible key blocks in order (and, for
  // bfloat16/float16, the block's exact delta; see the file comment).
  void query_block_gradient(int64_t bh, int64_t q0, Scratch& s) {
    const int64_t b = bh / dims_.heads_q, h = bh % dims_.heads_q, h_kv = h / dims_.group();
    const int64_t D = dims_.head_dim;
    const int64_t rows = std::min(blocks_.query_rows, dims_.rows_q(b) - q0);
    const auto qo = pair_.query_operands(b, h, q0, rows, s);
    acc_t* dq = s.grad_a.data();         // sum_j dS_ij K_j, or sum_j P_ij dP_ij K_j
    acc_t* p_times_k = s.grad_c.data();  // sum_j P_ij K_j (exact-delta form only)
    acc_t* delta = s.row_sums.data();    // sum_j P_ij dP_ij (exact-delta form only)
    std::fill_n(dq, rows * D, acc_t(0));
    if constexpr (!kDeltaFromOutput) {
      std::fill_n(p_times_k, rows * D, acc_t(0));
      std::fill_n(delta, rows, acc_t(0));
    }
    const int64_t key_end = dims_.key_end(b, q0 + rows - 1);
    const int64_t first_block = dims_.key_begin(b, q0) / blocks_.keys * blocks_.keys;
    for (int64_t k0 = first_block; k0 < key_end; k0 += blocks_.keys) {
      const int64_t cols = std::min(blocks_.keys, key_end - k0);
      if (dims_.kept_keys(b, k0, cols) == 0) {
        continue;  // the key mask hides the whole block
      }
      const auto ko = pair_.key_operands(b, h_kv, k0, cols, /*t=*/0, s);
      pair_.probabilities_and_gradients(bh, qo, ko, q0, rows, k0, cols, kDeltaFromOutput, s);
      pair_.add_query_product(s.ds.data(), b, h_kv, q0, rows, k0, cols, dq, D, s);
      if constexpr (!kDeltaFromOutput) {
        pair_.add_query_product(s.p.data(), b, h_kv, q0, rows, k0, cols, p_times_k, D, s);
        for (int64_t r = 0; r < rows; ++r) {
          delta[r] += s.delta_shares[r];
        }
      }
    }
    for (int64_t r = 0; r < rows; ++r) {
      if constexpr (!kDeltaFromOutput) {
        delta_[bh * dims_.len_q + q0 + r] = delta[r];
        add_scaled_row(dq + r * D, p_times_k + r * D, D, -delta[r]);
      }
      store_scaled_row(dq + r * D, D, pair_.scale, pair_.dq.row(b, h, q0 + r));
    }
  }

  std::vector<acc_t> delta_;
  const at::Tensor dsinks_;
  const Pair pair_;
  const AttentionDims& dims_;
  const BlockSizes& blocks_;
};

}  // namespace

void backward_kernel(const BackwardTensors& tensors) {
  run_for_dtype<BackwardKernel>(tensors);
}

}  // namespace causal_attention::cpu::CPU_CAPABILITY
