// The values of an 8-bit KV cache (float8_e4m3fn, float8_e5m2, int8) as float32, a vector at a
// time: what register_tiles.h's load_as does with such a row, as it widens bfloat16 and float16
// ones, and what quantized_rows.h widens blocks of 8-bit rows into the kernels' scratch with. The
// element types are c10's Float8_e4m3fn and Float8_e5m2 and int8_t, each one byte of the row as
// stored.
//
// Every bit pattern widens exactly, and the vector paths give the scalar path's results bit for
// bit: an fp8 value goes through float16 exactly (e5m2 is float16's top byte; e4m3's exponent and
// mantissa shifted into float16's, off by the bias 2^8, which one exact multiply removes), and
// e4m3's NaN (S.1111.111, whose image is float16's 1.875) is set apart.
//
// Included only by the per-instruction-set kernel sources (see geometry.h).
#pragma once

#include <ATen/cpu/vec/vec.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>

#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstdint>
#include <limits>
#include <type_traits>

namespace causal_attention::cpu::CPU_CAPABILITY {

// An e4m3 byte as the decode reads the blocks it has checked for NaN (decode.h): widened to
// float32 as its value / 256 (through float16 without the exact multiply that removes the bias,
// which the decode folds into the row's scale) and without its NaN set apart, in four
// instructions a vector where the exact widening takes eight. As a scalar (tails, the guards of
// non-finite rows) it is exact: value / 256, NaN for NaN.
struct E4M3Over256 {
  uint8_t bits;
  E4M3Over256() = default;
  E4M3Over256(int zero) : bits(uint8_t(zero)) {}  // the guards' zeroed rows: E4M3Over256(0)
  operator float() const {
    return float(c10::Float8_e4m3fn(bits, c10::Float8_e4m3fn::from_bits())) / 256.0f;
  }
};
static_assert(sizeof(E4M3Over256) == 1);

template <typename T>
inline constexpr bool is_eight_bit_v =
    std::is_same_v<T, c10::Float8_e4m3fn> || std::is_same_v<T, c10::Float8_e5m2> ||
    std::is_same_v<T, int8_t> || std::is_same_v<T, E4M3Over256>;

// Whether any of the n e4m3 bytes of `rows` rows from `first`, `stride` bytes apart, is NaN's
// (S.1111.111). Only NaN's magnitude (the byte less its sign) is 0x7F: the largest magnitude of
// all the rows is taken, without a branch, and compared once. (A test and a branch a vector of
// each row were 10 % of an in-cache e4m3 decode's samples on an AMX Xeon, a fifth of its kernel
// time, and the AVX2 build tested byte by byte: the decode now takes 0.92-0.95 of its time there,
// the AVX2 build's 0.43.)
inline bool any_e4m3_nan(const uint8_t* first, int64_t rows, int64_t stride, int64_t n) {
  constexpr uint8_t kMagnitude = 0x7F;
#if defined(CPU_CAPABILITY_AVX512)
  const __m512i magnitude = _mm512_set1_epi8(char(kMagnitude));
  const __mmask64 tail = n % 64 == 0 ? 0 : (__mmask64(1) << (n % 64)) - 1;
  __m512i largest = _mm512_setzero_si512();
  for (int64_t r = 0; r < rows; ++r) {
    const uint8_t* row = first + r * stride;
    int64_t c = 0;
    for (; c + 64 <= n; c += 64) {
      largest = _mm512_max_epu8(largest, _mm512_and_si512(_mm512_loadu_si512(row + c), magnitude));
    }
    if (tail != 0) {
      largest = _mm512_max_epu8(
          largest, _mm512_and_si512(_mm512_maskz_loadu_epi8(tail, row + c), magnitude));
    }
  }
  return _mm512_cmpeq_epi8_mask(largest, magnitude) != 0;
#else
  int64_t vectorized = 0;
#if defined(CPU_CAPABILITY_AVX2)
  vectorized = n / 32 * 32;
  const __m256i magnitude = _mm256_set1_epi8(char(kMagnitude));
  __m256i largest = _mm256_setzero_si256();
  for (int64_t r = 0; r < rows; ++r) {
    const uint8_t* row = first + r * stride;
    for (int64_t c = 0; c < vectorized; c += 32) {
      const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + c));
      largest = _mm256_max_epu8(largest, _mm256_and_si256(bytes, magnitude));
    }
  }
  if (_mm256_movemask_epi8(_mm256_cmpeq_epi8(largest, magnitude)) != 0) {
    return true;
  }
#endif
  uint8_t largest_tail = 0;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = vectorized; c < n; ++c) {
      largest_tail = std::max<uint8_t>(largest_tail, first[r * stride + c] & kMagnitude);
    }
  }
  return largest_tail == kMagnitude;
#endif
}

#if defined(CPU_CAPABILITY_AVX512)
// Sign-extended and shifted by 7, an e4m3 byte leaves its sign in bit 15 (and 14, cleared) and its
// exponent and mantissa in float16's bits 7 to 13: float16's bits of its value / 256.
inline __m256i e4m3_as_half(__m128i bytes) {
  return _mm256_and_si256(_mm256_slli_epi16(_mm256_cvtepi8_epi16(bytes), 7),
                          _mm256_set1_epi16(int16_t(0xBFFF)));
}
#elif defined(CPU_CAPABILITY_AVX2)
inline __m128i e4m3_as_half(__m128i bytes) {  // as the AVX-512 one, for 8 bytes
  return _mm_and_si128(_mm_slli_epi16(_mm_cvtepi8_epi16(bytes), 7),
                       _mm_set1_epi16(int16_t(0xBFFF)));
}
#endif

// Vectorized<float>::size() values from src as float32.
template <typename T>
inline at::vec::Vectorized<float> load_eight_bit(const T* src) {
  static_assert(is_eight_bit_v<T>);
#if defined(CPU_CAPABILITY_AVX512)
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src));
  if constexpr (std::is_same_v<T, int8_t>) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes));
  } else if constexpr (std::is_same_v<T, E4M3Over256>) {
    return _mm512_cvtph_ps(e4m3_as_half(bytes));
  } else if constexpr (std::is_same_v<T, c10::Float8_e5m2>) {
    return _mm512_cvtph_ps(_mm256_slli_epi16(_mm256_cvtepu8_epi16(bytes), 8));
  } else {
    const __m256i half = e4m3_as_half(bytes);
    const __m512 x = _mm512_mul_ps(_mm512_cvtph_ps(half), _mm512_set1_ps(256.0f));
    const __mmask16 nan = _mm256_cmpeq_epi16_mask(_mm256_and_si256(half, _mm256_set1_epi16(0x7FFF)),
                                                  _mm256_set1_epi16(0x3F80));
    return _mm512_mask_mov_ps(x, nan, _mm512_set1_ps(std::numeric_limits<float>::quiet_NaN()));
  }
#elif defined(CPU_CAPABILITY_AVX2)
  const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(src));
  if constexpr (std::is_same_v<T, int8_t>) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
  } else if constexpr (std::is_same_v<T, E4M3Over256>) {
    return _mm256_cvtph_ps(e4m3_as_half(bytes));
  } else if constexpr (std::is_same_v<T, c10::Float8_e5m2>) {
    return _mm256_cvtph_ps(_mm_slli_epi16(_mm_cvtepu8_epi16(bytes), 8));
  } else {
    const __m128i half = e4m3_as_half(bytes);
    const __m256 x = _mm256_mul_ps(_mm256_cvtph_ps(half), _mm256_set1_ps(256.0f));
    const __m128i nan16 =
        _mm_cmpeq_epi16(_mm_and_si128(half, _mm_set1_epi16(0x7FFF)), _mm_set1_epi16(0x3F80));
    return _mm256_blendv_ps(x, _mm256_set1_ps(std::numeric_limits<float>::quiet_NaN()),
                            _mm256_castsi256_ps(_mm256_cvtepi16_epi32(nan16)));
  }
#else
  __at_align__ float widened[at::vec::Vectorized<float>::size()];
  std::copy_n(src, at::vec::Vectorized<float>::size(), widened);  // c10's own conversions
  return at::vec::Vectorized<float>::loadu(widened);
#endif
}

// Whether load_eight_bit_pair widens T's bytes through one register of float16 of twice the
// lanes, halved for the conversions to float32: 8 instructions for 32 e4m3 values (7 for e5m2)
// where two vectors' load_eight_bit take 10 (8). int8 widens in one instruction from memory.
template <typename T>
inline constexpr bool kWidensInPairs =
    std::is_same_v<T, E4M3Over256> || std::is_same_v<T, c10::Float8_e5m2>;

// 2 * Vectorized<float>::size() values from src as float32, the first half in `low`: bit for bit
// two calls of load_eight_bit.
template <typename T>
inline void load_eight_bit_pair(const T* src, at::vec::Vectorized<float>& low,
                                at::vec::Vectorized<float>& high) {
  static_assert(is_eight_bit_v<T>);
  if constexpr (kWidensInPairs<T>) {
#if defined(CPU_CAPABILITY_AVX512)
    const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src));
    __m512i half;
    if constexpr (std::is_same_v<T, E4M3Over256>) {  // e4m3_as_half's bits, of 32 bytes
      half = _mm512_and_si512(_mm512_slli_epi16(_mm512_cvtepi8_epi16(bytes), 7),
                              _mm512_set1_epi16(int16_t(0xBFFF)));
    } else {
      half = _mm512_slli_epi16(_mm512_cvtepu8_epi16(bytes), 8);
    }
    low = _mm512_cvtph_ps(_mm512_castsi512_si256(half));
    high = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(half, 1));
    return;
#elif defined(CPU_CAPABILITY_AVX2)
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src));
    __m256i half;
    if constexpr (std::is_same_v<T, E4M3Over256>) {  // e4m3_as_half's bits, of 16 bytes
      half = _mm256_and_si256(_mm256_slli_epi16(_mm256_cvtepi8_epi16(bytes), 7),
                              _mm256_set1_epi16(int16_t(0xBFFF)));
    } else {
      half = _mm256_slli_epi16(_mm256_cvtepu8_epi16(bytes), 8);
    }
    low = _mm256_cvtph_ps(_mm256_castsi256_si128(half));
    high = _mm256_cvtph_ps(_mm256_extracti128_si256(half, 1));
    return;
#endif
  }
  low = load_eight_bit(src);
  high = load_eight_bit(src + at::vec::Vectorized<float>::size());
}

// The first `count` (< Vectorized<float>::size()) values from src as float32, the other lanes
// zero.
template <typename T>
inline at::vec::Vectorized<float> load_eight_bit(const T* src, int64_t count) {
  static_assert(is_eight_bit_v<T>);
  __at_align__ float widened[at::vec::Vectorized<float>::size()] = {};
  std::copy_n(src, count, widened);
  return at::vec::Vectorized<float>::loadu(widened);
}

}  // namespace causal_attention::cpu::CPU_CAPABILITY
