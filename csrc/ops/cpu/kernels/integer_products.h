// The decode's products of an int8 KV cache's rows (read in place) beside bfloat16 and float16
// query rows, as integer products summed exactly: the scores q . k, and the values' P V.
//
// Scores: each query row is held as int16 values times a power of two, 2^e (quantize_row), e
// chosen so that the row's largest magnitude m lies in [2^14, 2^15) units: every element within 7
// binades of m is held exactly in bfloat16 (4 in float16, whose significands are longer), every
// other one rounded to the nearest unit, an error of at most 2^-15 m. The int16 x int8 products of
// a row and a key are summed in int32, exactly: |sum| <= 32767 x 128 x 512 < 2^31 for head dims
// up to 512 (integer_scores_fit). So the sums take no rounding at all and are the same in any
// order, on every chip and build (AVX-512 VNNI's vpdpwssd, AVX2's vpmaddwd, the scalar loop), and
// the score is float(sum) x 2^e, rounded once.
//
// Values: a key block's weights of each row (its probabilities times V's scales) are held the
// same way, in units of 2^-15 of the power of two above the block's largest (accumulate_integer_
// values), and multiplied with the int8 value rows two keys a product, summed exactly over the
// block and converted once.
//
// Why: an int8 row widens to int16 in one instruction a 32 values, where its widening to
// bfloat16 for the pair dot products took nine a 64 (byte tables) and to float32 two a 16; the
// products then cost what bfloat16's do (32 a vpdpwssd as a vdpbf16ps), half the float32
// multiply-adds. In an in-cache int8 decode on a Zen 4 the scores were 41 % of the kernel's
// samples and the values 37 % (stop 69).
//
// Included only by the per-instruction-set kernel sources (see geometry.h).
#pragma once

#include "paired_value_rows.h"
#include "register_tiles.h"
#include "row_products.h"
#include "scratch_vector.h"

#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

namespace causal_attention::cpu::CPU_CAPABILITY {

// Whether query rows of scalar_t take int8 K and V rows of kv_t by integer products: bfloat16
// and float16 rows, whose elements int16 holds exactly over 7 and 4 binades (float32's 24-bit
// significands would lose more than their own rounding).
template <typename scalar_t, typename kv_t>
inline constexpr bool kIntegerProducts =
    std::is_same_v<kv_t, int8_t> &&
    (std::is_same_v<scalar_t, c10::BFloat16> || std::is_same_v<scalar_t, c10::Half>);

// The head dims the integer products take: whole steps of 32 (an AVX-512 step; two of AVX2's),
// up to 512, where the int32 sums cannot overflow.
constexpr int64_t kIntegerStep = 32;
constexpr int64_t kMaxIntegerDim = 512;

// Whether this CPU and build take the integer products: the AVX-512 build on chips with AVX-512
// VNNI (every chip seen with AVX-512 has it; without it a product would take two instructions
// and the float path is kept), the others everywhere. integer_scores_fit and integer_values_fit
// add the head dims each takes.
inline bool integer_products_here() {
#if defined(CPU_CAPABILITY_AVX512)
  static const bool has_vnni = __builtin_cpu_supports("avx512vnni");
  return has_vnni;
#else
  return true;
#endif
}
inline bool integer_scores_fit(int64_t dim) {
  return dim % kIntegerStep == 0 && dim <= kMaxIntegerDim && integer_products_here();
}

// Integer-valued floats (|x| <= 32767) as int16, into out.
inline void store_as_int16(const at::vec::Vectorized<float>& units, int16_t* out) {
#if defined(CPU_CAPABILITY_AVX512)
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out),
                      _mm512_cvtepi32_epi16(_mm512_cvtps_epi32(units)));
#elif defined(CPU_CAPABILITY_AVX2)
  const __m256i ints = _mm256_cvtps_epi32(units);
  _mm_storeu_si128(
      reinterpret_cast<__m128i*>(out),
      _mm_packs_epi32(_mm256_castsi256_si128(ints), _mm256_extracti128_si256(ints, 1)));
#else
  __at_align__ float lanes[at::vec::Vectorized<float>::size()];
  units.store(lanes);
  std::copy_n(lanes, at::vec::Vectorized<float>::size(), out);
#endif
}

// 2^e for -126 <= e <= 127: a normal float's bits.
inline float power_of_two(int32_t e) {
  const uint32_t bits = uint32_t(e + 127) << 23;
  float value;
  std::memcpy(&value, &bits, sizeof(value));
  return value;
}

// x (n elements) as int16 values times a power of two (the row's unit), into out: each rounded
// half to even to a unit of 2^-15 of the power of two above the row's largest magnitude; returns
// the unit, or 0 where the row holds a non-finite element, which int16 cannot hold (the caller
// then keeps the float32 tiles). (A query row's bfloat16 or float16 values, widened exactly, or a
// row of a key block's weights.)
inline float quantize_row(const float* x, int64_t n, int16_t* out) {
  using Vec = at::vec::Vectorized<float>;
  constexpr int64_t N = Vec::size();
  Vec largest(0.0f);
  int64_t d = 0;
  for (; d + N <= n; d += N) {
    largest = at::vec::maximum(largest, Vec::loadu(x + d).abs());  // NaN propagates
  }
  if (d < n) {
    largest = at::vec::maximum(largest, Vec::loadu(x + d, n - d).abs());
  }
  const float top = at::vec::vec_reduce_all<float>(
      [](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, largest);
  if (!std::isfinite(top)) {
    return 0.0f;
  }
  // The unit: 2^-15 of the power of two above top, kept a normal float (a row below 2^-111 then
  // keeps fewer bits), read from top's exponent bits (frexp and ldexp are calls, a row of weights
  // a block each).
  uint32_t bits;
  std::memcpy(&bits, &top, sizeof(bits));
  const int32_t biased = int32_t(bits >> 23);  // top in [2^(biased - 127), 2^(biased - 126))
  const int32_t unit = std::max(biased - 126 - 15, -126);
  const float to_units = power_of_two(-unit), unit_value = power_of_two(unit);
  // exact but for the rounding to an integer; below 2^15 units, rounded at most to 2^15
  const Vec factor(to_units), least(-32767.0f), most(32767.0f);
  for (d = 0; d + N <= n; d += N) {
    store_as_int16(at::vec::clamp((Vec::loadu(x + d) * factor).round(), least, most), out + d);
  }
  for (; d < n; ++d) {
    out[d] = int16_t(std::clamp(std::nearbyint(x[d] * to_units), -32767.0f, 32767.0f));
  }
  return unit_value;
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

// The vector steps both tiles take, per build: IntVector holds kInt16Lanes int16 values
// (widen_int8: as many int8 values widened) or half as many int32 sums, and multiply_add_pairs
// adds the products of a's and b's int16 lanes into sum, each pair of them into its int32 lane.
#if defined(CPU_CAPABILITY_AVX512)
using IntVector = __m512i;
constexpr int64_t kInt16Lanes = 32;
C10_ALWAYS_INLINE __m512i widen_int8(const int8_t* src) {
  return _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src)));
}
#pragma GCC push_options
#pragma GCC target("avx512vnni")
// vpdpwssd, the sum updated in its own register: through _mm512_dpwssd_epi32 GCC 12 moved each
// accumulator of a tile to another register and back at every step (twice the instructions of
// the products in the values' tile).
C10_ALWAYS_INLINE __m512i multiply_add_pairs(__m512i sum, __m512i a, __m512i b) {
  asm("vpdpwssd %2, %1, %0" : "+v"(sum) : "v"(a), "v"(b));
  return sum;
}
#pragma GCC pop_options
#elif defined(CPU_CAPABILITY_AVX2)
using IntVector = __m256i;
constexpr int64_t kInt16Lanes = 16;
C10_ALWAYS_INLINE __m256i widen_int8(const int8_t* src) {
  return _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src)));
}
C10_ALWAYS_INLINE __m256i multiply_add_pairs(__m256i sum, __m256i a, __m256i b) {
  return _mm256_add_epi32(sum, _mm256_madd_epi16(a, b));
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
  using Ints = IntVector;
  Ints acc[N];  // raw registers: through Vec's wrapper GCC moved each before its products
#pragma GCC unroll 16
  for (int64_t i = 0; i < N; ++i) {
    acc[i] = Ints(Vec(0));
  }
  for (int64_t d = 0; d < dim; d += kInt16Lanes) {
    Ints query[kRows];
#pragma GCC unroll 4
    for (int64_t i = 0; i < kRows; ++i) {
      std::memcpy(&query[i], q + i * ld_q + d, sizeof(Ints));
    }
#pragma GCC unroll 16
    for (int64_t c = 0; c < kKeys; ++c) {
      if (stream != nullptr && d == 0) {
        stream->at_key(first_key + c);
      }
      const Ints key = widen_int8(k + c * ld_k + d);
#pragma GCC unroll 4
      for (int64_t i = 0; i < kRows; ++i) {
        acc[i * kKeys + c] = multiply_add_pairs(acc[i * kKeys + c], query[i], key);
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
// ld_q in int16 (quantize_row), k_j = k + j * ld_k in int8, `dim` elements each
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

// ---- Values ----
// The decode's P V_j for int8 value rows beside bfloat16 or float16 query rows (kIntegerProducts),
// where every row sees every key of the block: each row's weights (P times V's scales) held as
// int16 in units of 2^-15 of the power of two above the block's largest (quantize_row: an error
// of at most 2^-16 of it a weight, where SDPA rounds P to bfloat16, 2^-8 of each), their
// products with the int8 value rows summed exactly in int32, two keys a product (the rows of a
// pair interleaved, AVX-512 VNNI's vpdpwssd, AVX2's vpmaddwd), and converted once a block:
// |sum| <= 256 x 32767 x 128 < 2^31 for a block of up to kMaxIntegerKeys keys.
constexpr int64_t kMaxIntegerKeys = 256;

// Whether the values' integer products take value rows of dim_v elements: whole steps of 32.
inline bool integer_values_fit(int64_t dim_v) {
  return dim_v % kIntegerStep == 0 && integer_products_here();
}

// A task's scratch for accumulate_integer_values: its rows' weights of one block, the block's
// value rows, and the weights' units.
struct IntegerWeights : PairWeights<int16_t, int8_t> {
  ScratchVector<float> units;
  IntegerWeights(int64_t task_rows, int64_t keys, int64_t dim_v)
      : PairWeights(task_rows, keys, dim_v), units(task_rows) {}
};

#if defined(CPU_CAPABILITY_AVX512)
#pragma GCC push_options
#pragma GCC target("avx512vnni")
#endif
// out[i * ld_out + col + x] += units[i] * sum over key pairs t < pairs of w[i * ld_w + 2t] *
// rows[2t][col + x] + w[i * ld_w + 2t + 1] * rows[2t + 1][col + x], for kRows rows i and
// kChunks chunks of columns x (32 a chunk in AVX-512, 16 in AVX2), the sums in int32. With
// `requests`, each key pair's next rows are requested as it is reached.
template <int64_t kRows, int64_t kChunks>
C10_ALWAYS_INLINE void integer_value_tile(const int16_t* w, int64_t ld_w, const int8_t* const* rows,
                                          int64_t pairs, int64_t col, const float* units,
                                          float* out, int64_t ld_out,
                                          const PairedValueRows<int8_t>* requests) {
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
  using Ints = IntVector;
  constexpr int64_t kChunk = kInt16Lanes;
#if defined(CPU_CAPABILITY_AVX512)
  const auto broadcast = [](int32_t pair) { return _mm512_set1_epi32(pair); };
  const auto interleave_low = [](Ints a, Ints b) { return _mm512_unpacklo_epi16(a, b); };
  const auto interleave_high = [](Ints a, Ints b) { return _mm512_unpackhi_epi16(a, b); };
#else
  const auto broadcast = [](int32_t pair) { return _mm256_set1_epi32(pair); };
  const auto interleave_low = [](Ints a, Ints b) { return _mm256_unpacklo_epi16(a, b); };
  const auto interleave_high = [](Ints a, Ints b) { return _mm256_unpackhi_epi16(a, b); };
#endif
  // acc[i][2 * h]: the chunk's columns 0-3, 8-11, ... of each 8 (the pairs' low interleave),
  // acc[i][2 * h + 1] columns 4-7, 12-15, ...
  Ints acc[kRows][2 * kChunks];
#pragma GCC unroll 4
  for (int64_t i = 0; i < kRows; ++i) {
#pragma GCC unroll 4
    for (int64_t x = 0; x < 2 * kChunks; ++x) {
      acc[i][x] = Ints{};
    }
  }
  for (int64_t t = 0; t < pairs; ++t) {
    if (requests != nullptr) {
      requests->request(2 * t);
      requests->request(2 * t + 1);
    }
    const int8_t* first = rows[2 * t] + col;
    const int8_t* second = rows[2 * t + 1] + col;
    Ints pairs_of_rows[kRows];
#pragma GCC unroll 4
    for (int64_t i = 0; i < kRows; ++i) {
      pairs_of_rows[i] = broadcast(weight_pair(w + i * ld_w, t));
    }
#pragma GCC unroll 2
    for (int64_t h = 0; h < kChunks; ++h) {
      const Ints a = widen_int8(first + h * kChunk), b = widen_int8(second + h * kChunk);
      const Ints low = interleave_low(a, b), high = interleave_high(a, b);
#pragma GCC unroll 4
      for (int64_t i = 0; i < kRows; ++i) {
        acc[i][2 * h] = multiply_add_pairs(acc[i][2 * h], low, pairs_of_rows[i]);
        acc[i][2 * h + 1] = multiply_add_pairs(acc[i][2 * h + 1], high, pairs_of_rows[i]);
      }
    }
  }
#pragma GCC unroll 4
  for (int64_t i = 0; i < kRows; ++i) {
    const at::vec::Vectorized<float> unit(units[i]);
#pragma GCC unroll 2
    for (int64_t h = 0; h < kChunks; ++h) {
      float* dst = out + i * ld_out + col + h * kChunk;
      Ints columns[2];  // the chunk's columns in order, two vectors
#if defined(CPU_CAPABILITY_AVX512)
      columns[0] = _mm512_permutex2var_epi32(
          acc[i][2 * h], _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23),
          acc[i][2 * h + 1]);
      columns[1] = _mm512_permutex2var_epi32(
          acc[i][2 * h],
          _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31),
          acc[i][2 * h + 1]);
      const auto as_float = [](Ints v) {
        return at::vec::Vectorized<float>(_mm512_cvtepi32_ps(v));
      };
#else
      columns[0] = _mm256_permute2x128_si256(acc[i][2 * h], acc[i][2 * h + 1], 0x20);
      columns[1] = _mm256_permute2x128_si256(acc[i][2 * h], acc[i][2 * h + 1], 0x31);
      const auto as_float = [](Ints v) {
        return at::vec::Vectorized<float>(_mm256_cvtepi32_ps(v));
      };
#endif
      constexpr int64_t N = at::vec::Vectorized<float>::size();
#pragma GCC unroll 2
      for (int64_t x = 0; x < 2; ++x) {
        at::vec::fmadd(as_float(columns[x]), unit, at::vec::Vectorized<float>::loadu(dst + x * N))
            .store(dst + x * N);
      }
    }
  }
#else
  constexpr int64_t kChunk = 16;
  for (int64_t t = 0; t < pairs && requests != nullptr; ++t) {
    requests->request(2 * t);
    requests->request(2 * t + 1);
  }
  for (int64_t i = 0; i < kRows; ++i) {
    for (int64_t x = col; x < col + kChunks * kChunk; ++x) {
      int32_t sum = 0;
      for (int64_t t = 0; t < pairs; ++t) {
        sum += int32_t(w[i * ld_w + 2 * t]) * rows[2 * t][x] +
               int32_t(w[i * ld_w + 2 * t + 1]) * rows[2 * t + 1][x];
      }
      out[i * ld_out + x] += float(sum) * units[i];
    }
  }
#endif
}

// The columns a pass of integer_value_tile takes at once: four rows by four vectors of
// accumulators where AVX-512's 32 registers hold sixteen (two chunks), four by two with AVX2's 16.
constexpr int64_t kIntegerValueChunk =
#if defined(CPU_CAPABILITY_AVX512)
    32;
#else
    16;
#endif

// integer_value_tile over the dim_v columns of kRows rows: passes of two chunks, then one.
template <int64_t kRows>
void integer_value_band(const int16_t* w, int64_t ld_w, const int8_t* const* rows, int64_t pairs,
                        int64_t dim_v, const float* units, float* out, int64_t ld_out,
                        const PairedValueRows<int8_t>* requests) {
  constexpr int64_t kPass = (kIntegerValueChunk == 32 ? 2 : 1) * kIntegerValueChunk;
  int64_t col = 0;
  for (; col + kPass <= dim_v; col += kPass) {
    integer_value_tile<kRows, kPass / kIntegerValueChunk>(w, ld_w, rows, pairs, col, units, out,
                                                          ld_out, col == 0 ? requests : nullptr);
  }
  for (; col < dim_v; col += kIntegerValueChunk) {
    integer_value_tile<kRows, 1>(w, ld_w, rows, pairs, col, units, out, ld_out,
                                 col == 0 ? requests : nullptr);
  }
}
#if defined(CPU_CAPABILITY_AVX512)
#pragma GCC pop_options
#endif

// out[r * ld_out + c] += sum over j < cols of p[r * ld_p + j] * v_j[c] for r < rows, c < dim_v
// (integer_values_fit), v_j row j of v's runs, every row seeing every key, cols <=
// kMaxIntegerKeys; v's streams asked for the next block's rows as the first rows' first pass
// goes. Returns false, leaving out as it was, where a row's weights are not all finite (the
// float32 tiles then take them).
inline bool accumulate_integer_values(const float* p, int64_t ld_p, int64_t rows, int64_t cols,
                                      const RunRows<int8_t>& v, int64_t dim_v, float* out,
                                      int64_t ld_out, IntegerWeights& scratch) {
  for (int64_t r = 0; r < rows; ++r) {
    int16_t* weights = scratch.row_weights(r);
    scratch.units[r] = quantize_row(p + r * ld_p, cols, weights);
    if (scratch.units[r] == 0) {
      return false;
    }
    weights[cols] = 0;  // an odd count's last pair: its second key weighs nothing
  }
  const int64_t pairs = scratch.rows.gather(v, cols);
  in_bands_of_four(rows, [&](auto band_rows, int64_t r) {
    integer_value_band<decltype(band_rows)::value>(
        scratch.row_weights(r), scratch.ld, scratch.rows.rows.data(), pairs, dim_v,
        scratch.units.data() + r, out + r * ld_out, ld_out,
        r == 0 && v.streams != nullptr ? &scratch.rows : nullptr);
  });
  return true;
}

}  // namespace causal_attention::cpu::CPU_CAPABILITY
