// CPU backward, FlashAttention-2 style (the steps of a block pair: backward_block_pair.h): the row
// statistics (delta, and where needed a normalizer), one value each per query row, then the
// gradients. Every gradient element is summed by exactly one task in a fixed order:
// bitwise identical results at any thread count, no atomics, no per-thread partial sums. The
// row statistics, and when each way of forming them is taken, are backward_row_statistics.h.
//
// The gradients step, three schedules, chosen from the shapes and the row statistics:
// - Row panels (enough (batch, KV head) items, statistics from the probabilities): the
//   statistics summed as the gradients go, 5 block products a pair (backward_row_panels.h).
// - One pass (enough (batch, KV head) items to share between threads, delta from the output or
//   given): a task owns a (batch, KV head) with every query head of its GQA group and walks its
//   key blocks once, a tile of them at a time (as many as fit half of L2): K_j^T and V_j^T
//   (packed once per call, a group of items at a time), dK_j and dV_j summed over the query
//   blocks that see them, and each pair's dS K_j added to dQ_i, which only this task sums (in dq
//   itself for float32/float64, else in a float32 buffer of the task's, rounded once at the
//   end). 5 block products a pair, as in FlashAttention-2.
// - Two passes (few items): tasks own a (batch, KV head, key block) and sum dK_j, dV_j; then
//   tasks own a (batch, query head, query block) and sum dQ_i. Pass 2 recomputes S and dP once
//   more: 7 block products, for parallelism over blocks.
#include "backward_block_pair.h"
#include "backward_block_walks.h"
#include "backward_row_panels.h"
#include "backward_row_statistics.h"
#include "dtype_dispatch.h"
#include "geometry.h"
#include "gradient_rows.h"
#include "kernel_api.h"
#include "row_sources.h"
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
  static constexpr bool kReducedPrecision = !std::is_same_v<scalar_t, acc_t>;

 public:
  explicit BackwardKernel(const BackwardTensors& t)
      : statistics_(t),
        dsinks_(t.dsinks),
        pair_(t, statistics_.delta(), statistics_.normalizers()),
        dq_(t.dq, pair_.dims.cu_q),
        dk_(t.dk, pair_.dims.cu_k),
        dv_(t.dv, pair_.dims.cu_k),
        dims_(pair_.dims),
        blocks_(pair_.blocks) {}

  void run() {
    if (one_pass_items()) {
      // A task a (batch, KV head): K and V packed a group of them at a time (packed_kv.h). The
      // row panels sum the statistics from the probabilities as they go; the others need no
      // packed block.
      const bool row_panels = statistics_.from_probabilities();
      if (!row_panels) {
        statistics_.compute(pair_);
      }
      pair_.packed.pack_in_groups(/*items_per_pair=*/1, [&](int64_t first, int64_t last) {
        if (row_panels) {
          RowPanelGradients<scalar_t, gemm_t>(pair_, statistics_, dq_, dk_, dv_).run(first, last);
        } else {
          one_pass_gradients(first, last);
        }
      });
    } else {
      pair_.packed.pack(0, pair_.packed.pairs());
      statistics_.compute(pair_);
      two_pass_gradients();
    }
    if (pair_.modifiers.has_sinks()) {
      sink_gradients();
    }
  }

 private:
  // Whether there are enough (batch, KV head) items to share between threads.
  bool one_pass_items() const { return dims_.batch * dims_.heads_kv >= kMinOnePassItems; }

  // One pass over (batch, KV head) pairs [first, last), whose blocks are packed.
  void one_pass_gradients(int64_t first, int64_t last) {
    const int64_t tile = backward_key_tile_blocks(dims_, blocks_);
    for_each_key_value_head(
        dims_, first, last, [&] { return Scratch(dims_, blocks_, tile); },
        [&](int64_t bh_kv, Scratch& s) { one_pass(bh_kv, tile, s); });
  }

  void two_pass_gradients() {
    // A key block costs its visible pairs plus its keys.
    const auto key_block_cost = [&](int64_t bh_kv, int64_t block) -> int64_t {
      const int64_t b = bh_kv / dims_.heads_kv, k0 = block * blocks_.keys;
      const int64_t cols = std::min(blocks_.keys, dims_.rows_k(b) - k0);
      return cols <= 0 ? 0
                       : cols + dims_.visible_pairs(b, dims_.first_row_seeing(b, k0),
                                                    dims_.rows_q(b), k0, k0 + cols);
    };
    schedule_head_blocks(
        dims_, dims_.batch * dims_.heads_kv, ceil_div(dims_.len_k, blocks_.keys), key_block_cost,
        [this] { return Scratch(dims_, blocks_, /*tile=*/1); },
        [&](int64_t bh_kv, int64_t block, Scratch& s) {
          key_tile_gradients(bh_kv, block * blocks_.keys, 1, nullptr, s);
        });
    for_each_query_block<Scratch>(dims_, blocks_, [&](int64_t bh, int64_t q0, Scratch& s) {
      query_block_gradient(bh, q0, s);
    });
  }

  // dsink_h = -sum over the rows of head h of P_sink delta, P_sink = exp(sink_h - lse) times the
  // row's normalizer: the sink's probability times the row's
  // delta = dO . O, since d out / d sink = -P_sink out. Summed per head in a
  // fixed order.
  void sink_gradients() const {
    acc_t* dsinks = dsinks_.data_ptr<acc_t>();
    at::parallel_for(0, dims_.heads_q, 1, [&](int64_t begin, int64_t end) {
      for (int64_t h = begin; h < end; ++h) {
        const acc_t sink = pair_.modifiers.sink(h);
        acc_t sum = 0;
        for (int64_t b = 0; b < dims_.batch; ++b) {
          const acc_t* lse = pair_.lse.row(b, h, 0);
          const int64_t first_row = (b * dims_.heads_q + h) * dims_.len_q;
          for (int64_t r = 0; r < dims_.rows_q(b); ++r) {
            sum += std::exp(sink - lse[r * pair_.lse.row_stride]) *
                   statistics_.normalizers()[first_row + r] * statistics_.delta()[first_row + r];
          }
        }
        dsinks[h] = -sum;
      }
    });
  }

  // Where a one-pass task sums dQ of the query heads of its GQA group: rows of D values in acc_t.
  struct QuerySums {
    acc_t* data;
    int64_t head_stride, row_stride;
    acc_t* row(int64_t head_in_group, int64_t r) const {
      return data + head_in_group * head_stride + r * row_stride;
    }
  };

  // One (batch, KV head), every gradient of it.
  void one_pass(int64_t bh_kv, int64_t tile, Scratch& s) const {
    const int64_t b = bh_kv / dims_.heads_kv, h_kv = bh_kv % dims_.heads_kv;
    const int64_t D = dims_.head_dim, rows = dims_.rows_q(b), first_head = h_kv * dims_.group();
    // dQ summed in acc_t: in dq itself where it has that dtype, else in a buffer of this task's
    // (O(group * Lq * D)), rounded into dq once at the end.
    std::vector<acc_t> buffer(kReducedPrecision ? dims_.group() * rows * D : 0, acc_t(0));
    QuerySums dq{buffer.data(), rows * D, D};
    if constexpr (!kReducedPrecision) {
      const HeadRows<scalar_t>& out = dq_.rows();
      dq = {out.row(b, first_head, 0), out.head_stride, out.row_stride};
      for (int64_t g = 0; g < dims_.group(); ++g) {
        for (int64_t r = 0; r < rows; ++r) {
          std::fill_n(dq.row(g, r), D, acc_t(0));
        }
      }
    }
    for (int64_t k0 = 0; k0 < dims_.rows_k(b); k0 += tile * blocks_.keys) {
      key_tile_gradients(bh_kv, k0, tile, &dq, s);
    }
    for (int64_t g = 0; g < dims_.group(); ++g) {
      for (int64_t r = 0; r < rows; ++r) {
        dq_.store(dq.row(g, r), D, pair_.scale, b, first_head + g, r);
      }
    }
  }

  // dK_j and dV_j of the `tile` key blocks from k0, summed over every query row (of every query
  // head in the group) that sees them, in a fixed order; with dq, also dQ_i += dS K_j of each
  // pair into it. A query block meets the tile's key blocks one after the other, so that its
  // rows (and dQ_i) stream in once per tile, not once per key block.
  void key_tile_gradients(int64_t bh_kv, int64_t k0, int64_t tile, const QuerySums* dq,
                          Scratch& s) const {
    const int64_t b = bh_kv / dims_.heads_kv, h_kv = bh_kv % dims_.heads_kv;
    const int64_t tile_end = std::min(dims_.rows_k(b), k0 + tile * blocks_.keys);
    std::array<typename Pair::KeyOperands, kMaxKeyTileBlocks> ko;
    const int64_t tile_blocks = ceil_div(tile_end - k0, blocks_.keys);
    for (int64_t t = 0; t < tile_blocks; ++t) {
      ko[t] = pair_.key_operands(b, h_kv, k0 + t * blocks_.keys);
    }
    s.zero_key_gradients(tile_blocks, dims_);
    // The query blocks with a row that sees a key of the tile.
    const int64_t first_q0 =
        dims_.first_row_seeing(b, k0) / blocks_.query_rows * blocks_.query_rows;
    const int64_t rows_end = dims_.rows_seeing_before(b, tile_end);
    for (int64_t h = h_kv * dims_.group(); h < (h_kv + 1) * dims_.group(); ++h) {
      for (int64_t q0 = first_q0; q0 < rows_end; q0 += blocks_.query_rows) {
        const int64_t rows = std::min(blocks_.query_rows, dims_.rows_q(b) - q0);
        const int64_t key_begin = dims_.key_begin(b, q0);
        const int64_t key_end = std::min(tile_end, dims_.key_end(b, q0 + rows - 1));
        const auto qo = pair_.query_operands(b, h, q0, rows, s);
        const auto qr = pair_.query_rows(qo, b, h, q0, rows, s);
        for (int64_t t = 0; k0 + t * blocks_.keys < key_end; ++t) {
          const int64_t kj = k0 + t * blocks_.keys, cols = std::min(blocks_.keys, tile_end - kj);
          // Blocks before the window of every row, or that the key mask or attn_mask hides, get
          // zeros.
          if (kj + cols > key_begin && dims_.kept_keys(b, kj, cols) > 0) {
            dims_.for_each_part(
                b, h, q0, rows, kj, cols, [&](int64_t q, int64_t r, int64_t k, int64_t c) {
                  const int64_t first_key = k - kj;
                  pair_gradients(b, h, PairPart{q, r, k, c}, Pair::rows_from(qo, q - q0),
                                 Pair::rows_from(qr, q - q0),
                                 first_key == 0 ? ko[t] : pair_.key_operands(b, h_kv, k),
                                 s.key_gradient_column(t * blocks_.keys + first_key, dims_),
                                 s.value_gradient_column(t * blocks_.keys + first_key, dims_), dq,
                                 s);
                });
          }
        }
      }
    }
    s.store_key_gradients(dk_, dv_, pair_.scale, dims_, b, h_kv, k0, tile_end - k0);
  }

  // One block pair (its part): dV_j^T and dK_j^T into the transposed accumulators of its keys
  // (leading dim s.gradient_ld()), and with dq dQ_i into it.
  void pair_gradients(int64_t b, int64_t h, const PairPart& part,
                      const typename Pair::QueryOperands& qo, const typename Pair::QueryRows& qr,
                      const typename Pair::KeyOperands& ko, acc_t* dk_acc, acc_t* dv_acc,
                      const QuerySums* dq, Scratch& s) const {
    const auto [q0, rows, k0, cols] = part;
    pair_.probabilities_and_gradients(b * dims_.heads_q + h, qo, ko, q0, rows, k0, cols,
                                      /*record_mask_gradient=*/true, s);
    pair_.add_value_gradient(b, h, q0, rows, k0, cols, qr, dv_acc, s.gradient_ld(), s);
    pair_.add_key_gradient(b, h, q0, rows, k0, cols, qr, dk_acc, s.gradient_ld(), s);
    if (dq != nullptr) {
      pair_.add_query_product(b, h / dims_.group(), q0, rows, k0, cols,
                              dq->row(h % dims_.group(), q0), dq->row_stride, s);
    }
  }

  // Pass 2 of two: dQ of one query block, summed over its visible key blocks in order.
  void query_block_gradient(int64_t bh, int64_t q0, Scratch& s) const {
    const int64_t b = bh / dims_.heads_q, h = bh % dims_.heads_q;
    const int64_t D = dims_.head_dim;
    const int64_t rows = std::min(blocks_.query_rows, dims_.rows_q(b) - q0);
    const auto qo = pair_.query_operands(b, h, q0, rows, s);
    acc_t* dq = s.grad_a.data();  // sum_j dS_ij K_j
    std::fill_n(dq, rows * D, acc_t(0));
    for_each_visible_key_block(dims_, blocks_, b, h, q0, rows, [&](const PairPart& part) {
      const int64_t r = part.q0 - q0;
      // Pass 1 recorded attn_mask's gradient of this pair.
      pair_.probabilities_and_gradients(bh, Pair::rows_from(qo, r),
                                        pair_.key_operands(b, h / dims_.group(), part.k0), part.q0,
                                        part.rows, part.k0, part.cols,
                                        /*record_mask_gradient=*/false, s);
      pair_.add_query_product(b, h / dims_.group(), part.q0, part.rows, part.k0, part.cols,
                              dq + r * D, D, s);
    });
    for (int64_t r = 0; r < rows; ++r) {
      dq_.store(dq + r * D, D, pair_.scale, b, h, q0 + r);
    }
  }

  RowStatistics<scalar_t, gemm_t> statistics_;
  const at::Tensor dsinks_;
  Pair pair_;
  const GradientRows<scalar_t, acc_t> dq_, dk_, dv_;
  const AttentionDims& dims_;
  const BlockSizes& blocks_;
};

void backward_kernel_impl(const BackwardTensors& tensors) {
  run_for_dtype<BackwardKernel>(tensors);
}

}  // namespace

CAUSAL_ATTENTION_REGISTER_KERNEL(backward_kernel, backward_kernel_impl);

}  // namespace causal_attention::cpu::CPU_CAPABILITY
