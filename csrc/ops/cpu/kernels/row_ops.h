// Vectorized operations on one row of accumulators, shared by the forward, the backward and the
// split-key combine.
#pragma once

#include <ATen/OpMathType.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <cstdint>
#include <type_traits>

namespace causal_attention::cpu::CPU_CAPABILITY {

// exp of an x that is never NaN: for float exp_u20, the accuracy torch's own CPU flash attention
// uses (exp(-inf) = 0).
template <typename acc_t>
inline at::vec::Vectorized<acc_t> vec_exp_of_number(const at::vec::Vectorized<acc_t>& x) {
  if constexpr (std::is_same_v<acc_t, float>) {
    return x.exp_u20();
  } else {
    return x.exp();
  }
}

// exp that keeps NaN (exp_u20 clamps its input first, which would turn a NaN score into a
// finite probability and hide a poisoned row).
template <typename acc_t>
inline at::vec::Vectorized<acc_t> vec_exp(const at::vec::Vectorized<acc_t>& x) {
  if constexpr (std::is_same_v<acc_t, float>) {
    return at::vec::Vectorized<float>::blendv(vec_exp_of_number(x), x, x.isnan());
  } else {
    return x.exp();
  }
}

// row[c] *= factor.
template <typename acc_t>
inline void scale_row(acc_t* row, int64_t n, acc_t factor) {
  using Vec = at::vec::Vectorized<acc_t>;
  const Vec factor_vec(factor);
  at::vec::map<acc_t>([&](Vec x) { return x * factor_vec; }, row, row, n);
}

// row[c] *= factors[c].
template <typename acc_t>
inline void multiply_row(acc_t* row, const acc_t* factors, int64_t n) {
  using Vec = at::vec::Vectorized<acc_t>;
  at::vec::map2<acc_t>([](Vec x, Vec f) { return x * f; }, row, row, factors, n);
}

// row[c] += other[c].
template <typename acc_t>
inline void add_row(acc_t* row, const acc_t* other, int64_t n) {
  using Vec = at::vec::Vectorized<acc_t>;
  at::vec::map2<acc_t>([](Vec x, Vec y) { return x + y; }, row, row, other, n);
}

// row[c] += factor * other[c].
template <typename acc_t>
inline void add_scaled_row(acc_t* row, const acc_t* other, int64_t n, acc_t factor) {
  using Vec = at::vec::Vectorized<acc_t>;
  const Vec factor_vec(factor);
  at::vec::map2<acc_t>([&](Vec x, Vec y) { return at::vec::fmadd(y, factor_vec, x); }, row, row,
                       other, n);
}

// dst[c] = src[c] * factor, converted to the output dtype (the one rounding of a result).
template <typename scalar_t, typename acc_t>
inline void store_scaled_row(const acc_t* src, int64_t n, acc_t factor, scalar_t* dst) {
  if constexpr (std::is_same_v<scalar_t, acc_t>) {
    using Vec = at::vec::Vectorized<acc_t>;
    const Vec factor_vec(factor);
    at::vec::map<acc_t>([&](Vec x) { return x * factor_vec; }, dst, src, n);
  } else {
    for (int64_t c = 0; c < n; ++c) {
      dst[c] = static_cast<scalar_t>(src[c] * factor);
    }
  }
}

// sum_c a[c] * b[c], in one partial sum per vector lane added at the end (a fixed order): lanes
// keep each chain of rounding errors short, which a sequential sum over a long row (D = 256) does
// not; delta = rowsum(dO o O) is then cancelled against dP in every dS.
template <typename scalar_t>
inline at::opmath_type<scalar_t> dot_row(const scalar_t* a, const scalar_t* b, int64_t n) {
  return static_cast<at::opmath_type<scalar_t>>(at::vec::map2_reduce_all<scalar_t>(
      [](auto x, auto y) { return x * y; }, [](auto x, auto y) { return x + y; }, a, b, n));
}

}  // namespace causal_attention::cpu::CPU_CAPABILITY
