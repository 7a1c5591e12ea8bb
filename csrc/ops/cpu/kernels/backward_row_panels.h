// The gradients step of the backward where the row statistics come from the probabilities
// (backward_row_statistics.h: bfloat16 and float16, a forward that decoded, attn_mask's gradient)
// and there are enough (batch, KV head) items to share between threads.
//
// Summing delta = sum_j P_ij dP'_ij from the very P and dP' that dS reads keeps dS exact to
// float32 rounding (and 0 for a row that sees one key), but delta must be known before a row's
// first dS. The two-step way computes S and dP of every pair twice, once for the statistics and
// once for the gradients (7 block products a pair). Here a task owns a (batch, KV head) and walks
// its query blocks, query head after query head; for each it computes S and dP of every key block
// the block sees once, keeps P and dP' in a panel (query rows x the keys they see: O(Lk) per
// task), sums the block's statistics from it, then finishes each pair's dS from the panel and
// adds dV_j and dK_j (into the task's float32 accumulators of all its keys) and dQ_i, which is
// complete when the block's pairs are done. 5 block products a pair; each gradient element is
// still summed by one task in a fixed order (dK_j, dV_j over the group's query heads, then
// their query blocks, in order), so results stay bitwise identical at any thread count.
//
// Included only by the per-instruction-set kernel sources (see geometry.h).
#pragma once

#include "backward_block_pair.h"
#include "backward_block_walks.h"
#include "backward_row_statistics.h"
#include "geometry.h"
#include "gradient_rows.h"
#include "schedule.h"
#include "scratch_vector.h"

#include <ATen/OpMathType.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace causal_attention::cpu::CPU_CAPABILITY {

template <typename scalar_t, typename gemm_t>
class RowPanelGradients {
  using acc_t = at::opmath_type<scalar_t>;
  using Pair = BlockPairGradients<scalar_t, gemm_t>;
  using Statistics = RowStatistics<scalar_t, gemm_t>;
  using Rows = GradientRows<scalar_t, acc_t>;

 public:
  RowPanelGradients(const Pair& pair, Statistics& statistics, const Rows& dq, const Rows& dk,
                    const Rows& dv)
      : pair_(pair),
        statistics_(statistics),
        dq_(dq),
        dk_(dk),
        dv_(dv),
        dims_(pair.dims),
        blocks_(pair.blocks) {}

  // Every gradient of (batch, KV head) pairs [first, last), whose blocks are packed.
  void run(int64_t first, int64_t last) {
    for_each_key_value_head(
        dims_, first, last, [&] { return Scratch(dims_, blocks_); },
        [&](int64_t bh_kv, Scratch& s) { key_value_head(bh_kv, s); });
  }

 private:
  struct Scratch {
    typename Pair::Scratch pair;
    // The panel of one query block: P, dP' and (under a softcap) its factors, part after part.
    ScratchVector<acc_t> p, dp, softcap_grad;
    ScratchVector<acc_t> dq;  // dQ of a query block
    std::vector<PairPart> parts;
    // dK^T and dV^T of every key of the task: the pair's key tile of all the key blocks.
    Scratch(const AttentionDims& d, const BlockSizes& blocks)
        : pair(d, blocks, /*tile=*/ceil_div(d.len_k, blocks.keys)),
          p(blocks.query_rows * d.len_k),
          dp(p.size()),
          dq(blocks.query_rows * d.head_dim) {}
  };

  // Every gradient of one (batch, KV head).
  void key_value_head(int64_t bh_kv, Scratch& s) const {
    const int64_t b = bh_kv / dims_.heads_kv, h_kv = bh_kv % dims_.heads_kv;
    const int64_t keys = dims_.rows_k(b);
    s.pair.zero_key_gradients(ceil_div(keys, blocks_.keys), dims_);
    if (pair_.modifiers.has_softcap() && s.softcap_grad.empty()) {
      s.softcap_grad.resize(s.p.size());
    }
    for (int64_t h = h_kv * dims_.group(); h < (h_kv + 1) * dims_.group(); ++h) {
      for (int64_t q0 = 0; q0 < dims_.rows_q(b); q0 += blocks_.query_rows) {
        query_block(b, h, q0, s);
      }
    }
    s.pair.store_key_gradients(dk_, dv_, pair_.scale, dims_, b, h_kv, 0, keys);
  }

  // Query block q0 of head h: its statistics, then its gradients, from one panel.
  void query_block(int64_t b, int64_t h, int64_t q0, Scratch& s) const {
    const int64_t bh = b * dims_.heads_q + h, h_kv = h / dims_.group();
    const int64_t rows = std::min(blocks_.query_rows, dims_.rows_q(b) - q0);
    const auto qo = pair_.query_operands(b, h, q0, rows, s.pair);
    const auto qr = pair_.query_rows(qo, b, h, q0, rows, s.pair);
    // S, dP -> P, dP' into the panel; mass and share per row.
    const typename Statistics::BlockRows block = statistics_.block_rows(bh, q0, rows, dims_);
    s.parts.clear();
    int64_t offset = 0;
    for_each_visible_key_block(dims_, blocks_, b, h, q0, rows, [&](const PairPart& part) {
      const int64_t r = part.q0 - q0;
      const typename Pair::PanelSlot slot = panel_slot(offset, s);
      pair_.add_row_shares(bh, Pair::rows_from(qo, r), pair_.key_operands(b, h_kv, part.k0),
                           part.q0, part.rows, part.k0, part.cols, block.normalizer + r,
                           block.delta + r, s.pair, &slot);
      s.parts.push_back(part);
      offset += part.rows * part.cols;
    });
    Statistics::finish_block(pair_, b, h, q0, rows, block);
    // dS from the panel; dV_j += P^T dO_i;  dK_j += dS^T Q_i;  dQ_i += dS K_j
    std::fill_n(s.dq.data(), rows * dims_.head_dim, acc_t(0));
    offset = 0;
    for (const PairPart& part : s.parts) {
      const auto [part_q0, part_rows, k0, cols] = part;
      pair_.gradients_from_panel(bh, panel_slot(offset, s), part_q0, part_rows, k0, cols, s.pair);
      const auto part_rows_of = Pair::rows_from(qr, part_q0 - q0);
      pair_.add_value_gradient(b, h, part_q0, part_rows, k0, cols, part_rows_of,
                               s.pair.value_gradient_column(k0, dims_), s.pair.gradient_ld(),
                               s.pair);
      pair_.add_key_gradient(b, h, part_q0, part_rows, k0, cols, part_rows_of,
                             s.pair.key_gradient_column(k0, dims_), s.pair.gradient_ld(), s.pair);
      pair_.add_query_product(b, h_kv, part_q0, part_rows, k0, cols,
                              s.dq.data() + (part_q0 - q0) * dims_.head_dim, dims_.head_dim,
                              s.pair);
      offset += part_rows * cols;
    }
    for (int64_t r = 0; r < rows; ++r) {
      dq_.store(s.dq.data() + r * dims_.head_dim, dims_.head_dim, pair_.scale, b, h, q0 + r);
    }
  }

  static typename Pair::PanelSlot panel_slot(int64_t offset, Scratch& s) {
    return {s.p.data() + offset, s.dp.data() + offset,
            s.softcap_grad.empty() ? nullptr : s.softcap_grad.data() + offset};
  }

  const Pair& pair_;
  Statistics& statistics_;
  const Rows &dq_, &dk_, &dv_;
  const AttentionDims& dims_;
  const BlockSizes& blocks_;
};

}  // namespace causal_attention::cpu::CPU_CAPABILITY
