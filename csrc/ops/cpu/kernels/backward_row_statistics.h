// The backward's first step (attention_backward_kernel.cpp): the row statistics, delta and where
// needed a normalizer, one value each per query row, which every block pair's dS reads.
//
// dS = P o (dP - delta) needs delta = rowsum(dO o O) before the first block pair, and
// P = exp(x - lse) assumes the forward's lse normalizes the backward's scores.
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
// Included only by the per-instruction-set kernel sources (see geometry.h).
#pragma once

#include "backward_block_pair.h"
#include "backward_block_walks.h"
#include "geometry.h"
#include "kernel_api.h"
#include "row_ops.h"
#include "row_sources.h"
#include "schedule.h"

#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

namespace causal_attention::cpu::CPU_CAPABILITY {

// delta and the normalizers of every query row of every (batch, query head), the longest
// sequence's rows each (O(Lq) memory), which the block pairs read through delta() and
// normalizers().
template <typename scalar_t, typename gemm_t>
class RowStatistics {
  using acc_t = at::opmath_type<scalar_t>;
  using Pair = BlockPairGradients<scalar_t, gemm_t>;
  using Scratch = typename Pair::Scratch;
  static constexpr bool kReducedPrecision = !std::is_same_v<scalar_t, acc_t>;

 public:
  explicit RowStatistics(const BackwardTensors& t)
      : recomputed_statistics_(kReducedPrecision || forward_decodes(AttentionDims(t)) ||
                               t.dattn_mask.defined()),
        given_delta_(t.delta),
        delta_(padded_query_rows(AttentionDims(t))),
        normalizers_(delta_.size(), acc_t(1)) {}

  // Row (b, h, r)'s at [(b * heads_q + h) * len_q + r].
  const acc_t* delta() const { return delta_.data(); }
  const acc_t* normalizers() const { return normalizers_.data(); }

  // Whether they are summed from the probabilities the gradients recompute (see the file
  // comment): by compute(), or by the row-panel schedule (backward_row_panels.h) as it goes.
  bool from_probabilities() const { return recomputed_statistics_ && !given_delta_.defined(); }

  // Sets them for the block pairs of `pair` (see the file comment).
  void compute(const Pair& pair) {
    if (given_delta_.defined()) {
      delta_as_given(pair);
    } else if (recomputed_statistics_) {
      row_statistics_from_probabilities(pair);
    } else {
      delta_from_output(pair);
    }
  }

  // The sums of query block (bh, q0), which from_probabilities() fills: the row-panel
  // schedule's, which adds each pair's row shares (mass and share) to them, then calls
  // finish_block.
  struct BlockRows {
    acc_t* normalizer;  // the mass sum_j P_ij until finish_block
    acc_t* delta;       // the share sum_j P_ij dP'_ij until finish_block
  };
  BlockRows block_rows(int64_t bh, int64_t q0, int64_t rows, const AttentionDims& d) {
    BlockRows block{normalizers_.data() + bh * d.len_q + q0, delta_.data() + bh * d.len_q + q0};
    std::fill_n(block.normalizer, rows, acc_t(0));
    std::fill_n(block.delta, rows, acc_t(0));
    return block;
  }

  // A query block's mass and share turned into its normalizers 1 / l (l with the sink's share)
  // and delta = share / l.
  static void finish_block(const Pair& pair, int64_t b, int64_t h, int64_t q0, int64_t rows,
                           const BlockRows& block) {
    const acc_t* lse = pair.lse.row(b, h, q0);
    const bool sinks = pair.modifiers.has_sinks();
    const acc_t sink = sinks ? pair.modifiers.sink(h) : acc_t(0);
    for (int64_t r = 0; r < rows; ++r) {
      const acc_t mass =
          block.normalizer[r] + (sinks ? std::exp(sink - lse[r * pair.lse.row_stride]) : acc_t(0));
      // A row that sees nothing (mass 0) has no gradient: any finite normalizer serves.
      block.normalizer[r] = mass > acc_t(0) ? acc_t(1) / mass : acc_t(1);
      block.delta[r] *= block.normalizer[r];
    }
  }

 private:
  // delta_[row] = row_delta(b, h, r) for every query row, one task per (batch, query head): O(Lq)
  // memory.
  template <typename RowDelta>
  void set_delta(const AttentionDims& d, const RowDelta& row_delta) {
    at::parallel_for(0, d.batch * d.heads_q, 1, [&](int64_t begin, int64_t end) {
      for (int64_t bh = begin; bh < end; ++bh) {
        const int64_t b = bh / d.heads_q, h = bh % d.heads_q;
        for (int64_t r = 0; r < d.rows_q(b); ++r) {
          delta_[bh * d.len_q + r] = row_delta(b, h, r);
        }
      }
    });
  }

  // delta = rowsum(dO o O) in acc_t.
  void delta_from_output(const Pair& pair) {
    set_delta(pair.dims, [&](int64_t b, int64_t h, int64_t r) {
      return dot_row(pair.out.row(b, h, r), pair.grad_out.row(b, h, r), pair.dims.value_dim);
    });
  }

  // The caller's delta, over every key its rows see, of which this call holds some (a ring
  // step: lse too is over all of them, so the normalizers stay 1).
  void delta_as_given(const Pair& pair) {
    const HeadRows<const acc_t> given(given_delta_, pair.dims.cu_q);
    set_delta(pair.dims, [&](int64_t b, int64_t h, int64_t r) { return *given.row(b, h, r); });
  }

  // Each row's normalizer 1 / l, with l = sum_j P_ij (+ the sink's P) over the P = exp(x - lse)
  // the gradients recompute, and delta = sum_j P_ij dP'_ij / l (see the file comment); one task
  // per (batch, query head, query block), its key blocks summed in order.
  void row_statistics_from_probabilities(const Pair& pair) {
    const AttentionDims& d = pair.dims;
    const BlockSizes& blocks = pair.blocks;
    for_each_query_block<Scratch>(d, blocks, [&](int64_t bh, int64_t q0, Scratch& s) {
      const int64_t b = bh / d.heads_q, h = bh % d.heads_q;
      const int64_t rows = std::min(blocks.query_rows, d.rows_q(b) - q0);
      const auto qo = pair.query_operands(b, h, q0, rows, s);
      const BlockRows block = block_rows(bh, q0, rows, d);
      for_each_visible_key_block(d, blocks, b, h, q0, rows, [&](const PairPart& part) {
        const int64_t r = part.q0 - q0;
        pair.add_row_shares(bh, Pair::rows_from(qo, r),
                            pair.key_operands(b, h / d.group(), part.k0), part.q0, part.rows,
                            part.k0, part.cols, block.normalizer + r, block.delta + r, s);
      });
      finish_block(pair, b, h, q0, rows, block);
    });
  }

  // One delta per query row of every (batch, query head), the longest sequence's rows each.
  static int64_t padded_query_rows(const AttentionDims& d) { return d.batch * d.heads_q * d.len_q; }

  // Whether the row statistics come from the probabilities (see the file comment), where the
  // call gave no delta; else every normalizer stays 1.
  const bool recomputed_statistics_;
  const at::Tensor given_delta_;
  std::vector<acc_t> delta_, normalizers_;
};

}  // namespace causal_attention::cpu::CPU_CAPABILITY
