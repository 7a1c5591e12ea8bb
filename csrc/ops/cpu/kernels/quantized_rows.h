// The rows of an 8-bit paged KV cache (float8_e4m3fn, float8_e5m2 or int8 pages, each row with
// its dequantization scale: stored value x scale = key or value), read two ways:
// - by the decode in place (ScaledPagedRows), widened in registers by the products as bfloat16
//   rows are (int8 key rows multiplied as integers by reduced query rows, integer_products.h), with
//   no copy; the decode multiplies each key's scores by K's scale and its probabilities by V's
//   (decode.h), one multiply a key and query row;
// - by the block path (prefill chunks) a block at a time, widened once with their scales into the
//   call's packed blocks (QuantizedPagedRows, packed_kv.h), and multiplied as a bfloat16 cache's.
//   The scale is applied as the row is widened: one multiply on a value already in a register.
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

// The scales of a paged cache's rows: float32 viewed as (num_pages, heads, page_size) (stride 0
// along every dim for a scale per tensor; 1 where the tensor is undefined).
class PageScales {
 public:
  explicit PageScales(const at::Tensor& scale) {
    if (scale.defined()) {
      scales_ = scale.data_ptr<float>();
      page_stride_ = scale.stride(0);
      head_stride_ = scale.stride(1);
      row_stride_ = scale.stride(2);
    }
  }

  // The scale of row r of (b, h), found through `rows`' block table; the page's next rows' follow
  // at row_stride().
  template <typename T>
  const float* at(const PagedRows<T>& rows, int64_t b, int64_t h, int64_t r) const {
    const int64_t page = rows.block_table[b * rows.table_width + rows.page_of(r)];
    return scales_ + page * page_stride_ + h * head_stride_ + rows.row_in_page(r) * row_stride_;
  }
  int64_t row_stride() const { return row_stride_; }
  // Whether a page's last scale and the next page's first lie row_stride() apart, as their rows
  // may (PagedRows::pages_continue): a (num_pages, page_size, heads) tensor's, or one per tensor.
  bool rows_continue_across_pages(int64_t page_size) const {
    return page_stride_ == page_size * row_stride_;
  }

 private:
  static constexpr float kOne = 1.0f;
  const float* scales_ = &kOne;
  int64_t page_stride_ = 0, head_stride_ = 0, row_stride_ = 0;
};

// Scales of successive rows: row i's is first[i * stride] * factor.
struct RowScales {
  const float* first;
  int64_t stride;
  float factor;
};

// An 8-bit paged cache's rows as the decode reads them: in place, element_t
// (c10::Float8_e4m3fn, c10::Float8_e5m2 or int8_t) as PagedRows finds them, each with its scale.
template <typename element_t>
struct ScaledPagedRows : PagedRows<const element_t> {
  PageScales scales;

  ScaledPagedRows(const at::Tensor& cache, const at::Tensor& scale, const at::Tensor& table)
      : PagedRows<const element_t>(cache, table), scales(scale) {
    // a run's rows' scales must follow one another as its rows do
    this->pages_continue =
        this->pages_continue && scales.rows_continue_across_pages(this->page_size);
  }

  // The scales of rows r, r + 1, ... of (b, h) up to the end of r's run (run_end): stored value
  // x scale = element.
  RowScales scales_from(int64_t b, int64_t h, int64_t r) const {
    return {scales.at(*this, b, h, r), scales.row_stride(), kFactor};
  }
  // E4M3Over256 reads a value / 256 (eight_bit_values.h): its scales are 256 times the cache's.
  static constexpr float kFactor = std::is_same_v<element_t, E4M3Over256> ? 256.0f : 1.0f;
};

// The rows of an 8-bit paged cache viewed as (num_pages, heads, page_size, col), found as
// PagedRows finds them, read by widening a block of them at a time into float32 rows with their
// scales (PageScales). Its bytes are uint8_t; their format is read from the cache's dtype.
struct QuantizedPagedRows {
  using stored_t = uint8_t;
  PagedRows<const stored_t> rows;
  PageScales scales;
  EightBit format;

  QuantizedPagedRows(const at::Tensor& cache, const at::Tensor& scale, const at::Tensor& table)
      : rows(cache, table), scales(scale), format(eight_bit_format(cache.scalar_type())) {}

  // Rows [r, r + count) of (b, h), each `width` values times its scale into dst, rows ld apart.
  void widen(int64_t b, int64_t h, int64_t r, int64_t count, int64_t width, float* dst,
             int64_t ld) const {
    with_element_type([&](auto type) {
      using element_t = std::remove_const_t<std::remove_pointer_t<decltype(type)>>;
      for (int64_t k = r; k < r + count; ++k) {
        widen_scaled(row_as<element_t>(b, h, k), width, *scales.at(rows, b, h, k),
                     dst + (k - r) * ld);
      }
    });
  }

  // The products read float32 rows widened into the packed blocks (packed_kv.h).
  using row_t = float;
  static constexpr bool kWidens = true;
  static constexpr bool kInterleavedHeads = PagedRows<const stored_t>::kInterleavedHeads;
  static constexpr bool kOneRun = false;

 private:
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
};

}  // namespace causal_attention::cpu::CPU_CAPABILITY
