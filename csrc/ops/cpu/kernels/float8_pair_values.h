// The decode's P V_j for float8 value rows (e4m3, read as E4M3Over256, and e5m2) beside bfloat16
// query rows, where every row of the task sees the whole key block: by AVX-512 BF16's dot
// products of pairs, two keys a product.
//
// Each row's weights of the block (its probabilities times V's scales) are rounded to bfloat16
// once, as SDPA's flash kernel rounds P before its products with V in bfloat16 (a relative error
// of at most 2^-8 a weight, bfloat16's unit roundoff; a bfloat16 output rounds by as much). The
// value rows of a pair of keys are interleaved byte by byte and widened to bfloat16 by the float8
// tables (row_products.h, exact), so that each 32-bit lane holds the two keys' values of one
// column; one vdpbf16ps then adds both keys' products (exact: 8 by 4 significant bits) for 16
// columns of a row. The lanes come out in the interleave's order, put back once a block.
//
// Why: a float8 value row widened to float32 goes through float16 (vcvtph2ps), and the float32
// tiles (register_tiles.h) take 16 multiply-adds a key for four rows by 64 columns; in an
// in-cache e4m3 decode on a Zen 4 they were 44 % of the kernel's samples, more than the scores.
// Here a pair of keys by 64 columns and four rows takes 16 products, 4 broadcasts and 18
// instructions to load, interleave and widen (4 of them copies of the tables, which the permutes
// overwrite): a loop of 46 instructions, where the float32 tiles take 70 for the two keys.
// (bfloat16 caches keep the float32 tiles: their rows widen by a shift.)
//
// Included only by the per-instruction-set kernel sources (see geometry.h).
#pragma once

#include "paired_value_rows.h"
#include "register_tiles.h"
#include "row_products.h"

#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>

#if defined(CPU_CAPABILITY_AVX512)
#include <immintrin.h>
#endif

#include <cstdint>
#include <type_traits>

namespace causal_attention::cpu::CPU_CAPABILITY {

// Whether value rows of kv_t beside query rows of scalar_t may take the pair products: float8
// rows (kByTables) beside bfloat16 rows, in the AVX-512 build (which asks at run time whether the
// CPU has them and they pay on it: float8_pair_values_fit).
template <typename scalar_t, typename kv_t>
inline constexpr bool kFloat8PairValues =
#if defined(CPU_CAPABILITY_AVX512)
    std::is_same_v<scalar_t, c10::BFloat16> && kByTables<kv_t>;
#else
    false;
#endif

// The columns a pass of the pair products takes: the tables' 64 bytes.
constexpr int64_t kFloat8PairColumns = 64;

// Whether this CPU takes the pair products for value rows of dim_v elements: whole passes, and
// the pair dots taken here (AVX-512 BF16 with the tables' byte permutes, where they pay).
inline bool float8_pair_values_fit(int64_t dim_v) {
  return dim_v % kFloat8PairColumns == 0 && pair_dots_here();
}

// A task's scratch for accumulate_float8_pair_values: its rows' weights of one block in
// bfloat16 and the block's value rows.
template <typename kv_t>
using Float8PairWeights = PairWeights<c10::BFloat16, kv_t>;

#if defined(CPU_CAPABILITY_AVX512)
#pragma GCC push_options
#pragma GCC target("avx512bf16,avx512vbmi")
// out[i * ld_out + col + x] += sum over key pairs t < pairs of w[i * ld_w + 2t] * rows[2t][col +
// x] + w[i * ld_w + 2t + 1] * rows[2t + 1][col + x] for kRows rows i and the 64 columns x of the
// pass, the products of each pair added by one vdpbf16ps. With `requests`, each key pair's next
// rows are requested as it is reached.
template <int64_t kRows, typename kv_t>
C10_ALWAYS_INLINE void float8_pair_value_tile(const c10::BFloat16* w, int64_t ld_w,
                                              const kv_t* const* rows, int64_t pairs, int64_t col,
                                              float* out, int64_t ld_out,
                                              const BytePairTables<kv_t>& tables,
                                              const PairedValueRows<kv_t>* requests) {
  // acc[i][x]: row i's columns 16L + 4x to 16L + 4x + 3 in 16-byte lane L (the interleaves'
  // order: x = 0, 1 from the rows' bytes 0-7 of each lane, x = 2, 3 from 8-15)
  __m512 acc[kRows][4];
#pragma GCC unroll 4
  for (int64_t i = 0; i < kRows; ++i) {
#pragma GCC unroll 4
    for (int64_t x = 0; x < 4; ++x) {
      acc[i][x] = _mm512_setzero_ps();
    }
  }
  for (int64_t t = 0; t < pairs; ++t) {
    if (requests != nullptr) {
      requests->request(2 * t);
      requests->request(2 * t + 1);
    }
    const __m512i first = _mm512_loadu_si512(rows[2 * t] + col);
    const __m512i second = _mm512_loadu_si512(rows[2 * t + 1] + col);
    __m512bh values[2][2];  // each 32-bit lane: (first, second) of one column, in bfloat16
    byte_pairs_of(_mm512_unpacklo_epi8(first, second), tables, values[0]);
    byte_pairs_of(_mm512_unpackhi_epi8(first, second), tables, values[1]);
#pragma GCC unroll 4
    for (int64_t i = 0; i < kRows; ++i) {
      const __m512bh weights =
          reinterpret_cast<__m512bh>(_mm512_set1_epi32(weight_pair(w + i * ld_w, t)));
#pragma GCC unroll 4
      for (int64_t x = 0; x < 4; ++x) {
        acc[i][x] = _mm512_dpbf16_ps(acc[i][x], values[x / 2][x % 2], weights);
      }
    }
  }
#pragma GCC unroll 4
  for (int64_t i = 0; i < kRows; ++i) {
    // a transpose of 16-byte lanes: the pass's columns 16L to 16L + 15 are lane L of acc[i][0..3]
    const __m512 low01 = _mm512_shuffle_f32x4(acc[i][0], acc[i][1], 0x44);
    const __m512 low23 = _mm512_shuffle_f32x4(acc[i][2], acc[i][3], 0x44);
    const __m512 high01 = _mm512_shuffle_f32x4(acc[i][0], acc[i][1], 0xEE);
    const __m512 high23 = _mm512_shuffle_f32x4(acc[i][2], acc[i][3], 0xEE);
    const __m512 columns[4] = {
        _mm512_shuffle_f32x4(low01, low23, 0x88), _mm512_shuffle_f32x4(low01, low23, 0xDD),
        _mm512_shuffle_f32x4(high01, high23, 0x88), _mm512_shuffle_f32x4(high01, high23, 0xDD)};
    float* dst = out + i * ld_out + col;
#pragma GCC unroll 4
    for (int64_t x = 0; x < 4; ++x) {
      _mm512_storeu_ps(dst + 16 * x, _mm512_add_ps(_mm512_loadu_ps(dst + 16 * x), columns[x]));
    }
  }
}

// float8_pair_value_tile over the dim_v columns of kRows rows, the first pass requesting.
template <int64_t kRows, typename kv_t>
void float8_pair_value_band(const c10::BFloat16* w, int64_t ld_w, const kv_t* const* rows,
                            int64_t pairs, int64_t dim_v, float* out, int64_t ld_out,
                            const PairedValueRows<kv_t>* requests) {
  const BytePairTables<kv_t> tables = BytePairTables<kv_t>::get();  // in registers for the band
  for (int64_t col = 0; col < dim_v; col += kFloat8PairColumns) {
    float8_pair_value_tile<kRows>(w, ld_w, rows, pairs, col, out, ld_out, tables,
                                  col == 0 ? requests : nullptr);
  }
}

// n floats as bfloat16, rounded to nearest even, into out.
inline void round_to_bfloat16(const float* x, int64_t n, c10::BFloat16* out) {
  int64_t d = 0;
  for (; d + 16 <= n; d += 16) {
    const __m256bh rounded = _mm512_cvtneps_pbh(_mm512_loadu_ps(x + d));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + d), reinterpret_cast<__m256i>(rounded));
  }
  for (; d < n; ++d) {
    out[d] = c10::BFloat16(x[d]);
  }
}
#pragma GCC pop_options
#endif

// out[r * ld_out + c] += sum over j < cols of p[r * ld_p + j] * v_j[c] for r < rows, c < dim_v
// (float8_pair_values_fit), v_j row j of v's runs, every row seeing every key, the weights rounded
// to bfloat16; v's streams asked for the next block's rows as the first rows' first pass goes.
// The AVX-512 build's only (kFloat8PairValues).
template <typename kv_t>
void accumulate_float8_pair_values(const float* p, int64_t ld_p, int64_t rows, int64_t cols,
                                   const RunRows<kv_t>& v, int64_t dim_v, float* out,
                                   int64_t ld_out, Float8PairWeights<kv_t>& scratch) {
  static_assert(kFloat8PairValues<c10::BFloat16, kv_t>);
#if defined(CPU_CAPABILITY_AVX512)
  for (int64_t r = 0; r < rows; ++r) {
    c10::BFloat16* weights = scratch.row_weights(r);
    round_to_bfloat16(p + r * ld_p, cols, weights);
    weights[cols] = c10::BFloat16(0.0f);  // an odd count's last pair: its second key weighs nothing
  }
  const int64_t pairs = scratch.rows.gather(v, cols);
  in_bands_of_four(rows, [&](auto band_rows, int64_t r) {
    float8_pair_value_band<decltype(band_rows)::value>(
        scratch.row_weights(r), scratch.ld, scratch.rows.rows.data(), pairs, dim_v,
        out + r * ld_out, ld_out, r == 0 && v.streams != nullptr ? &scratch.rows : nullptr);
  });
#endif
}

}  // namespace causal_attention::cpu::CPU_CAPABILITY
