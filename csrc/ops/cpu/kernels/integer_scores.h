// Scores of bfloat16 and float16 query rows against int8 key rows (an int8 KV cache's, read in
// place by the decode) as integer dot products, summed exactly.
//
// Each query row is held as int16 values times a power of two, 2^e (quantize_query_row), e chosen
// so that the row's largest magnitude m lies in [2^14, 2^15) units: every element within 7
// binades of m is held exactly in bfloat16 (4 in float16, whose significands are longer), every
// other one rounded to the nearest unit, an error of at most 2^-15 m. The int16 x int8 products of
// a row and a key are summed in int32, exactly: |sum| <= 32767 x 128 x 512 < 2^31 for head dims
// up to 512 (integer_scores_fit). So the sums take no rounding at all and are the same in any
// order, on every chip and build (AVX-512 VNNI's vpdpwssd, AVX2's vpmaddwd, the scalar loop), and
// the score is float(sum) x 2^e, rounded once.
//
// Why: an int8 key row widens to int16 in one instruction a 32 values, where its widening to
// bfloat16 for the pair dot products took nine a 64 (byte tables) and to float32 four a 16; the
// products then cost what bfloat16's do (32 a vpdpwssd as a vdpbf16ps). In an in-cache int8
// decode on a Zen 4 the scores were 41 % of the kernel's samples (stop 69).
//
// Included only by the per-instruction-set kernel sources (see geometry.h).
#pragma once

#include "register_tiles.h"
#include "row_products.h"

#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

namespace causal_attention::cpu::CPU_CAPABILITY {

// Whether query rows of scalar_t score int8 key rows of kv_t by integer products: bfloat16 and
// float16 rows, whose elements int16 holds exactly over 7 and 4 binades (float32's 24-bit
// significands would lose more than their own rounding).
template <typename scalar_t, typename kv_t>
inline constexpr bool kIntegerScores =
    std::is_same_v<kv_t, int8_t> &&
    (std::is_same_v<scalar_t, c10::BFloat16> || std::is_same_v<scalar_t, c10::Half>);

// The head dims the integer products take: whole steps of 32 (an AVX-512 step; two of AVX2's),
// up to 512, where the int32 sums cannot overflow.
constexpr int64_t kIntegerStep = 32;
constexpr int64_t kMaxIntegerDim = 512;

// Whether this CPU and build score by integer products at a head dim of `dim`: the AVX-512 build
// on chips with AVX-512 VNNI (every chip seen with AVX-512 has it; without it a product would
// take two instructions and the float path is kept), the others everywhere.
inline bool integer_scores_fit(int64_t dim) {
  if (dim % kIntegerStep != 0 || dim > kMaxIntegerDim) {
    return false;
  }
#if defined(CPU_CAPABILITY_AVX512)
  static const bool has_vnni = __builtin_cpu_supports("avx512vnni");
  return has_vnni;
#else
  return true;
#endif
}

// q (dim elements) as int16 values times a power of two, into out; returns the power (the row's
// scale), or 0 where the row holds a non-finite element, which int16 cannot hold (the caller
// then scores the row in float32).
template <typename scalar_t>
inline float quantize_query_row(const scalar_t* q, int64_t dim, int16_t* out) {
  float largest = 0.0f;
  bool finite = true;
  for (int64_t d = 0; d < dim; ++d) {
    const float magnitude = std::abs(float(q[d]));
    largest = std::max(largest, magnitude);
    finite = finite && std::isfinite(magnitude);
  }
  if (!finite) {
    return 0.0f;
  }
  int exponent = 0;
  std::frexp(largest, &exponent);  // largest in [2^(exponent - 1), 2^exponent)
  // the unit 2^-15 of 2^exponent, kept a normal float (a row below 2^-111 then keeps fewer bits)
  const int unit = std::max(exponent - 15, -126);
  const float to_units = std::ldexp(1.0f, -unit);  // exact: a power of two
  for (int64_t d = 0; d < dim; ++d) {
    // exact but for the rounding to an integer (and within +-32767: below 2^15 units)
    out[d] = int16_t(std::clamp(std::nearbyint(float(q[d]) * to_units), -32767.0f, 32767.0f));
  }
  return std::ldexp(1.0f, unit);
}

// The scales of a tile's lanes: lane i * kKeys + c (row i, key c) holds row i's.
template <int64_t kRows, int64_t kKeys>
at::vec::Vectorized<float> tile_scales(const float* row_scales) {
  __at_align__ float lanes[at::vec::Vectorized<float>::size()] = {};
  for (int64_t l = 0; l < kRows * kKeys; ++l) {
    lanes[l] = row_scales[l / kKeys];
  }
  return at::vec::Vectorized<float>::loadu(lanes);
}

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
// A tile's int32 sums (acc[i * kKeys + c]: row i, key c), converted to float together and times
// their rows' scales (tile_scales), into scores (row i, key c at scores[i * ld_scores + c]).
template <int64_t kRows, int64_t kKeys>
C10_ALWAYS_INLINE void store_integer_tile_sums(const at::vec::Vectorized<int32_t>* acc,
                                               const at::vec::Vectorized<float>& scales,
                                               float* scores, int64_t ld_scores) {
  __at_align__ float sums[at::vec::Vectorized<float>::size()];
#if defined(CPU_CAPABILITY_AVX512)
  const at::vec::Vectorized<float> wide(_mm512_cvtepi32_ps(lane_sums(acc)));
#else
  const at::vec::Vectorized<float> wide(_mm256_cvtepi32_ps(lane_sums(acc)));
#endif
  (wide * scales).store(sums);
#pragma GCC unroll 4
  for (int64_t i = 0; i < kRows; ++i) {
#pragma GCC unroll 16
    for (int64_t c = 0; c < kKeys; ++c) {
      scores[i * ld_scores + c] = sums[i * kKeys + c];
    }
  }
}
#endif

#if defined(CPU_CAPABILITY_AVX512)
#pragma GCC push_options
#pragma GCC target("avx512vnni")
#endif
// Rows [0, kRows) of q (int16, ld_q apart, each times row_scales[i]) against int8 key rows
// [0, kKeys) of k: one int32 accumulator a (row, key) pair, kRows * kKeys <= its lanes, each key
// vector widened once for the kRows rows. With `stream`, each key (the block's key first_key + c)
// is told to the stream as its first vector is loaded (StreamAhead::at_key).
template <int64_t kRows, int64_t kKeys>
C10_ALWAYS_INLINE void query_key_integer_tile(const int16_t* q, int64_t ld_q, const int8_t* k,
                                              int64_t ld_k, int64_t dim, const float* row_scales,
                                              const at::vec::Vectorized<float>& scales,
                                              float* scores, int64_t ld_scores,
                                              const StreamAhead* stream, int64_t first_key) {
  using Vec = at::vec::Vectorized<int32_t>;
  static_assert(kRows * kKeys <= Vec::size());
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
  constexpr int64_t N = Vec::size();
#if defined(CPU_CAPABILITY_AVX512)
  using Ints = __m512i;
  constexpr int64_t kWidth = 32;  // int16 values a vector
  const auto load_query = [](const int16_t* src) { return _mm512_loadu_si512(src); };
  const auto load_key = [](const int8_t* src) {
    return _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src)));
  };
  const auto multiply_add = [](Ints sum, Ints a, Ints b) { return _mm512_dpwssd_epi32(sum, a, b); };
#else
  using Ints = __m256i;
  constexpr int64_t kWidth = 16;
  const auto load_query = [](const int16_t* src) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src));
  };
  const auto load_key = [](const int8_t* src) {
    return _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src)));
  };
  const auto multiply_add = [](Ints sum, Ints a, Ints b) {
    return _mm256_add_epi32(sum, _mm256_madd_epi16(a, b));
  };
#endif
  Ints acc[N];  // raw registers: through Vec's wrapper GCC moved each before its products
#pragma GCC unroll 16
  for (int64_t i = 0; i < N; ++i) {
    acc[i] = Ints(Vec(0));
  }
  for (int64_t d = 0; d < dim; d += kWidth) {
    Ints query[kRows];
#pragma GCC unroll 4
    for (int64_t i = 0; i < kRows; ++i) {
      query[i] = load_query(q + i * ld_q + d);
    }
#pragma GCC unroll 16
    for (int64_t c = 0; c < kKeys; ++c) {
      if (stream != nullptr && d == 0) {
        stream->at_key(first_key + c);
      }
      const Ints key = load_key(k + c * ld_k + d);
#pragma GCC unroll 4
      for (int64_t i = 0; i < kRows; ++i) {
        acc[i * kKeys + c] = multiply_add(acc[i * kKeys + c], query[i], key);
      }
    }
  }
  Vec sums[N];
#pragma GCC unroll 16
  for (int64_t i = 0; i < N; ++i) {
    sums[i] = Vec(acc[i]);
  }
  store_integer_tile_sums<kRows, kKeys>(sums, scales, scores, ld_scores);
#else
  if (stream != nullptr) {
    stream->at_keys(first_key, kKeys);
  }
  for (int64_t i = 0; i < kRows; ++i) {
    for (int64_t c = 0; c < kKeys; ++c) {
      int32_t sum = 0;
      for (int64_t d = 0; d < dim; ++d) {
        sum += int32_t(q[i * ld_q + d]) * int32_t(k[c * ld_k + d]);
      }
      scores[i * ld_scores + c] = float(sum) * row_scales[i];
    }
  }
#endif
}

// scores[r * ld_scores + j] = (q_r . k_j) x row_scales[r] for r < kRows, j < cols: q_r = q + r *
// ld_q in int16 (quantize_query_row), k_j = k + j * ld_k in int8, `dim` elements each
// (integer_scores_fit), in tiles of kRows rows by band_tile_keys keys, the keys past the last
// whole tile one at a time.
template <int64_t kRows>
void query_key_integer_band(const int16_t* q, int64_t ld_q, const float* row_scales,
                            const int8_t* k, int64_t ld_k, int64_t cols, int64_t dim, float* scores,
                            int64_t ld_scores, const StreamAhead* stream) {
  constexpr int64_t kKeys = band_tile_keys<int32_t>(kRows);
  const at::vec::Vectorized<float> scales = tile_scales<kRows, kKeys>(row_scales);
  int64_t j = 0;
  for (; j + kKeys <= cols; j += kKeys) {
    query_key_integer_tile<kRows, kKeys>(q, ld_q, k + j * ld_k, ld_k, dim, row_scales, scales,
                                         scores + j, ld_scores, stream, j);
  }
  if (stream != nullptr) {
    stream->at_keys(j, cols - j);
  }
  const at::vec::Vectorized<float> last_scales = tile_scales<kRows, 1>(row_scales);
  for (; j < cols; ++j) {
    query_key_integer_tile<kRows, 1>(q, ld_q, k + j * ld_k, ld_k, dim, row_scales, last_scales,
                                     scores + j, ld_scores, nullptr, 0);
  }
}
#if defined(CPU_CAPABILITY_AVX512)
#pragma GCC pop_options
#endif

// query_key_integer_band for `rows` rows, four at a time (fewer for the last band); the first
// band tells the stream.
inline void query_key_integer_scores(const int16_t* q, int64_t ld_q, const float* row_scales,
                                     int64_t rows, const int8_t* k, int64_t ld_k, int64_t cols,
                                     int64_t dim, float* scores, int64_t ld_scores,
                                     const StreamAhead& stream) {
  in_bands_of_four(rows, [&](auto band_rows, int64_t r) {
    query_key_integer_band<decltype(band_rows)::value>(q + r * ld_q, ld_q, row_scales + r, k, ld_k,
                                                       cols, dim, scores + r * ld_scores, ld_scores,
                                                       r == 0 ? &stream : nullptr);
  });
}

}  // namespace causal_attention::cpu::CPU_CAPABILITY
