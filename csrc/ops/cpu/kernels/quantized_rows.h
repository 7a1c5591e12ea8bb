// The rows of an 8-bit paged KV cache (float8_e4m3fn, float8_e5m2 or int8 pages, each row with
// its dequantization scale: stored value x scale = key or value). The kernels never read such a
// row in place: a block of them is widened once, with its scales, into float32 rows in the
// task's scratch (decode.h) or into the call's packed blocks (packed_kv.h), and the products run
// on those. The scale is applied as the row is widened: one multiply on a value already in a
// register, exact up to that one float32 rounding, whether it is per tensor or per token.
//
// Included only by the per-instruction-set kernel sources (see geometry.h).
#pragma once

#include "eight_bit_values.h"
#include "register_tiles.h"
#include "row_sources.h"

#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cstdint>
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

// dst[i] = src[i] * scale for i < n: a row of 8-bit values (eight_bit_values.h), widened in
// registers, times its scale.
template <typename T>
inline void widen_scaled(const T* src, int64_t n, float scale, float* dst) {
  using Vec = at::vec::Vectorized<float>;
  const Vec factor(scale);
  int64_t i = 0;
  for (; i + Vec::size() <= n; i += Vec::size()) {
    (load_as<float>(src + i) * factor).store(dst + i);
  }
  if (i < n) {
    (load_as<float>(src + i, n - i) * factor).store(dst + i, n - i);
  }
}

// The rows of an 8-bit paged cache viewed as (num_pages, heads, page_size, col), found as
// PagedRows finds them, read by widening a block of them at a time into float32 rows with their
// scales: float32 viewed the same way without col (stride 0 along every dim for a scale per
// tensor; 1 where the tensor is undefined). Its bytes are uint8_t; their format is read from the
// cache's dtype.
struct QuantizedPagedRows {
  using stored_t = uint8_t;
  PagedRows<const stored_t> rows;
  const float* scales;
  int64_t scale_page_stride = 0, scale_head_stride = 0, scale_row_stride = 0;
  EightBit format;

  QuantizedPagedRows(const at::Tensor& cache, const at::Tensor& scale, const at::Tensor& table)
      : rows(cache, table), scales(&kOne), format(eight_bit_format(cache.scalar_type())) {
    if (scale.defined()) {
      scales = scale.data_ptr<float>();
      scale_page_stride = scale.stride(0);
      scale_head_stride = scale.stride(1);
      scale_row_stride = scale.stride(2);
    }
  }

  int64_t run_end(int64_t r) const { return rows.run_end(r); }

  // Whether `other` widens the same rows with the same scales (their first columns: MLA's
  // values, a view of its latent keys), so that what this widened serves for both.
  bool same_rows(const QuantizedPagedRows& other) const {
    return rows.same_rows(other.rows) && scales == other.scales &&
           scale_page_stride == other.scale_page_stride &&
           scale_head_stride == other.scale_head_stride &&
           scale_row_stride == other.scale_row_stride && format == other.format;
  }

  // Rows [r, r + count) of (b, h), each `width` values times its scale into dst, rows ld apart.
  void widen(int64_t b, int64_t h, int64_t r, int64_t count, int64_t width, float* dst,
             int64_t ld) const {
    widen_heads(b, h, 1, r, count, width, &dst, ld);
  }

  // As widen(), for heads [h, h + heads), head h + i's rows into dst[i]: a page's rows in the
  // order they lie (row by row, each row's heads side by side), one sweep through its bytes.
  void widen_heads(int64_t b, int64_t h, int64_t heads, int64_t r, int64_t count, int64_t width,
                   float* const* dst, int64_t ld) const {
    with_element_type([&](auto type) {
      using element_t = std::remove_const_t<std::remove_pointer_t<decltype(type)>>;
      widen_runs<element_t>(b, h, heads, r, count, width, dst, ld);
    });
  }

  // Where row r of (b, h) lies in the cache, for the prefetches of a block widened next.
  const char* row_address(int64_t b, int64_t h, int64_t r) const {
    return reinterpret_cast<const char*>(rows.row(b, h, r));
  }

  // The products read float32 rows widened into scratch (decode.h, packed_kv.h).
  using row_t = float;
  static constexpr bool kWidens = true;
  static constexpr bool kInterleavedHeads = PagedRows<const stored_t>::kInterleavedHeads;
  static constexpr bool kOneRun = false;

 private:
  static constexpr float kOne = 1.0f;

  // Calls fn with a null `const element_t*`, element_t the type of the values the rows hold (by
  // the cache's dtype): c10::Float8_e4m3fn, c10::Float8_e5m2 or int8_t, which widen_scaled reads
  // (row_as).
  template <typename Fn>
  void with_element_type(const Fn& fn) const {
    switch (format) {
      case EightBit::kE4M3:
        return fn(static_cast<const c10::Float8_e4m3fn*>(nullptr));
      case EightBit::kE5M2:
        return fn(static_cast<const c10::Float8_e5m2*>(nullptr));
      case EightBit::kInt8:
        return fn(static_cast<const int8_t*>(nullptr));
    }
  }

  // Row r of (b, h) read in place, as with_element_type's element_t.
  template <typename element_t>
  const element_t* row_as(int64_t b, int64_t h, int64_t r) const {
    static_assert(sizeof(element_t) == sizeof(stored_t));
    return reinterpret_cast<const element_t*>(rows.row(b, h, r));
  }

  // The scales of the page that row r of batch item b lies on.
  const float* page_scales(int64_t b, int64_t r) const {
    return scales + rows.block_table[b * rows.table_width + r / rows.page_size] * scale_page_stride;
  }

  template <typename element_t>
  void widen_runs(int64_t b, int64_t h, int64_t heads, int64_t r, int64_t count, int64_t width,
                  float* const* dst, int64_t ld) const {
    for (int64_t key = r, end; key < r + count; key = end) {  // a page at a time
      end = std::min(r + count, run_end(key));
      const float* page = page_scales(b, key);
      for (int64_t k = key; k < end; ++k) {
        const element_t* src = row_as<element_t>(b, h, k);
        const float* scale = page + (k % rows.page_size) * scale_row_stride;
        for (int64_t i = 0; i < heads; ++i) {
          widen_scaled(src + i * rows.head_stride, width, scale[(h + i) * scale_head_stride],
                       dst[i] + (k - r) * ld);
        }
      }
    }
  }
};

}  // namespace causal_attention::cpu::CPU_CAPABILITY
