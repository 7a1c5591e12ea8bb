// Vectorized operations on one row of accumulators, shared by the forward, the backward and the
// split-key combine.
#pragma once

#include <ATen/OpMathType.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <c10/util/bit_cast.h>

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
// into the exponent bits, and 0 below exp's normal range (x < ln FLT_MIN). Within 1.7e-7 of
// exp (measured over [-80, 0]; torch's exp_u20, which the softmax took before: 3.7e-7), in 12
// vector instructions where exp_u20 takes 19, which made the forward's exponential loop a third
// faster on a Zen 5: no clamp at either end (x <= 0 never overflows), and 2^n from the rounding's
// own bits (x log2 e + 1.5 * 2^23 + 127 leaves n + 127 in the low bits) instead of two
// conversions. The AVX-512, AVX2 and baseline builds compute the same operations in the same
// order (fused multiply-adds included). NaN gives 0: callers that may pass one
// (exp_non_positive_keeping_nan) put it back. float64 keeps Sleef's exp.
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
#if defined(CPU_CAPABILITY_AVX512)
    const __m512 v = x;
    const __m512 t = _mm512_fmadd_ps(v, _mm512_set1_ps(kLog2E), _mm512_set1_ps(kRounding));
    const __m512 n = _mm512_sub_ps(t, _mm512_set1_ps(kRounding));
    __m512 f = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2High), v);
    f = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Low), f);
    __m512 p = _mm512_set1_ps(kPolynomial[0]);
    for (int i = 1; i < 6; ++i) {
      p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(kPolynomial[i]));
    }
    const __m512 two_to_n = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_castps_si512(t), 23));
    const __mmask16 normal = _mm512_cmp_ps_mask(v, _mm512_set1_ps(kLowest), _CMP_GE_OQ);
    return _mm512_maskz_mul_ps(normal, p, two_to_n);
#elif defined(CPU_CAPABILITY_AVX2)
    const __m256 v = x;
    const __m256 t = _mm256_fmadd_ps(v, _mm256_set1_ps(kLog2E), _mm256_set1_ps(kRounding));
    const __m256 n = _mm256_sub_ps(t, _mm256_set1_ps(kRounding));
    __m256 f = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2High), v);
    f = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Low), f);
    __m256 p = _mm256_set1_ps(kPolynomial[0]);
    for (int i = 1; i < 6; ++i) {
      p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(kPolynomial[i]));
    }
    const __m256 two_to_n = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_castps_si256(t), 23));
    const __m256 normal = _mm256_cmp_ps(v, _mm256_set1_ps(kLowest), _CMP_GE_OQ);
    return _mm256_and_ps(_mm256_mul_ps(p, two_to_n), normal);
#else
    __at_align__ float lanes[at::vec::Vectorized<float>::size()];
    x.store(lanes);
    for (float& lane : lanes) {
      const float t = std::fma(lane, kLog2E, kRounding);
      const float n = t - kRounding;
      const float f = std::fma(-n, kLn2Low, std::fma(-n, kLn2High, lane));
      float p = kPolynomial[0];
      for (int i = 1; i < 6; ++i) {
        p = std::fma(p, f, kPolynomial[i]);
      }
      const uint32_t two_to_n_bits = c10::bit_cast<uint32_t>(t) << 23;
      lane = lane >= kLowest ? p * c10::bit_cast<float>(two_to_n_bits) : 0.0f;
    }
    return at::vec::Vectorized<float>::loadu(lanes);
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
