// The steps of the backward on one block pair (query rows [q0, q0 + rows) of head h, keys
// [k0, k0 + cols) of its KV head), shared by its schedules (row panels, one pass, two passes):
//   S = Q_i K_j^T;  P = exp(x(S) - lse);  dP = dO_i V_j^T;  dS = P o (dP - delta) o x'(S)
//   dV_j += P^T dO_i;  dK_j += dS^T Q_i;  dQ_i += dS K_j
// (dV_j and dK_j summed transposed, dV_j^T += dO_i^T P and dK_j^T += Q_i^T dS: add_value_gradient),
// with x the modified scores of score_modifiers.h (x' / scale = 1 - tanh^2 under softcap, else 1)
// and, under dropout, P and dP masked and scaled by 1 / (1 - p) (the factor `scale` of dK and dQ
// is applied once, when they are stored). P is recomputed from the saved lse, never stored.
//
// Operands, the same on every CPU: S and dP multiply two inputs (Q, dO by K_j^T, V_j^T) in their
// own dtype, with the products of gemm_t (for bfloat16/float16 native or widened, block_gemm.h).
// The three gradient products multiply P or dS, kept in float32, by dO, Q or K: for bfloat16 with
// P and dS as (hi, lo) bfloat16 pairs (operands.h, as the forward's O += P V_j), one native
// bfloat16 product against the rows' value pairs, or where products are widened P and dS = hi +
// lo against the rows widened to float32; for float16, float32 and float64 in float32 (float64),
// the rows widened. Rounding P and dS to bfloat16 alone for native products would add an error as
// large as the final rounding of the results: measured, dq, dk and dv up to 3x the error of SDPA's
// math path (which computes in float32) and out above SDPA's flash kernel's.
#pragma once

#include "attn_mask_view.h"
#include "geometry.h"
#include "kernel_api.h"
#include "non_finite_guard.h"
#include "online_softmax.h"
#include "operands.h"
#include "packed_kv.h"
#include "row_sources.h"
#include "schedule.h"
#include "score_modifiers.h"
#include "scratch_vector.h"

#include <ATen/OpMathType.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

namespace causal_attention::cpu::CPU_CAPABILITY {

template <typename scalar_t, typename gemm_t>
class BlockPairGradients {
  using acc_t = at::opmath_type<scalar_t>;
  using Pack = Packing<gemm_t>;         // the operands of S and dP
  using GradientPack = Packing<acc_t>;  // the operands of dV, dK and dQ
  // bfloat16 splits P and dS into (hi, lo) pairs for the gradient products: natively multiplied
  // as pairs, widened as hi + lo in float32 (the file comment).
  static constexpr bool kSplitsFactors = std::is_same_v<scalar_t, c10::BFloat16>;
  static constexpr bool kFactorPairs = kSplitsFactors && std::is_same_v<gemm_t, scalar_t>;
  // The operands of the gradient products: bfloat16 pairs, else float32 (float64).
  using factor_t = std::conditional_t<kFactorPairs, gemm_t, acc_t>;
  // Elements of an operand per value of a row it multiplies: a value pair holds it twice.
  static constexpr int64_t kPerValue = kFactorPairs ? 2 : 1;

 public:
  // The factor of a gradient product: P or dS of the current pair.
  enum Factor : int64_t { kP = 0, kDS = 1 };

  // Per-task scratch: operand tiles, the P and dS tiles, and the gradient accumulators.
  struct Scratch {
    ScratchVector<gemm_t> q_tile, do_tile;
    ScratchVector<acc_t> partial;  // one chain's S or dP (multiply_in_chains)
    // kFactorPairs: the pair's P and dS as (hi, lo) pairs row by row.
    ScratchVector<gemm_t> factor_pairs;
    // A query block's QueryRows; K_j packed for dQ, or rows the guard cleaned, packed (with
    // kFactorPairs, `words` holds their value pairs before they are transposed).
    ScratchVector<factor_t> q_t, do_t, packed_rows, words;
    ScratchVector<acc_t> p_block, ds_block, grad_a, grad_b, softcap_grad, keep_factors;
    // The current pair's P and dS (rows x cols): p_block and ds_block, or a panel slot's.
    acc_t* p = nullptr;
    acc_t* ds = nullptr;
    // The keys of the current block each query row sees: [first_visible, visible).
    std::vector<int64_t> first_visible, visible;
    BlockMasks masks;                       // of the current block pair
    std::vector<MaskRow<acc_t>> mask_rows;  // each row's attn_mask, where masks.attn_mask
    NonFiniteRowGuard<scalar_t> guard;
    // For key tiles of up to `tile` blocks.
    Scratch(const AttentionDims& d, const BlockSizes& blocks, int64_t tile)
        : q_tile(Pack::scratch_size(blocks.query_rows, d.head_dim)),
          do_tile(Pack::scratch_size(blocks.query_rows, d.value_dim)),
          partial(blocks.query_rows * blocks.keys),
          factor_pairs(kFactorPairs ? 2 * 2 * blocks.query_rows * blocks.keys : 0),
          q_t(kPerValue * blocks.query_rows * d.head_dim),
          do_t(kPerValue * blocks.query_rows * d.value_dim),
          packed_rows(kPerValue * std::max(blocks.query_rows, blocks.keys) *
                      std::max(d.head_dim, d.value_dim)),
          words(kFactorPairs ? packed_rows.size() : 0),
          p_block(blocks.query_rows * blocks.keys),
          ds_block(blocks.query_rows * blocks.keys),
          grad_a(tile * std::max(blocks.query_rows, blocks.keys) * d.head_dim),
          grad_b(tile * blocks.keys * d.value_dim),
          softcap_grad(blocks.keys),
          keep_factors(blocks.keys),
          first_visible(blocks.query_rows),
          visible(blocks.query_rows),
          mask_rows(blocks.query_rows),
          column_values(std::max(d.head_dim, d.value_dim)),
          keys_per_block(blocks.keys) {}

    // The dK_j^T and dV_j^T accumulators of block t of a key tile (D x cols and Dv x cols,
    // leading dim gradient_ld()).
    acc_t* key_gradient(int64_t t, const AttentionDims& d) {
      return grad_a.data() + t * keys_per_block * d.head_dim;
    }
    acc_t* value_gradient(int64_t t, const AttentionDims& d) {
      return grad_b.data() + t * keys_per_block * d.value_dim;
    }
    int64_t gradient_ld() const { return keys_per_block; }
    // Where key `key` of the tile (from its first) has its column in them.
    acc_t* key_gradient_column(int64_t key, const AttentionDims& d) {
      return key_gradient(key / keys_per_block, d) + key % keys_per_block;
    }
    acc_t* value_gradient_column(int64_t key, const AttentionDims& d) {
      return value_gradient(key / keys_per_block, d) + key % keys_per_block;
    }
    // Zeros the accumulators of the tile's first `tile_blocks` blocks.
    void zero_key_gradients(int64_t tile_blocks, const AttentionDims& d) {
      std::fill_n(grad_a.data(), tile_blocks * keys_per_block * d.head_dim, acc_t(0));
      std::fill_n(grad_b.data(), tile_blocks * keys_per_block * d.value_dim, acc_t(0));
    }
    // Stores the tile's keys [0, count): scale dK_j and dV_j as rows first_key + i of KV head
    // h_kv of batch item b (a column of the accumulators each).
    template <typename Rows>
    void store_key_gradients(const Rows& dk, const Rows& dv, acc_t scale, const AttentionDims& d,
                             int64_t b, int64_t h_kv, int64_t first_key, int64_t count) {
      for (int64_t c = 0; c < count; ++c) {
        dk.store(column(key_gradient_column(c, d), d.head_dim), d.head_dim, scale, b, h_kv,
                 first_key + c);
        dv.store(column(value_gradient_column(c, d), d.value_dim), d.value_dim, acc_t(1), b, h_kv,
                 first_key + c);
      }
    }
    // kFactorPairs: the (hi, lo) pairs of P or of dS (rows x cols pairs: a VNNI B of 2 rows
    // reduction rows, leading dim cols).
    gemm_t* pairs(Factor which) { return factor_pairs.data() + which * factor_pairs.size() / 2; }

   private:
    // The n values from `top` down a column of the transposed accumulators, as one row.
    const acc_t* column(const acc_t* top, int64_t n) {
      for (int64_t i = 0; i < n; ++i) {
        column_values[i] = top[i * keys_per_block];
      }
      return column_values.data();
    }
    std::vector<acc_t> column_values;  // column()'s
    int64_t keys_per_block;
  };

  // The operands of one query block (Q_i, dO_i as A) or one key block (K_j^T, V_j^T as B).
  struct QueryOperands {
    Operand<gemm_t> q, grad_out;
  };
  struct KeyOperands {
    Operand<gemm_t> k_t, v_t;
  };
  // Q_i^T and dO_i^T, the A operands of dK_j^T += Q_i^T dS and dV_j^T += dO_i^T P, made once for
  // all the key blocks a query block meets: as value pairs (v, v) where kFactorPairs (D x 2 rows),
  // else in float32 (float64).
  struct QueryRows {
    Operand<factor_t> q_t, grad_out_t;
  };

  // delta: one value per query row; normalizers: one factor per query row that P is scaled by
  // (backward_row_statistics.h).
  BlockPairGradients(const BackwardTensors& t, const acc_t* delta, const acc_t* normalizers)
      : dims(t),
        blocks(block_sizes<gemm_t>(dims)),
        q(t.q, dims.cu_q),
        k(t.k, dims.cu_k),
        v(t.v, dims.cu_k),
        out(t.out, dims.cu_q),
        grad_out(t.grad_out, dims.cu_q),
        lse(t.lse, dims.cu_q),
        delta(delta),
        normalizers(normalizers),
        scale(static_cast<acc_t>(t.scale)),
        modifiers(t),
        packed(dims, k, v, blocks.keys),
        mask_grad(t.dattn_mask.defined() ? t.dattn_mask.template data_ptr<acc_t>() : nullptr) {}

  QueryOperands query_operands(int64_t b, int64_t h, int64_t q0, int64_t rows, Scratch& s) const {
    return {Pack::a(q.row(b, h, q0), rows, dims.head_dim, q.row_stride, s.q_tile.data()),
            Pack::a(grad_out.row(b, h, q0), rows, dims.value_dim, grad_out.row_stride,
                    s.do_tile.data())};
  }

  // The operands of a query block from its row r on.
  static QueryOperands rows_from(const QueryOperands& qo, int64_t r) {
    return {{qo.q.data + r * qo.q.ld, qo.q.ld},
            {qo.grad_out.data + r * qo.grad_out.ld, qo.grad_out.ld}};
  }

  // The QueryRows of the query block of `qo` (query_operands(b, h, q0, rows, s)): from the rows
  // S and dP multiply where those are float32 (float64), else from the inputs.
  QueryRows query_rows(const QueryOperands& qo, int64_t b, int64_t h, int64_t q0, int64_t rows,
                       Scratch& s) const {
    if constexpr (std::is_same_v<gemm_t, acc_t>) {
      return {GradientPack::a_transposed(qo.q.data, rows, dims.head_dim, qo.q.ld, s.q_t.data()),
              GradientPack::a_transposed(qo.grad_out.data, rows, dims.value_dim, qo.grad_out.ld,
                                         s.do_t.data())};
    } else {
      return {
          rows_transposed({q.row(b, h, q0), q.row_stride}, rows, dims.head_dim, s.q_t.data(), s),
          rows_transposed({grad_out.row(b, h, q0), grad_out.row_stride}, rows, dims.value_dim,
                          s.do_t.data(), s)};
    }
  }

  // The QueryRows of a query block from its row r on: its columns from r on.
  static QueryRows rows_from(const QueryRows& qr, int64_t r) {
    return {{qr.q_t.data + r * kPerValue, qr.q_t.ld},
            {qr.grad_out_t.data + r * kPerValue, qr.grad_out_t.ld}};
  }

  // K_j^T and V_j^T of the key block from k0 (or of its keys from k0), packed once per call
  // (packed_kv.h; of a pair whose group is packed).
  KeyOperands key_operands(int64_t b, int64_t h_kv, int64_t k0) const {
    return {packed.keys_t(b, h_kv, k0), packed.values_t(b, h_kv, k0)};
  }

  // Where the row-panel schedule keeps the first step of a pair (backward_row_panels.h): P and
  // dP' (rows x cols each), and the softcap factors of each row where a softcap applies (else
  // null).
  struct PanelSlot {
    acc_t *p, *dp, *softcap_grad;
  };

  // S, P, dP and dS of the pair into s.p (P) and s.ds (dS); s.first_visible, s.visible,
  // s.masks and s.mask_rows the keys each row sees. With record_mask_gradient, also attn_mask's
  // gradient of the pair, where it is asked for (each pair records it once).
  void probabilities_and_gradients(int64_t bh, const QueryOperands& qo, const KeyOperands& ko,
                                   int64_t q0, int64_t rows, int64_t k0, int64_t cols,
                                   bool record_mask_gradient, Scratch& s) const {
    const int64_t b = bh / dims.heads_q, h = bh % dims.heads_q;
    s.p = s.p_block.data();
    s.ds = s.ds_block.data();
    scores_and_output_gradients(qo, ko, rows, cols, s);
    const acc_t* row_lse = lse.row(b, h, q0);
    // P = exp(x - lse);  dP' = dP o keep / (1 - p)
    finish_gradients(bh, q0, rows, k0, cols, record_mask_gradient, s,
                     [&](int64_t r, const RowScoring<acc_t>& scoring, KeyRange visible) {
                       return FirstStepRow{
                           probabilities_row(s.p + r * cols, s.ds + r * cols, visible, cols,
                                             scoring, row_lse[r], row_scratch(s))
                               .range,
                           row_scratch(s)};
                     });
  }

  // The same from the first step's P and dP' kept in `slot` (every pair records attn_mask's
  // gradient: the row-panel schedule finishes each pair once).
  void gradients_from_panel(int64_t bh, const PanelSlot& slot, int64_t q0, int64_t rows, int64_t k0,
                            int64_t cols, Scratch& s) const {
    const int64_t b = bh / dims.heads_q, h = bh % dims.heads_q;
    s.p = slot.p;  // finished in place
    s.ds = slot.dp;
    const acc_t* row_lse = lse.row(b, h, q0);
    finish_gradients(bh, q0, rows, k0, cols, /*record_mask_gradient=*/true, s,
                     [&](int64_t r, const RowScoring<acc_t>& scoring, KeyRange range) {
                       // The keys probabilities_row reached, and the scratch it left (the
                       // softcap factors in the slot; the dropout mask made again).
                       if (row_lse[r] == -std::numeric_limits<acc_t>::infinity()) {
                         range.end = range.begin;
                       }
                       const GradientRowScratch<acc_t> scratch = panel_scratch(slot, r, cols, s);
                       if (scoring.dropout) {
                         scoring.keep_factors(scratch.keep_factors, range.begin, range.end,
                                              scoring.keep_scale);
                       }
                       return FirstStepRow{range, scratch};
                     });
  }

  // For each row r of the pair: mass_r += sum_j P_rj and share_r += sum_j P_rj dP'_rj over its
  // visible keys (row_shares): the row-statistics step of the backward. With `keep`, P and dP'
  // (and the softcap factors) are left there for gradients_from_panel.
  void add_row_shares(int64_t bh, const QueryOperands& qo, const KeyOperands& ko, int64_t q0,
                      int64_t rows, int64_t k0, int64_t cols, acc_t* mass, acc_t* share, Scratch& s,
                      const PanelSlot* keep = nullptr) const {
    const int64_t b = bh / dims.heads_q, h = bh % dims.heads_q;
    s.p = keep != nullptr ? keep->p : s.p_block.data();
    s.ds = keep != nullptr ? keep->dp : s.ds_block.data();
    scores_and_output_gradients(qo, ko, rows, cols, s);
    const acc_t* row_lse = lse.row(b, h, q0);
    const BlockMasks masks = dims.block_masks(b, h, q0, rows, k0, cols);
    for (int64_t r = 0; r < rows; ++r) {
      const GradientRowScratch<acc_t> scratch =
          keep != nullptr ? panel_scratch(*keep, r, cols, s) : row_scratch(s);
      const RowShares<acc_t> row =
          row_shares(s.p + r * cols, s.ds + r * cols, dims.visible_in_block(b, q0 + r, k0, cols),
                     cols, modifiers.row(dims, b, h, q0 + r, k0, masks), row_lse[r], scratch);
      mass[r] += row.mass;
      share[r] += row.share;
    }
  }

  // dV_j^T += dO_i^T P (into dv_t, Dv x cols, leading dim ld); qr the QueryRows of the pair's
  // query rows. Transposed, so that P is B as it lies (or as its row-major pairs, a VNNI B) and
  // dO_i^T, made once a query block, is A: no transpose of P a pair.
  void add_value_gradient(int64_t b, int64_t h, int64_t q0, int64_t rows, int64_t k0, int64_t cols,
                          const QueryRows& qr, acc_t* dv_t, int64_t ld, Scratch& s) const {
    add_transposed_gradient(Factor::kP, {grad_out.row(b, h, q0), grad_out.row_stride},
                            qr.grad_out_t, dims.value_dim, b, q0, rows, k0, cols, dv_t, ld, s);
  }

  // dK_j^T += Q_i^T dS (into dk_t, D x cols, leading dim ld); as above.
  void add_key_gradient(int64_t b, int64_t h, int64_t q0, int64_t rows, int64_t k0, int64_t cols,
                        const QueryRows& qr, acc_t* dk_t, int64_t ld, Scratch& s) const {
    add_transposed_gradient(Factor::kDS, {q.row(b, h, q0), q.row_stride}, qr.q_t, dims.head_dim, b,
                            q0, rows, k0, cols, dk_t, ld, s);
  }

  // acc (rows x D) += dS K_j (dS in s.ds): the dQ product. Through the non-finite guard;
  // kFactorPairs multiplies dS's pairs by K_j's value pairs (packed once a call, or from the rows
  // the guard cleaned), else dS by K_j widened.
  void add_query_product(int64_t b, int64_t h_kv, int64_t q0, int64_t rows, int64_t k0,
                         int64_t cols, acc_t* acc, int64_t ld_acc, Scratch& s) const {
    const int64_t D = dims.head_dim;
    const Operand<factor_t> ds = factor_operand(Factor::kDS, /*as_a=*/true, cols, s);
    const Operand<scalar_t> key_rows{k.row(b, h_kv, k0), k.row_stride};
    s.guard.multiply_add_by(
        dims.has_masked_entries(b, q0, rows, k0, cols, s.masks), rows, D, cols,
        masked_factor(s.ds, cols, /*transposed=*/false, s), key_rows,
        [&](Operand<scalar_t> source) {
          Operand<factor_t> keys;
          if constexpr (kFactorPairs) {
            keys = source.data == key_rows.data
                       ? packed.key_pairs(b, h_kv, k0)
                       : Pack::b_value_pairs(source.data, cols, D, source.ld, s.packed_rows.data());
          } else {
            keys = GradientPack::b(source.data, cols, D, source.ld, s.packed_rows.data());
          }
          multiply(rows, D, kPerValue * cols, ds, keys, acc, ld_acc, /*accumulate=*/true);
        },
        acc, ld_acc);
  }

  const AttentionDims dims;
  const BlockSizes blocks;
  const HeadRows<const scalar_t> q, k, v, out, grad_out;
  const HeadRows<const acc_t> lse;
  const acc_t* const delta;        // (batch * heads_q, len_q)
  const acc_t* const normalizers;  // likewise
  const acc_t scale;
  const ScoreModifiers<acc_t> modifiers;
  // Packed by the schedule that reads them (attention_backward_kernel.cpp), a group of (batch,
  // KV head) pairs at a time or all at once.
  PackedKeyValues<scalar_t, gemm_t, ValueOperand::kTransposed> packed;
  acc_t* const mask_grad;  // (batch * heads_q, len_q, len_k) where asked for, else null

 private:
  // What the first step leaves of a row: the keys it reaches, and its scratch (softcap factors,
  // dropout mask).
  struct FirstStepRow {
    KeyRange range;
    GradientRowScratch<acc_t> scratch;
  };

  // The rows of a pair from P and dP' on: each row's scoring and keys, first_step(r, scoring,
  // visible keys) leaving its P and dP' in s.p and s.ds and returning its FirstStepRow; then
  // dS = P o (dP' - delta) o x' (finish_gradient_row).
  template <typename FirstStep>
  void finish_gradients(int64_t bh, int64_t q0, int64_t rows, int64_t k0, int64_t cols,
                        bool record_mask_gradient, Scratch& s, const FirstStep& first_step) const {
    const int64_t b = bh / dims.heads_q, h = bh % dims.heads_q;
    const acc_t* row_delta = delta + bh * dims.len_q + q0;
    const acc_t* row_normalizer = normalizers + bh * dims.len_q + q0;
    s.masks = dims.block_masks(b, h, q0, rows, k0, cols);
    acc_t* mask_grad_rows = record_mask_gradient && mask_grad
                                ? mask_grad + ((bh * dims.len_q + q0) * dims.len_k + k0)
                                : nullptr;
    for (int64_t r = 0; r < rows; ++r) {
      const RowScoring<acc_t> scoring = modifiers.row(dims, b, h, q0 + r, k0, s.masks);
      s.mask_rows[r] = scoring.mask;
      const auto [range, scratch] =
          first_step(r, scoring, dims.visible_in_block(b, q0 + r, k0, cols));
      // dS = P o (dP' - delta) o x'
      finish_gradient_row(s.p + r * cols, s.ds + r * cols, range, cols, scoring, row_normalizer[r],
                          row_delta[r], scratch,
                          mask_grad_rows ? mask_grad_rows + r * dims.len_k : nullptr);
      s.first_visible[r] = range.begin;
      s.visible[r] = range.end;
      // The row's P and dS as the gradient products take them, while the row is in L1: as
      // pairs (the zeros around its keys too), or as the values of pairs (zeros stay zeros).
      if constexpr (kFactorPairs) {
        split_into_pairs(s.p + r * cols, cols, s.pairs(Factor::kP) + 2 * r * cols);
        split_into_pairs(s.ds + r * cols, cols, s.pairs(Factor::kDS) + 2 * r * cols);
      } else if constexpr (kSplitsFactors) {
        round_to_pairs(s.p + r * cols + range.begin, range.end - range.begin);
        round_to_pairs(s.ds + r * cols + range.begin, range.end - range.begin);
      }
    }
  }

  // S = Q_i K_j^T into s.p;  dP = dO_i V_j^T into s.ds (in chains: schedule.h, score_chain)
  void scores_and_output_gradients(const QueryOperands& qo, const KeyOperands& ko, int64_t rows,
                                   int64_t cols, Scratch& s) const {
    const int64_t chain = score_chain(dims);
    multiply_in_chains(rows, cols, dims.head_dim, qo.q, ko.k_t, s.p, cols, chain, s.partial.data());
    multiply_in_chains(rows, cols, dims.value_dim, qo.grad_out, ko.v_t, s.ds, cols, chain,
                       s.partial.data());
  }

  // P or dS of the current pair as the guard reads it (non_finite_guard.h).
  static MaskedFactor<acc_t> masked_factor(const acc_t* values, int64_t cols, bool transposed,
                                           const Scratch& s) {
    return {values,
            cols,
            s.first_visible.data(),
            s.visible.data(),
            transposed,
            s.masks.kept,
            s.masks.attn_mask ? s.mask_rows.data() : nullptr};
  }

  static GradientRowScratch<acc_t> row_scratch(Scratch& s) {
    return {s.softcap_grad.data(), s.keep_factors.data()};
  }
  // Row r's scratch where its softcap factors live in a panel slot.
  static GradientRowScratch<acc_t> panel_scratch(const PanelSlot& slot, int64_t r, int64_t cols,
                                                 Scratch& s) {
    return {slot.softcap_grad != nullptr ? slot.softcap_grad + r * cols : s.softcap_grad.data(),
            s.keep_factors.data()};
  }

  // The pair's P or dS (rows x cols) as the gradient products take them: its (hi, lo) pairs
  // row by row where kFactorPairs, else itself. As A (dQ's dS) the pairs are rows of 2 cols
  // values; as B (dV's P, dK's dS) a VNNI operand of 2 rows reduction rows by cols, whose
  // leading dim counts pairs.
  static Operand<factor_t> factor_operand(Factor which, bool as_a, int64_t cols, Scratch& s) {
    if constexpr (kFactorPairs) {
      return {s.pairs(which), as_a ? 2 * cols : cols};
    } else {
      return {which == Factor::kP ? s.p : s.ds, cols};
    }
  }

  // `rows` (n x width, the inputs) transposed: width x n, as value pairs where kFactorPairs
  // (width x 2n), else widened.
  Operand<factor_t> rows_transposed(Operand<scalar_t> rows, int64_t n, int64_t width,
                                    factor_t* scratch, Scratch& s) const {
    if constexpr (kFactorPairs) {
      const Operand<gemm_t> pairs =
          Pack::b_value_pairs(rows.data, n, width, rows.ld, s.words.data());
      return Pack::a_transposed_words(pairs.data, n, width, scratch);
    } else {
      return GradientPack::a_transposed(rows.data, n, width, rows.ld, scratch);
    }
  }

  // acc (width x cols, leading dim ld) += rows_i^T F, F the pair's P or dS (rows x cols) and
  // rows_i the query rows `rows_of` (rows x width), as `rows_t` holds them transposed (QueryRows)
  // unless the guard cleaned them. kFactorPairs multiplies by F's pairs, else by F in float32.
  void add_transposed_gradient(Factor which, Operand<scalar_t> rows_of, Operand<factor_t> rows_t,
                               int64_t width, int64_t b, int64_t q0, int64_t rows, int64_t k0,
                               int64_t cols, acc_t* acc, int64_t ld, Scratch& s) const {
    const Operand<factor_t> factor = factor_operand(which, /*as_a=*/false, cols, s);
    s.guard.multiply_add_by(
        dims.has_masked_entries(b, q0, rows, k0, cols, s.masks), width, cols, rows,
        masked_factor(which == Factor::kP ? s.p : s.ds, cols, /*transposed=*/true, s), rows_of,
        [&](Operand<scalar_t> source) {
          const Operand<factor_t> a =
              source.data == rows_of.data
                  ? rows_t
                  : rows_transposed(source, rows, width, s.packed_rows.data(), s);
          multiply(width, cols, kPerValue * rows, a, factor, acc, ld, /*accumulate=*/true);
        },
        acc, ld);
  }
};

}  // namespace causal_attention::cpu::CPU_CAPABILITY
