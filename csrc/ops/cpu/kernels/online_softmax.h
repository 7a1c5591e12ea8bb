// The online softmax: the per-row state (running max m, sum l and unnormalized output O) that a
// query block carries across its key blocks, its fused update, the finish into out and lse, and
// the backward's recomputation of P and dS from lse. Vectorized with at::vec.
#pragma once

#include "row_ops.h"

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

namespace causal_attention::cpu::CPU_CAPABILITY {

// exp that keeps NaN (exp_u20 clamps its input first, which would turn a NaN score into a
// finite probability and hide a poisoned row).
template <typename acc_t>
inline at::vec::Vectorized<acc_t> vec_exp(const at::vec::Vectorized<acc_t>& x) {
  if constexpr (std::is_same_v<acc_t, float>) {
    // exp_u20: the accuracy torch's own CPU flash attention uses.
    return at::vec::Vectorized<float>::blendv(x.exp_u20(), x, x.isnan());
  } else {
    return x.exp();
  }
}

// The scores are scaled in place before any exponential, so that the row max and every
// exp(x - shift) read the same rounded x. Fusing the scale into the exponent's argument,
// exp(fma(S, scale, -max)), would compute S * scale exactly against a rounded max: with
// scale = 1e10 and float32 the two differ by up to half an ulp of 1e11 (4096), and exp(+-4096)
// overflows or vanishes, turning rows into NaN or zeros.

// row[c] = scale * row[c] for c < visible, or -inf where `kept` (when not null) hides the key:
// the softmax then gives a hidden key exactly zero probability, whatever its score (NaN and
// inf included).
template <typename acc_t>
inline void scale_and_hide(acc_t* row, int64_t visible, const bool* kept, acc_t scale) {
  if (kept) {
    for (int64_t c = 0; c < visible; ++c) {
      row[c] = kept[c] ? row[c] * scale : -std::numeric_limits<acc_t>::infinity();
    }
  } else {
    using Vec = at::vec::Vectorized<acc_t>;
    const Vec scale_vec(scale);
    at::vec::map<acc_t>([&](Vec x) { return x * scale_vec; }, row, row, visible);
  }
}

// scale_and_hide, returning the max of the result over c < visible (NaN if any is NaN, -inf if
// none). Without a mask, in one pass over the row.
template <typename acc_t>
inline acc_t scale_hide_and_max(acc_t* row, int64_t visible, const bool* kept, acc_t scale) {
  using Vec = at::vec::Vectorized<acc_t>;
  if (kept) {
    scale_and_hide(row, visible, kept, scale);
    scale = acc_t(1);  // already applied
  }
  const Vec scale_vec(scale);
  Vec max_vec(-std::numeric_limits<acc_t>::infinity());
  int64_t c = 0;
  for (; c + Vec::size() <= visible; c += Vec::size()) {
    const Vec x = Vec::loadu(row + c) * scale_vec;
    x.store(row + c);
    max_vec = at::vec::maximum(max_vec, x);
  }
  acc_t result = at::vec::vec_reduce_all<acc_t>(
      [](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, max_vec);
  for (; c < visible; ++c) {
    row[c] *= scale;
    result = std::isnan(row[c]) ? row[c] : std::max(result, row[c]);
  }
  return result;
}

// row[c] = exp(min(row[c] - shift, 0)) for c < visible, 0 for visible <= c < cols; returns the
// sum of the exponentials. shift = the row max in the forward, lse in the backward, so the
// argument is never positive in exact arithmetic. The backward may recompute a score in another
// summation order than the forward did (the decode path's dot products against the block
// products): at an absurd scale (scale * |q.k| above ~1e9 in float32) that rounding difference
// alone exceeds exp's range, and the clamp keeps P a probability instead of inf.
template <typename acc_t>
inline acc_t exp_and_sum(acc_t* row, int64_t visible, int64_t cols, acc_t shift) {
  using Vec = at::vec::Vectorized<acc_t>;
  const Vec shift_vec(shift), zero(acc_t(0));
  Vec sum_vec(acc_t(0));
  int64_t c = 0;
  for (; c + Vec::size() <= visible; c += Vec::size()) {
    const Vec p = vec_exp(at::vec::minimum(Vec::loadu(row + c) - shift_vec, zero));
    p.store(row + c);
    sum_vec = sum_vec + p;
  }
  if (c < visible) {
    const int64_t tail = visible - c;
    const Vec p = vec_exp(at::vec::minimum(Vec::loadu(row + c, tail) - shift_vec, zero));
    p.store(row + c, tail);
    sum_vec = sum_vec + Vec::set(Vec(acc_t(0)), p, tail);
  }
  std::fill(row + visible, row + cols, acc_t(0));
  return at::vec::vec_reduce_all<acc_t>([](Vec& a, Vec& b) { return a + b; }, sum_vec);
}

// The online-softmax state of a set of query rows: row max, row sum and unnormalized output.
template <typename acc_t>
struct RowState {
  std::vector<acc_t> max, sum, out;
  int64_t value_dim;

  RowState(int64_t rows, int64_t value_dim)
      : max(rows), sum(rows), out(rows * value_dim), value_dim(value_dim) {}

  void reset(int64_t rows) {
    std::fill_n(max.begin(), rows, -std::numeric_limits<acc_t>::infinity());
    std::fill_n(sum.begin(), rows, acc_t(0));
    std::fill_n(out.begin(), rows * value_dim, acc_t(0));
  }

  // Folds one block of raw scores q.k of row r (the first `visible` of `cols` keys visible, less
  // those `kept` hides where it is not null) into its state, and leaves the block's
  // probabilities (relative to the new max) in `scores`:
  //   m' = max(m, rowmax(scale S)); P = exp(scale S - m'); l = e^(m - m') l + rowsum(P);
  //   O = e^(m - m') O  (the caller then adds P V).
  void fold_row(acc_t* scores, int64_t r, int64_t visible, int64_t cols, acc_t scale,
                const bool* kept) {
    const acc_t block_max = scale_hide_and_max(scores, visible, kept, scale);
    const acc_t old_max = max[r];
    const acc_t new_max = std::isnan(block_max) ? block_max : std::max(old_max, block_max);
    if (new_max == -std::numeric_limits<acc_t>::infinity() || std::isnan(new_max)) {
      // Nothing visible yet, or a NaN score: the row contributes nothing further, and a NaN
      // max marks it so that finish_row returns NaN for it (and only for it).
      max[r] = new_max;
      std::fill(scores, scores + cols, acc_t(0));
      return;
    }
    const acc_t correction = std::exp(old_max - new_max);
    sum[r] = sum[r] * correction + exp_and_sum(scores, visible, cols, new_max);
    max[r] = new_max;
    if (correction != acc_t(1)) {
      scale_row(out.data() + r * value_dim, value_dim, correction);
    }
  }
};

// out = O / l and lse = m + log(l); a row with no visible key gets zeros and -inf, a poisoned
// row (NaN max) NaN.
template <typename acc_t, typename scalar_t>
inline void finish_row(acc_t max, acc_t sum, const acc_t* acc, int64_t value_dim, scalar_t* out,
                       acc_t* lse) {
  if (std::isnan(max)) {
    std::fill(out, out + value_dim, static_cast<scalar_t>(max));
    *lse = max;
  } else if (sum == acc_t(0)) {
    std::fill(out, out + value_dim, scalar_t(0));
    *lse = -std::numeric_limits<acc_t>::infinity();
  } else {
    store_scaled_row(acc, value_dim, acc_t(1) / sum, out);
    *lse = max + std::log(sum);
  }
}

// The backward's rows of one block pair, from raw scores p = q.k and ds = dO.v:
//   P = exp(scale * S - lse);  dS = P o (dP - delta)
// over the `visible` first columns less the keys `kept` hides (where not null), zeros elsewhere
// (a row with lse = -inf sees nothing). Returns the prefix of columns the row reaches.
template <typename acc_t>
inline int64_t softmax_gradient_row(acc_t* p, acc_t* ds, int64_t visible, int64_t cols, acc_t scale,
                                    acc_t lse, acc_t delta, const bool* kept) {
  if (lse == -std::numeric_limits<acc_t>::infinity()) {
    visible = 0;
  }
  scale_and_hide(p, visible, kept, scale);
  exp_and_sum(p, visible, cols, lse);
  using Vec = at::vec::Vectorized<acc_t>;
  const Vec delta_vec(delta);
  // Only over the visible keys: a NaN delta (poisoned row) must not reach masked entries.
  at::vec::map2<acc_t>([&](Vec pv, Vec dv) { return pv * (dv - delta_vec); }, ds, p, ds, visible);
  std::fill(ds + visible, ds + cols, acc_t(0));
  if (kept) {
    // Likewise for the hidden keys, whose dP may be non-finite (0 * inf), as may P in a
    // poisoned row (exp(-inf - NaN)).
    for (int64_t c = 0; c < visible; ++c) {
      p[c] = kept[c] ? p[c] : acc_t(0);
      ds[c] = kept[c] ? ds[c] : acc_t(0);
    }
  }
  return visible;
}

}  // namespace causal_attention::cpu::CPU_CAPABILITY
