// The online softmax: the per-row state (running max m, sum l and unnormalized output O) that a
// query block carries across its key blocks, its fused update (the score modifiers of
// score_modifiers.h inside it), the finish into out and lse (sinks joining the denominator), and
// the backward's recomputation of P and dS from lse. Vectorized with at::vec.
#pragma once

#include "geometry.h"
#include "row_ops.h"
#include "score_modifiers.h"
#include "scratch_vector.h"

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>

namespace causal_attention::cpu::CPU_CAPABILITY {

// The scores are scaled in place before any exponential, so that the row max and every
// exp(x - shift) read the same rounded x. Fusing the scale into the exponent's argument,
// exp(fma(S, scale, -max)), would compute S * scale exactly against a rounded max: with
// scale = 1e10 and float32 the two differ by up to half an ulp of 1e11 (4096), and exp(+-4096)
// overflows or vanishes, turning rows into NaN or zeros.

// row[c] = (row[c] + rest[c]) * scale (without rest where it is null: kAddsRest) for c in
// [begin, end), returning their max (NaN if one is NaN, -inf if none), in one pass: the plain
// scores' fast path. rest is the last chain of the scores' products (multiply_in_chains_but_last),
// added as the row is read. The max is taken in four chains of vectors, combined at the end (a
// max is exact, so the order changes nothing): one chain's NaN-keeping maximum is 8 cycles of
// latency a vector, which bound the loop (a sixth of a bfloat16 forward's samples at L 2048, D
// 128 on an AMX Xeon). The last partial vector is loaded and stored under a mask: a diagonal
// block's rows end anywhere, and a scalar loop over their tails (a NaN test a column) was a large
// part of a short row's fold (with zero_columns and the first block's skipped rescaling, a tenth
// fewer of the fold's samples at L = 64 on an AMX Xeon).
template <bool kAddsRest, typename acc_t>
inline acc_t scale_and_max(acc_t* row, const acc_t* rest, int64_t begin, int64_t end, acc_t scale) {
  using Vec = at::vec::Vectorized<acc_t>;
  constexpr int64_t N = Vec::size(), kChains = 4;
  const Vec scale_vec(scale), lowest(-std::numeric_limits<acc_t>::infinity());
  const auto scaled = [&](int64_t c) {
    if constexpr (kAddsRest) {
      return (Vec::loadu(row + c) + Vec::loadu(rest + c)) * scale_vec;
    } else {
      return Vec::loadu(row + c) * scale_vec;
    }
  };
  Vec max_vecs[kChains] = {lowest, lowest, lowest, lowest};
  int64_t c = begin;
  for (; c + kChains * N <= end; c += kChains * N) {
#pragma GCC unroll 4
    for (int64_t i = 0; i < kChains; ++i) {
      const Vec x = scaled(c + i * N);
      x.store(row + c + i * N);
      max_vecs[i] = at::vec::maximum(max_vecs[i], x);
    }
  }
  for (; c + N <= end; c += N) {
    const Vec x = scaled(c);
    x.store(row + c);
    max_vecs[0] = at::vec::maximum(max_vecs[0], x);
  }
  if (c < end) {
    const int64_t tail = end - c;
    Vec x = Vec::loadu(row + c, tail);
    if constexpr (kAddsRest) {
      x = x + Vec::loadu(rest + c, tail);
    }
    x = x * scale_vec;
    x.store(row + c, tail);
    max_vecs[0] = at::vec::maximum(max_vecs[0], Vec::set(lowest, x, tail));
  }
  const Vec max_vec = at::vec::maximum(at::vec::maximum(max_vecs[0], max_vecs[1]),
                                       at::vec::maximum(max_vecs[2], max_vecs[3]));
  // The lanes' max by plain maxima once one test has found no NaN lane: the NaN-keeping maximum's
  // latency at each of the reduction's steps was two thirds of this function's samples (bfloat16
  // forward, L 4096, D 64, Zen 5). (The plain maximum of equal zeros may return either sign; the
  // max is only subtracted and added, where -0 and +0 give the same.)
  constexpr int kAllLanes = (1 << N) - 1;
  if (max_vec.isnan().zero_mask() != kAllLanes) {
    return std::numeric_limits<acc_t>::quiet_NaN();
  }
  return at::vec::vec_reduce_all<acc_t>([](Vec& a, Vec& b) { return at::vec::clamp_min(a, b); },
                                        max_vec);
}

// row[c] = 0 for c in [begin, end): vector stores, the last one masked (for the few columns
// around a row's visible keys, where a call of memset costs more than the stores).
template <typename acc_t>
inline void zero_columns(acc_t* row, int64_t begin, int64_t end) {
  using Vec = at::vec::Vectorized<acc_t>;
  const Vec zero(acc_t(0));
  int64_t c = begin;
  for (; c + Vec::size() <= end; c += Vec::size()) {
    zero.store(row + c);
  }
  if (c < end) {
    zero.store(row + c, end - c);
  }
}

// The scores x of row[begin, end) (score_modifiers.h), with the last chain of the scores'
// products added first where `rest` holds it, returning their max.
template <typename acc_t>
inline acc_t score_row(const RowScoring<acc_t>& scoring, acc_t* row, int64_t begin, int64_t end,
                       acc_t* softcap_grad = nullptr, const acc_t* rest = nullptr) {
  if (scoring.plain()) {
    return rest ? scale_and_max<true>(row, rest, begin, end, scoring.scale)
                : scale_and_max<false>(row, rest, begin, end, scoring.scale);
  }
  if (rest) {
    add_row(row + begin, rest + begin, end - begin);
  }
  return scoring.apply(row, begin, end, softcap_grad);
}

// What exp_and_lane_sums may assume of its arguments row[c] - shift.
enum class ExpArguments {
  // Anything: shift is the backward's lse, which may sit below a score that the backward
  // recomputes in another summation order than the forward did, or be NaN (a poisoned row).
  kAny,
  // Never NaN and never above 0: shift is the forward's finite row max of these very x (x <= max
  // gives x - max <= 0 exactly), and no x is NaN (its max would be NaN). The exponential then
  // needs neither the clamp nor the NaN select (three instructions a vector in the fold's hottest
  // loop), the results bitwise the same.
  kNotAboveShift,
};

// row[c] = exp(min(row[c] - shift, 0)) for c in [begin, end), 0 for the other c < cols; returns
// the sums of the exponentials lane by lane (c's lane: (c - begin) % Vec::size()). shift = the row
// max in the forward, lse in the backward, so the argument is never positive in exact arithmetic.
// The backward may recompute a score in another summation order than the forward did (the decode
// path's dot products against the block products): at an absurd scale (scale * |q.k| above ~1e9 in
// float32) that rounding difference alone exceeds exp's range, and the clamp keeps P a probability
// instead of inf. The clamp is clamp_max, not minimum: one instruction that keeps a NaN argument as
// minimum does (against 0, never NaN itself), where minimum tests for NaN apart.
template <ExpArguments kArguments, typename acc_t>
inline at::vec::Vectorized<acc_t> exp_and_lane_sums(acc_t* row, int64_t begin, int64_t end,
                                                    int64_t cols, acc_t shift) {
  using Vec = at::vec::Vectorized<acc_t>;
  const Vec shift_vec(shift), zero(acc_t(0));
  const auto exponential = [&](Vec x) {
    if constexpr (kArguments == ExpArguments::kNotAboveShift) {
      return exp_non_positive(x - shift_vec);
    } else {
      return exp_non_positive_keeping_nan(at::vec::clamp_max(x - shift_vec, zero));
    }
  };
  Vec sum_vec(acc_t(0));
  int64_t c = begin;
  for (; c + Vec::size() <= end; c += Vec::size()) {
    const Vec p = exponential(Vec::loadu(row + c));
    p.store(row + c);
    sum_vec = sum_vec + p;
  }
  if (c < end) {
    const int64_t tail = end - c;
    const Vec p = exponential(Vec::loadu(row + c, tail));
    p.store(row + c, tail);
    sum_vec = sum_vec + Vec::set(Vec(acc_t(0)), p, tail);
  }
  zero_columns(row, 0, begin);
  zero_columns(row, end, cols);
  return sum_vec;
}

// The online-softmax state of a set of query rows: row max, row sum and unnormalized output.
template <typename acc_t>
struct RowState {
  using Vec = at::vec::Vectorized<acc_t>;
  // The row sums are kept a vector of lanes a row (row_sum adds them up once, as the row is
  // finished): a block's exponentials are added lane by lane, without a horizontal sum a row and
  // block (a fifth of the exponential pass's samples on a Zen 5, its rows being 64 or 128 keys).
  ScratchVector<acc_t> max, sum_lanes, out;  // filled for a tile's rows by reset
  int64_t value_dim;

  RowState(int64_t rows, int64_t value_dim)
      : max(rows), sum_lanes(rows * Vec::size()), out(rows * value_dim), value_dim(value_dim) {}

  void reset(int64_t rows) {
    std::fill_n(max.begin(), rows, -std::numeric_limits<acc_t>::infinity());
    std::fill_n(sum_lanes.begin(), rows * Vec::size(), acc_t(0));
    std::fill_n(out.begin(), rows * value_dim, acc_t(0));
  }

  // l of row r.
  acc_t row_sum(int64_t r) const {
    return at::vec::vec_reduce_all<acc_t>([](Vec& a, Vec& b) { return a + b; },
                                          Vec::loadu(sum_lanes.data() + r * Vec::size()));
  }

  // Folds one block of raw scores q.k of row r (keys [range.begin, range.end) of `cols`
  // visible, less those the key mask hides; last_chain, where given, the last chain of the
  // products of q.k, added first) into its state, and leaves the block's
  // probabilities (relative to the new max, zero where dropout drops them) in `scores`:
  //   m' = max(m, rowmax(x)); P = exp(x - m'); l = e^(m - m') l + rowsum(P);
  //   O = e^(m - m') O  (the caller then adds P V; finish_row applies 1 / (1 - p)).
  void fold_row(acc_t* scores, int64_t r, KeyRange range, int64_t cols,
                const RowScoring<acc_t>& scoring, const acc_t* last_chain = nullptr) {
    const acc_t block_max = score_row<acc_t>(scoring, scores, range.begin, range.end,
                                             /*softcap_grad=*/nullptr, last_chain);
    const acc_t old_max = max[r];
    const acc_t new_max = std::isnan(block_max) ? block_max : std::max(old_max, block_max);
    if (new_max == -std::numeric_limits<acc_t>::infinity() || std::isnan(new_max)) {
      // Nothing visible yet, or a NaN score: the row contributes nothing further, and a NaN
      // max marks it so that finish_row returns NaN for it (and only for it).
      max[r] = new_max;
      std::fill(scores, scores + cols, acc_t(0));
      return;
    }
    // Once a row's max has settled, most blocks leave it unchanged: e^0 = 1 exactly, without
    // the scalar exp (one a row and block, a few percent of a forward's time). A row's first
    // visible block has nothing to rescale: e^-inf = 0, and its sum and O are still zeros.
    const bool first_visible_block = old_max == -std::numeric_limits<acc_t>::infinity();
    const acc_t correction =
        new_max == old_max || first_visible_block ? acc_t(1) : std::exp(old_max - new_max);
    // One multiply-add a lane, written as one so that no compiler choice of fusing changes it.
    acc_t* lanes = sum_lanes.data() + r * Vec::size();
    at::vec::fmadd(Vec::loadu(lanes), Vec(correction), probabilities(scores, range, cols, new_max))
        .store(lanes);
    max[r] = new_max;
    if (scoring.dropout) {
      scoring.drop(scores, range.begin, range.end, acc_t(1));
    }
    if (correction != acc_t(1)) {
      scale_row(out.data() + r * value_dim, value_dim, correction);
    }
  }

 private:
  // P = exp(x - max) over the row's keys of the block (exp_and_lane_sums), max its new finite or
  // +inf max; returns their sums lane by lane.
  static Vec probabilities(acc_t* scores, KeyRange range, int64_t cols, acc_t max) {
    if (max == std::numeric_limits<acc_t>::infinity()) {  // inf - inf: NaN probabilities
      return exp_and_lane_sums<ExpArguments::kAny>(scores, range.begin, range.end, cols, max);
    }
    return exp_and_lane_sums<ExpArguments::kNotAboveShift>(scores, range.begin, range.end, cols,
                                                           max);
  }
};

// The sink (-inf without one) joins the denominator: m* = max(m, sink),
// l* = e^(m - m*) l + e^(sink - m*);  out = O e^(m - m*) keep / l*  and  lse = m* + log(l*),
// keep = 1 / (1 - p) under dropout, else 1. A row with no visible key and no sink gets zeros and
// lse = -inf (with a sink: zeros and lse = sink), a poisoned row (NaN max) NaN.
template <typename acc_t, typename scalar_t>
inline void finish_row(acc_t max, acc_t sum, const acc_t* acc, int64_t value_dim, acc_t sink,
                       acc_t keep, scalar_t* out, acc_t* lse) {
  const acc_t shift = std::max(max, sink);
  if (std::isnan(max)) {
    std::fill(out, out + value_dim, static_cast<scalar_t>(max));
    *lse = max;
  } else if (shift == -std::numeric_limits<acc_t>::infinity()) {
    std::fill(out, out + value_dim, scalar_t(0));
    *lse = -std::numeric_limits<acc_t>::infinity();
  } else {
    // Without a sink (-inf) the row's share is e^0 = 1 and the sink's e^-inf = 0, exactly: the
    // two scalar exponentials (a call of libm's each, a row) are left out.
    const bool has_sink = sink != -std::numeric_limits<acc_t>::infinity();
    const acc_t rows_share = has_sink ? std::exp(max - shift) : acc_t(1);
    const acc_t total = has_sink ? sum * rows_share + std::exp(sink - shift) : sum;
    store_scaled_row(acc, value_dim, acc_t(1) / total * rows_share * keep, out);
    *lse = shift + std::log(total);
  }
}

// The backward's rows of one block pair start from raw scores p = q.k and dp = dO.v over `cols`
// keys, of which row sees `range`, less those the masks hide (scoring.sees).
template <typename acc_t>
struct GradientRowScratch {
  acc_t* softcap_grad;  // dx/d(scale S) / scale of each key
  acc_t* keep_factors;  // the dropout mask times 1 / (1 - p)
};

// The probabilities of a row as the backward recomputes them, and their sum over the row's keys
// of this block (the undropped ones; 0 where lse = -inf) lane by lane: only the row statistics
// (row_shares) add the lanes up, the gradients' rows need no sum.
template <typename acc_t>
struct RecomputedRow {
  KeyRange range;
  at::vec::Vectorized<acc_t> mass_lanes;
};

// P = exp(x - lse) over the row's keys, zeros elsewhere, with x the modified scores (and their
// softcap factors into scratch.softcap_grad); then, under dropout, dP' = dP o keep / (1 - p) (the
// keep factors left in scratch.keep_factors). Returns the keys the row reaches (none when
// lse = -inf: a row that sees nothing) and the sums of P.
template <typename acc_t>
inline RecomputedRow<acc_t> probabilities_row(acc_t* p, acc_t* dp, KeyRange range, int64_t cols,
                                              const RowScoring<acc_t>& scoring, acc_t lse,
                                              const GradientRowScratch<acc_t>& scratch) {
  if (lse == -std::numeric_limits<acc_t>::infinity()) {
    range.end = range.begin;
  }
  const int64_t begin = range.begin, end = range.end;
  score_row(scoring, p, begin, end, scratch.softcap_grad);
  const auto mass_lanes = exp_and_lane_sums<ExpArguments::kAny>(p, begin, end, cols, lse);
  if (scoring.dropout) {
    // The mask once, for dP here and for P in finish_gradient_row.
    scoring.keep_factors(scratch.keep_factors, begin, end, scoring.keep_scale);
    at::vec::map2<acc_t>([](auto x, auto y) { return x * y; }, dp + begin, dp + begin,
                         scratch.keep_factors + begin, end - begin);
  }
  return {range, mass_lanes};
}

// The step that gives the backward its row statistics exactly as the block pairs see them: the
// row's sums over its visible keys of this block (P and dP' as probabilities_row leaves them;
// hidden keys, whose dP may be 0 * inf, are left out) of P (`mass`) and of P o dP' (`share`).
template <typename acc_t>
struct RowShares {
  acc_t mass, share;
};
template <typename acc_t>
inline RowShares<acc_t> row_shares(acc_t* p, acc_t* dp, KeyRange range, int64_t cols,
                                   const RowScoring<acc_t>& scoring, acc_t lse,
                                   const GradientRowScratch<acc_t>& scratch) {
  using Vec = at::vec::Vectorized<acc_t>;
  const RecomputedRow<acc_t> row = probabilities_row(p, dp, range, cols, scoring, lse, scratch);
  range = row.range;
  const acc_t mass =
      at::vec::vec_reduce_all<acc_t>([](Vec& a, Vec& b) { return a + b; }, row.mass_lanes);
  if (scoring.masks_keys()) {
    acc_t share = 0;
    for (int64_t c = range.begin; c < range.end; ++c) {
      share += scoring.sees(c) ? p[c] * dp[c] : acc_t(0);
    }
    return {mass, share};
  }
  return {mass, dot_row(p + range.begin, dp + range.begin, range.end - range.begin)};
}

// The backward's rows of one block pair, from P and dP' as probabilities_row leaves them (over
// `range`, the keys the row reaches, with the softcap factors and keep factors of its scratch):
//   P = P normalizer;  dS = P o (dP' - delta) o g
// over the keys of `range` less those the masks hide, zeros elsewhere; g = dx/d(scale S) /
// scale (1 - tanh^2 under softcap, else 1). Then P is the dropped P o keep / (1 - p) that dV
// needs. Where mask_grad is given (the row's attn_mask gradient from the block's first key),
// dS before g, the gradient of x, is stored there over the range.
template <typename acc_t>
inline void finish_gradient_row(acc_t* p, acc_t* ds, KeyRange range, int64_t cols,
                                const RowScoring<acc_t>& scoring, acc_t normalizer, acc_t delta,
                                const GradientRowScratch<acc_t>& scratch, acc_t* mask_grad) {
  const int64_t begin = range.begin, end = range.end;
  if (normalizer != acc_t(1)) {
    scale_row(p + begin, end - begin, normalizer);
  }
  using Vec = at::vec::Vectorized<acc_t>;
  const auto times = [](Vec x, Vec y) { return x * y; };
  const Vec delta_vec(delta);
  // Only over the visible keys: a NaN delta (poisoned row) must not reach masked entries.
  at::vec::map2<acc_t>([&](Vec pv, Vec dv) { return pv * (dv - delta_vec); }, ds + begin, p + begin,
                       ds + begin, end - begin);
  zero_columns(ds, 0, begin);
  zero_columns(ds, end, cols);
  if (scoring.masks_keys()) {
    // Likewise for the hidden keys, whose dP may be non-finite (0 * inf), as may P in a
    // poisoned row (exp(-inf - NaN)).
    for (int64_t c = begin; c < end; ++c) {
      const bool seen = scoring.sees(c);
      p[c] = seen ? p[c] : acc_t(0);
      ds[c] = seen ? ds[c] : acc_t(0);
    }
  }
  // dS with respect to the modified scores x is attn_mask's gradient (x = ... + attn_mask).
  if (mask_grad != nullptr) {
    std::copy(ds + begin, ds + end, mask_grad + begin);
  }
  if (scoring.softcap != acc_t(0)) {
    at::vec::map2<acc_t>(times, ds + begin, ds + begin, scratch.softcap_grad + begin, end - begin);
  }
  if (scoring.dropout) {
    at::vec::map2<acc_t>(times, p + begin, p + begin, scratch.keep_factors + begin, end - begin);
  }
}

}  // namespace causal_attention::cpu::CPU_CAPABILITY
