// CPU backward, FlashAttention-2 style (the steps of a block pair: backward_block_pair.h), in two
// steps: the row statistics (delta, and where needed a normalizer), one value each per query row,
// then the gradients. Every gradient element is summed by exactly one task in a fixed order:
// bitwise identical results at any thread count, no atomics, no per-thread partial sums.
//
// The row statistics. dS = P o (dP - delta) needs delta = rowsum(dO o O) before the first block
// pair, and P = exp(x - lse) assumes the forward's lse normalizes the backward's scores.
// - float32, float64, when the forward ran the block path: delta from the output, whose rounding
//   error is far below the gradients' own; P as it is (the forward's scores are the backward's,
//   from the same block products).
// - bfloat16, float16: O was rounded to 8 or 11 bits, and that rounding error would reach every
//   dS, hence dQ and dK, most of all where a row sees few keys or the values share a large mean
//   (dP - delta then cancels). And float32/float64 when the forward decoded (few query rows):
//   its scores were summed in another order than the backward's block products, so lse does not
//   normalize the backward's P, which with a peaked softmax measured 3-12x SDPA's gradient error.
//   And float32/float64 when attn_mask's gradient is asked for: that gradient is dS itself, entry
//   by entry, and a delta from O would carry the forward's exponentials' error (exp_u20) into
//   every entry (measured up to 5x SDPA's error in float32).
//   There a step before the gradients sums, over the very P and dP the gradients recompute (S
//   and dP, 2 block products a pair, one task per query block), l = sum_j P_ij (with the sink's
//   share) and sum_j P_ij dP'_ij: the gradients then use P / l, a softmax of their own scores,
//   and delta = sum_j P_ij dP'_ij / l, so that dS is exact to float32 rounding, and a row that
//   sees one key gets dS = 0 exactly (SDPA's rowsum(dO o O) over a rounded O keeps its error).
//   For bfloat16 it measured dq's error at 0.016 against SDPA's 0.136 with values of mean 3.
// - Any dtype, when the caller gives delta: a ring step (distributed/ring.py) holds
//   some of its rows' keys, and its lse and delta are over all of them, so both are taken as they
//   are (normalizer 1): statistics recomputed from the step's own keys would be a softmax of those
//   keys alone.
//
// The gradients step, two schedules, chosen from the shapes:
// - One pass (enough (batch, KV head) items to share between threads): a task owns a (batch, KV
//   head) with every query head of its GQA group and walks its key blocks once, a tile of them at
//   a time (as many as fit half of L2): K_j^T and V_j^T (packed once per call), dK_j and dV_j
//   summed over the query blocks that see them, and each pair's dS K_j added to dQ_i, which only
//   this task sums (in dq itself for float32/float64, else in a float32 buffer of the task's,
//   rounded once at the end). 5 block products a pair, as in FlashAttention-2.
// - Two passes (few items): tasks own a (batch, KV head, key block) and sum dK_j, dV_j; then
//   tasks own a (batch, query head, query block) and sum dQ_i. Pass 2 recomputes S and dP once
//   more: 7 block products, for parallelism over blocks.
#include "backward_block_pair.h"
#include "dtype_dispatch.h"
#include "kernel_api.h"
#include "row_ops.h"
#include "row_sources.h"
#include "schedule.h"

#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>

#include <array>
#include <cmath>
#include <vector>

namespace causal_attention::cpu::CPU_CAPABILITY {
namespace {

// Where dq, dk or dv is stored: in q's dtype, rounded once, or, where the call gave delta (a
// step of a larger call, whose shares its caller sums), in acc_t as summed.
template <typename scalar_t, typename acc_t>
class GradientRows {
 public:
  GradientRows(const at::Tensor& t, const int32_t* offsets)
      : rounded_(t.scalar_type() == c10::CppTypeToScalarType<scalar_t>::value),
        rows_(t, offsets),
        sums_(t, offsets) {}

  // factor * src (n values) as row r of head h of batch item b.
  void store(const acc_t* src, int64_t n, acc_t factor, int64_t b, int64_t h, int64_t r) const {
    if (rounded_) {
      store_scaled_row(src, n, factor, rows_.row(b, h, r));
    } else {
      store_scaled_row(src, n, factor, sums_.row(b, h, r));
    }
  }
  // The rows in q's dtype, for float32/float64 (where acc_t is that dtype).
  const HeadRows<scalar_t>& rows() const { return rows_; }

 private:
  bool rounded_;
  HeadRows<scalar_t> rows_;
  HeadRows<acc_t> sums_;
};

template <typename scalar_t, typename gemm_t>
class BackwardKernel {
  using acc_t = at::opmath_type<scalar_t>;
  using Pair = BlockPairGradients<scalar_t, gemm_t>;
  using Scratch = typename Pair::Scratch;
  static constexpr bool kReducedPrecision = !std::is_same_v<scalar_t, acc_t>;

 public:
  explicit BackwardKernel(const BackwardTensors& t)
      : recomputed_statistics_(kReducedPrecision || forward_decodes(AttentionDims(t)) ||
                               t.dattn_mask.defined()),
        given_delta_(t.delta),
        delta_(padded_query_rows(AttentionDims(t))),
        normalizers_(delta_.size(), acc_t(1)),
        dsinks_(t.dsinks),
        pair_(t, block_sizes(t.q.size(3), t.v.size(3)), delta_.data(), normalizers_.data()),
        dq_(t.dq, pair_.dims.cu_q),
        dk_(t.dk, pair_.dims.cu_k),
        dv_(t.dv, pair_.dims.cu_k),
        dims_(pair_.dims),
        blocks_(pair_.blocks) {}

  void run() {
    if (given_delta_.defined()) {
      delta_as_given();
    } else if (recomputed_statistics_) {
      row_statistics_from_probabilities();
    } else {
      delta_from_output();
    }
    gradients();
    if (pair_.modifiers.has_sinks()) {
      sink_gradients();
    }
  }

 private:
  // delta_[row] = row_delta(b, h, r) for every query row, one task per (batch, query head): O(Lq)
  // memory.
  template <typename RowDelta>
  void set_delta(const RowDelta& row_delta) {
    at::parallel_for(0, dims_.batch * dims_.heads_q, 1, [&](int64_t begin, int64_t end) {
      for (int64_t bh = begin; bh < end; ++bh) {
        const int64_t b = bh / dims_.heads_q, h = bh % dims_.heads_q;
        for (int64_t r = 0; r < dims_.rows_q(b); ++r) {
          delta_[bh * dims_.len_q + r] = row_delta(b, h, r);
        }
      }
    });
  }

  // delta = rowsum(dO o O) in acc_t.
  void delta_from_output() {
    set_delta([&](int64_t b, int64_t h, int64_t r) {
      return dot_row(pair_.out.row(b, h, r), pair_.grad_out.row(b, h, r), dims_.value_dim);
    });
  }

  // The caller's delta, over every key its rows see, of which this call holds some (a ring
  // step: lse too is over all of them, so the normalizers stay 1).
  void delta_as_given() {
    const HeadRows<const acc_t> given(given_delta_, dims_.cu_q);
    set_delta([&](int64_t b, int64_t h, int64_t r) { return *given.row(b, h, r); });
  }

  // Each row's normalizer 1 / l, with l = sum_j P_ij (+ the sink's P) over the P = exp(x - lse)
  // the gradients recompute, and delta = sum_j P_ij dP'_ij / l (see the file comment); one task
  // per (batch, query head, query block), its key blocks summed in order.
  void row_statistics_from_probabilities() {
    for_each_query_block([&](int64_t bh, int64_t q0, Scratch& s) {
      const int64_t b = bh / dims_.heads_q, h = bh % dims_.heads_q;
      const int64_t rows = std::min(blocks_.query_rows, dims_.rows_q(b) - q0);
      const auto qo = pair_.query_operands(b, h, q0, rows, s);
      acc_t* delta = delta_.data() + bh * dims_.len_q + q0;
      acc_t* normalizer = normalizers_.data() + bh * dims_.len_q + q0;
      std::fill_n(delta, rows, acc_t(0));
      std::fill_n(normalizer, rows, acc_t(0));
      for_each_visible_key_block(b, h, q0, rows, [&](const PairPart& part) {
        const int64_t r = part.q0 - q0;
        pair_.add_row_shares(bh, Pair::rows_from(qo, r),
                             pair_.key_operands(b, h / dims_.group(), part.k0), part.q0, part.rows,
                             part.k0, part.cols, normalizer + r, delta + r, s);
      });
      const acc_t* lse = pair_.lse.row(b, h, q0);
      const bool sinks = pair_.modifiers.has_sinks();
      const acc_t sink = sinks ? pair_.modifiers.sink(h) : acc_t(0);
      for (int64_t r = 0; r < rows; ++r) {
        const acc_t mass =
            normalizer[r] + (sinks ? std::exp(sink - lse[r * pair_.lse.row_stride]) : acc_t(0));
        // A row that sees nothing (mass 0) has no gradient: any finite normalizer serves.
        normalizer[r] = mass > acc_t(0) ? acc_t(1) / mass : acc_t(1);
        delta[r] *= normalizer[r];
      }
    });
  }

  void gradients() {
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
    for_each_query_block(
        [&](int64_t bh, int64_t q0, Scratch& s) { query_block_gradient(bh, q0, s); });
  }

  // Calls fn(bh, q0, scratch) for every query block of every (batch, query head), in parallel.
  template <typename Fn>
  void for_each_query_block(const Fn& fn) {
    // A query block costs its visible pairs plus its rows; zero past the end of a packed
    // sequence.
    const auto query_block_cost = [&](int64_t bh, int64_t block) -> int64_t {
      const int64_t b = bh / dims_.heads_q, q0 = block * blocks_.query_rows;
      const int64_t rows = std::min(blocks_.query_rows, dims_.rows_q(b) - q0);
      return rows <= 0 ? 0 : rows + dims_.visible_pairs(b, q0, q0 + rows, 0, dims_.rows_k(b));
    };
    schedule_head_blocks(
        dims_, dims_.batch * dims_.heads_q, ceil_div(dims_.len_q, blocks_.query_rows),
        query_block_cost, [this] { return Scratch(dims_, blocks_, /*tile=*/1); },
        [&](int64_t bh, int64_t block, Scratch& s) { fn(bh, block * blocks_.query_rows, s); });
  }

  // A part of a block pair (AttentionDims::for_each_part).
  struct PairPart {
    int64_t q0, rows, k0, cols;
  };

  // Calls fn(part) for the parts of each key block that a row of query rows [q0, q0 + rows) of
  // batch item b, query head h, sees, in order (blocks the key mask or attn_mask hides entirely
  // are skipped).
  template <typename Fn>
  void for_each_visible_key_block(int64_t b, int64_t h, int64_t q0, int64_t rows,
                                  const Fn& fn) const {
    const int64_t key_end = dims_.key_end(b, q0 + rows - 1);
    const int64_t first_block = dims_.key_begin(b, q0) / blocks_.keys * blocks_.keys;
    for (int64_t k0 = first_block; k0 < key_end; k0 += blocks_.keys) {
      const int64_t cols = std::min(blocks_.keys, key_end - k0);
      if (dims_.kept_keys(b, k0, cols) > 0) {
        dims_.for_each_part(
            b, h, q0, rows, k0, cols,
            [&](int64_t q, int64_t r, int64_t k, int64_t c) { fn(PairPart{q, r, k, c}); });
      }
    }
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
            sum += std::exp(sink - lse[r * pair_.lse.row_stride]) * normalizers_[first_row + r] *
                   delta_[first_row + r];
          }
        }
        dsinks[h] = -sum;
      }
    });
  }

  // One delta per query row of every (batch, query head), the longest sequence's rows each.
  static int64_t padded_query_rows(const AttentionDims& d) { return d.batch * d.heads_q * d.len_q; }

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
    for (int64_t t = 0; k0 + t * blocks_.keys < tile_end; ++t) {
      const int64_t kj = k0 + t * blocks_.keys, cols = std::min(blocks_.keys, tile_end - kj);
      ko[t] = pair_.key_operands(b, h_kv, kj);
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
        const auto qo = pair_.query_operands(b, h, q0, rows, s);
        for (int64_t t = 0; k0 + t * blocks_.keys < key_end; ++t) {
          const int64_t kj = k0 + t * blocks_.keys, cols = std::min(blocks_.keys, tile_end - kj);
          // Blocks before the window of every row, or that the key mask or attn_mask hides, get
          // zeros.
          if (kj + cols > key_begin && dims_.kept_keys(b, kj, cols) > 0) {
            dims_.for_each_part(
                b, h, q0, rows, kj, cols, [&](int64_t q, int64_t r, int64_t k, int64_t c) {
                  const int64_t first_key = k - kj;
                  pair_gradients(b, h, PairPart{q, r, k, c}, Pair::rows_from(qo, q - q0),
                                 first_key == 0 ? ko[t] : pair_.key_operands(b, h_kv, k),
                                 s.key_gradient(t, dims_) + first_key * dims_.head_dim,
                                 s.value_gradient(t, dims_) + first_key * dims_.value_dim, dq, s);
                });
          }
        }
      }
    }
    for (int64_t t = 0; k0 + t * blocks_.keys < tile_end; ++t) {
      const int64_t kj = k0 + t * blocks_.keys, cols = std::min(blocks_.keys, tile_end - kj);
      for (int64_t c = 0; c < cols; ++c) {
        dk_.store(s.key_gradient(t, dims_) + c * dims_.head_dim, dims_.head_dim, pair_.scale, b,
                  h_kv, kj + c);
        dv_.store(s.value_gradient(t, dims_) + c * dims_.value_dim, dims_.value_dim, acc_t(1), b,
                  h_kv, kj + c);
      }
    }
  }

  // One block pair (its part): dV_j and dK_j into the accumulators of its keys, and with dq
  // dQ_i into it.
  void pair_gradients(int64_t b, int64_t h, const PairPart& part,
                      const typename Pair::QueryOperands& qo, const typename Pair::KeyOperands& ko,
                      acc_t* dk_acc, acc_t* dv_acc, const QuerySums* dq, Scratch& s) const {
    const auto [q0, rows, k0, cols] = part;
    pair_.probabilities_and_gradients(b * dims_.heads_q + h, qo, ko, q0, rows, k0, cols,
                                      /*record_mask_gradient=*/true, s);
    pair_.add_value_gradient(b, h, q0, rows, k0, cols, dv_acc, s);
    pair_.add_key_gradient(b, h, q0, rows, k0, cols, dk_acc, s);
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
    for_each_visible_key_block(b, h, q0, rows, [&](const PairPart& part) {
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

  // Whether the row statistics come from the probabilities (see the file comment), where the
  // call gave no delta; else every normalizer stays 1.
  const bool recomputed_statistics_;
  const at::Tensor given_delta_;
  std::vector<acc_t> delta_, normalizers_;
  const at::Tensor dsinks_;
  const Pair pair_;
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
