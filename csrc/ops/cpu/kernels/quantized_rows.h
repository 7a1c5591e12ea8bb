// The rows of an 8-bit paged KV cache (float8_e4m3fn, float8_e5m2 or int8 pages, each row with
// its dequantization scale: stored value x scale = key or value). The kernels never read such a
// row in place: a block of them is widened once, with its scales, into float32 rows in the
// task's scratch (decode.h) or into the call's packed blocks (packed_kv.h), and the products run
// on those. The scale is applied as the row is widened: one multiply on a value already in a
// register, exact up to that one float32 rounding, whether it is per tensor or per token.
//
// Included only by the per-instruction-set kernel sources (see geometry.h).
#pragma once

#include "row_sources.h"

#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/functional.h>
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

enum class EightBit : uint8_t { kE4M3, kE5M2, kInt8 };

inline EightBit eight_bit_format(at::ScalarType dtype) {
  switch (dtype) {
    case at::kFloat8_e4m3fn:
      return EightBit::kE4M3;
    case at::kFloat8_e5m2:
      return EightBit::kE5M2;
    default:
      return EightBit::kInt8;  // the checks let no other dtype through (paged_checks.cpp)
  }
}

// One stored value as float32.
template <EightBit kFormat>
inline float widen_value(uint8_t bits) {
  if constexpr (kFormat == EightBit::kE4M3) {
    return static_cast<float>(c10::Float8_e4m3fn(bits, c10::Float8_e4m3fn::from_bits()));
  } else if constexpr (kFormat == EightBit::kE5M2) {
    return static_cast<float>(c10::Float8_e5m2(bits, c10::Float8_e5m2::from_bits()));
  } else {
    return static_cast<float>(static_cast<int8_t>(bits));
  }
}

// dst[i] = value(src[i]) * scale for i < n. The vector paths give the scalar path's results
// bit for bit: an fp8 value goes through float16 exactly (e5m2 is float16's top byte; e4m3's
// exponent and mantissa shifted into float16's, off by the bias 2^8, which the scale absorbs),
// and e4m3's NaN (S.1111.111, which has no float16 image) is set apart.
template <EightBit kFormat>
inline void widen_scaled(const uint8_t* src, int64_t n, float scale, float* dst) {
  int64_t i = 0;
#if defined(CPU_CAPABILITY_AVX512)
  const __m512 factor = _mm512_set1_ps(kFormat == EightBit::kE4M3 ? scale * 256.0f : scale);
  for (; i + 16 <= n; i += 16) {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    __m512 x;
    if constexpr (kFormat == EightBit::kInt8) {
      x = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes));
    } else if constexpr (kFormat == EightBit::kE5M2) {
      x = _mm512_cvtph_ps(_mm256_slli_epi16(_mm256_cvtepu8_epi16(bytes), 8));
    } else {
      const __m256i wide = _mm256_cvtepu8_epi16(bytes);
      const __m256i magnitude = _mm256_and_si256(wide, _mm256_set1_epi16(0x7F));
      const __m256i sign = _mm256_and_si256(wide, _mm256_set1_epi16(0x80));
      x = _mm512_cvtph_ps(
          _mm256_or_si256(_mm256_slli_epi16(sign, 8), _mm256_slli_epi16(magnitude, 7)));
      const __mmask16 nan = _mm256_cmpeq_epi16_mask(magnitude, _mm256_set1_epi16(0x7F));
      x = _mm512_mask_mov_ps(x, nan, _mm512_set1_ps(std::numeric_limits<float>::quiet_NaN()));
    }
    _mm512_storeu_ps(dst + i, _mm512_mul_ps(x, factor));
  }
#elif defined(CPU_CAPABILITY_AVX2)
  const __m256 factor = _mm256_set1_ps(kFormat == EightBit::kE4M3 ? scale * 256.0f : scale);
  for (; i + 8 <= n; i += 8) {
    const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(src + i));
    __m256 x;
    if constexpr (kFormat == EightBit::kInt8) {
      x = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
    } else if constexpr (kFormat == EightBit::kE5M2) {
      x = _mm256_cvtph_ps(_mm_slli_epi16(_mm_cvtepu8_epi16(bytes), 8));
    } else {
      const __m128i wide = _mm_cvtepu8_epi16(bytes);
      const __m128i magnitude = _mm_and_si128(wide, _mm_set1_epi16(0x7F));
      const __m128i sign = _mm_and_si128(wide, _mm_set1_epi16(0x80));
      x = _mm256_cvtph_ps(_mm_or_si128(_mm_slli_epi16(sign, 8), _mm_slli_epi16(magnitude, 7)));
      const __m128i nan16 = _mm_cmpeq_epi16(magnitude, _mm_set1_epi16(0x7F));
      x = _mm256_blendv_ps(x, _mm256_set1_ps(std::numeric_limits<float>::quiet_NaN()),
                           _mm256_castsi256_ps(_mm256_cvtepi16_epi32(nan16)));
    }
    _mm256_storeu_ps(dst + i, _mm256_mul_ps(x, factor));
  }
#endif
  for (; i < n; ++i) {
    dst[i] = widen_value<kFormat>(src[i]) * scale;
  }
}

// A bfloat16 or float16 row as float32 (times its scale where that is not 1).
template <typename stored_t>
inline void widen_scaled(const stored_t* src, int64_t n, float scale, float* dst) {
  at::vec::convert(src, dst, n);
  if (scale != 1.0f) {
    for (int64_t i = 0; i < n; ++i) {
      dst[i] *= scale;
    }
  }
}

// The rows of a paged cache viewed as (num_pages, heads, page_size, col), found as PagedRows
// finds them, read by widening a block of them at a time into float32 rows with their scales:
// float32 viewed the same way without col (stride 0 along every dim for a scale per tensor; 1
// where the tensor is undefined). stored_t: uint8_t for an 8-bit cache (its format read from its
// dtype), or a bfloat16 or float16 cache's own type, which a decode reads faster widened once than
// widened in registers by every query row of the GQA group (benchmarks.paged, precisions).
template <typename T>
struct WidenedPagedRows {
  using stored_t = T;
  PagedRows<const stored_t> rows;
  const float* scales;
  int64_t scale_page_stride = 0, scale_head_stride = 0, scale_row_stride = 0;
  EightBit format;

  WidenedPagedRows(const at::Tensor& cache, const at::Tensor& scale, const at::Tensor& table)
      : rows(cache, table), scales(&kOne), format(eight_bit_format(cache.scalar_type())) {
    if (scale.defined()) {
      scales = scale.data_ptr<float>();
      scale_page_stride = scale.stride(0);
      scale_head_stride = scale.stride(1);
      scale_row_stride = scale.stride(2);
    }
  }

  int64_t run_end(int64_t r) const { return rows.run_end(r); }

  // Rows [r, r + count) of (b, h), each `width` values times its scale into dst, rows ld apart.
  void widen(int64_t b, int64_t h, int64_t r, int64_t count, int64_t width, float* dst,
             int64_t ld) const {
    widen_heads(b, h, 1, r, count, width, &dst, ld);
  }

  // As widen(), for heads [h, h + heads), head h + i's rows into dst[i]: a page's rows in the
  // order they lie (row by row, each row's heads side by side), one sweep through its bytes.
  void widen_heads(int64_t b, int64_t h, int64_t heads, int64_t r, int64_t count, int64_t width,
                   float* const* dst, int64_t ld) const {
    if constexpr (std::is_same_v<stored_t, uint8_t>) {
      switch (format) {
        case EightBit::kE4M3:
          return widen_runs(b, h, heads, r, count, width, dst, ld, widen_scaled<EightBit::kE4M3>);
        case EightBit::kE5M2:
          return widen_runs(b, h, heads, r, count, width, dst, ld, widen_scaled<EightBit::kE5M2>);
        case EightBit::kInt8:
          return widen_runs(b, h, heads, r, count, width, dst, ld, widen_scaled<EightBit::kInt8>);
      }
    } else {
      widen_runs(b, h, heads, r, count, width, dst, ld, widen_scaled<stored_t>);
    }
  }

  // Requests rows [r, r + count) of every head (`heads`, `width` values each) into L2, for a
  // block widened next.
  void prefetch(int64_t b, int64_t heads, int64_t r, int64_t count, int64_t width) const {
    constexpr int64_t kLineBytes = 64;
    for (int64_t key = r; key < r + count; ++key) {
      for (int64_t h = 0; h < heads; ++h) {
        const char* row = reinterpret_cast<const char*>(rows.row(b, h, key));
        for (int64_t c = 0; c < width * int64_t(sizeof(stored_t)); c += kLineBytes) {
          __builtin_prefetch(row + c, /*rw=*/0, /*locality=*/2);
        }
      }
    }
  }

  // The products read float32 rows widened into scratch (decode.h, packed_kv.h).
  using row_t = float;
  static constexpr bool kWidens = true;
  static constexpr bool kInterleavedHeads = PagedRows<const stored_t>::kInterleavedHeads;
  static constexpr bool kOneRun = false;

 private:
  static constexpr float kOne = 1.0f;

  template <typename WidenRow>
  void widen_runs(int64_t b, int64_t h, int64_t heads, int64_t r, int64_t count, int64_t width,
                  float* const* dst, int64_t ld, const WidenRow& widen_row) const {
    for (int64_t key = r, end; key < r + count; key = end) {  // a page at a time
      end = std::min(r + count, run_end(key));
      const int64_t page = rows.block_table[b * rows.table_width + key / rows.page_size];
      const float* page_scales = scales + page * scale_page_stride;
      for (int64_t k = key; k < end; ++k) {
        const stored_t* src = rows.row(b, h, k);
        const float* scale = page_scales + (k % rows.page_size) * scale_row_stride;
        for (int64_t i = 0; i < heads; ++i) {
          widen_row(src + i * rows.head_stride, width, scale[(h + i) * scale_head_stride],
                    dst[i] + (k - r) * ld);
        }
      }
    }
  }
};

// An 8-bit cache's rows.
using QuantizedPagedRows = WidenedPagedRows<uint8_t>;

}  // namespace causal_attention::cpu::CPU_CAPABILITY
