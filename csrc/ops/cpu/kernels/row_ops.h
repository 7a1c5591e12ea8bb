// Vectorized operations on one row of accumulators, shared by the forward, the backward and the
// split-key combine.
#pragma once

#include <ATen/OpMathType.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
#include <immintrin.h>
#endif

#include <cmath>
#include <cstdint>
#include <type_traits>

namespace causal_attention::cpu::CPU_CAPABILITY {

// exp(x) for x <= 0 (-inf included: 0), the softmax's exp(score - max): in float32, 2^n e^f with
// n = round(x log2 e) and f = x - n ln 2 (ln 2 in two parts, so f is exact to float32's rounding),
// e^f by a degree-5 polynomial fitted to its relative error on |f| <= ln 2 / 2 (9e-8), 2^n put
// into the exponent bits, and 0 below exp's normal range (x < ln FLT_MIN). 12 vector
// instructions where torch's exp_u20 (which the softmax took before) takes 19, and more accurate
// (test_the_softmax_exponential_is_accurate_to_a_few_ulps: 2.6e-7 where exp_u20 gave 3.7e-7): no
// clamp at either end (x <= 0 never overflows), and 2^n from the rounding's own bits
// (x log2 e + 1.5 * 2^23 + 127 leaves n + 127 in the low bits) instead of two conversions. NaN
// gives 0: callers that may pass one (exp_non_positive_keeping_nan) put it back. float64 keeps
// Sleef's exp.
namespace exp_constants {
inline constexpr float kLog2E = 1.44269504088896341f;
inline constexpr float kRounding = 12582912.0f + 127.0f;  // 1.5 * 2^23, plus the exponent's bias
inline constexpr float kLn2High = 0.693145751953125f;     // ln 2's first 16 bits: n * it is exact
inline constexpr float kLn2Low = 1.428606765330187e-06f;  // ln 2 - kLn2High
inline constexpr float kLowest = -87.33654475f;           // ln FLT_MIN
inline constexpr float kPolynomial[] = {0.008290315046906471f, 0.04189793020486832f,
                                        0.1666763573884964f,   0.4999915063381195f,
                                        0.9999997019767761f,   1.0f};
}  // namespace exp_constants

template <typename acc_t>
inline at::vec::Vectorized<acc_t> exp_non_positive(const at::vec::Vectorized<acc_t>& x) {
  if constexpr (!std::is_same_v<acc_t, float>) {
    return x.exp();
  } else {
    using namespace exp_constants;
    using Vec = at::vec::Vectorized<float>;
    using Bits = at::vec::Vectorized<int32_t>;
    const Vec t = at::vec::fmadd(x, Vec(kLog2E), Vec(kRounding));
    const Vec n = t - Vec(kRounding);
    const Vec f = at::vec::fnmadd(n, Vec(kLn2Low), at::vec::fnmadd(n, Vec(kLn2High), x));
    Vec p(kPolynomial[0]);
    for (int i = 1; i < 6; ++i) {
      p = at::vec::fmadd(p, f, Vec(kPolynomial[i]));
    }
    const Vec two_to_n = at::vec::cast<float>(at::vec::cast<int32_t>(t) << Bits(23));
#if defined(CPU_CAPABILITY_AVX512)
    // The product under the compare's mask register: one instruction where the vector of a mask
    // takes three.
    const __m512 v = x;
    return _mm512_maskz_mul_ps(_mm512_cmp_ps_mask(v, _mm512_set1_ps(kLowest), _CMP_GE_OQ), p,
                               two_to_n);
#else
    return (p * two_to_n) & (x >= Vec(kLowest));
#endif
  }
}

// exp_non_positive that keeps NaN (it gives 0 for one, which would hide a poisoned row).
template <typename acc_t>
inline at::vec::Vectorized<acc_t> exp_non_positive_keeping_nan(
    const at::vec::Vectorized<acc_t>& x) {
  if constexpr (std::is_same_v<acc_t, float>) {
#if defined(CPU_CAPABILITY_AVX512)
    // One compare into a mask register: blendv's vector of its mask cost three instructions.
    const __m512 v = x;
    return _mm512_mask_mov_ps(exp_non_positive(x), _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), v);
#else
    return at::vec::Vectorized<float>::blendv(exp_non_positive(x), x, x.isnan());
#endif
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
