// The rows of the kernels' tensors: where row r of head h of batch item b lies, in a tensor
// (HeadRows) or in a paged KV cache through its block table (PagedRows). The kernels read K and V
// through either (a KeyRows source), never knowing which: both give row(), run_end() (where rows
// stop lying row_stride apart) and the layout traits kInterleavedHeads and kOneRun.
//
// Included only by the per-instruction-set kernel sources (see geometry.h).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <limits>
#include <type_traits>
#include <utility>

namespace causal_attention::cpu::CPU_CAPABILITY {

// Row pointers into a (batch, head, row, col) tensor with unit stride along col; for packed
// sequences, a (1, head, total rows, col) tensor whose batch item b starts at row offsets[b].
template <typename T>
struct HeadRows {
  T* data;
  int64_t batch_stride;
  int64_t head_stride;
  int64_t row_stride;
  const int32_t* offsets;

  explicit HeadRows(const at::Tensor& t, const int32_t* row_offsets = nullptr)
      : data(static_cast<T*>(t.data_ptr())),
        batch_stride(t.stride(0)),
        head_stride(t.stride(1)),
        row_stride(t.stride(2)),
        offsets(row_offsets) {}

  T* row(int64_t b, int64_t h, int64_t r) const {
    const int64_t first = offsets ? offsets[b] * row_stride : b * batch_stride;
    return data + first + h * head_stride + r * row_stride;
  }
  // The end of the run of rows of batch item b from row r that lie row_stride apart, looked for
  // up to `limit` at most: every row of (b, h) here.
  int64_t run_end(int64_t /*b*/, int64_t /*r*/, int64_t /*limit*/) const {
    return std::numeric_limits<int64_t>::max();
  }
  // Whether the heads' rows interleave in memory (decode.h reads them together where they do):
  // taken as not, the (batch, heads, rows) layouts' usual case.
  static constexpr bool kInterleavedHeads = false;
  // Whether every row of a (b, h) lies in one run, so that a block of rows may be read in place
  // at row_stride whatever its size (packed_kv.h).
  static constexpr bool kOneRun = true;
  // The products read these rows in place, in their own dtype (quantized_rows.h widens instead).
  using row_t = std::remove_const_t<T>;
  using stored_t = row_t;
  static constexpr bool kWidens = false;
};

// Row pointers into a paged KV cache viewed as (num_pages, heads, page_size, col) with unit stride
// along col: row r of batch item b is row r % page_size of page block_table[b][r / page_size].
// Rows lie row_stride apart within a page, and on into the next page where the block table's next
// entry is the page after in the pool (PagedKVCache lays a request's pages so where it can):
// what reads rows at that stride stops at run_end.
template <typename T>
struct PagedRows {
  T* data;
  int64_t page_stride;
  int64_t head_stride;
  int64_t row_stride;
  const int32_t* block_table;  // (batch, table_width), every page a row reads checked in range
  int64_t table_width;
  int64_t page_size;
  int page_shift;  // log2(page_size) where page_size is a power of two, else -1
  // Whether a page's last row and the next page's first lie row_stride apart: pages of contiguous
  // rows (page_stride = page_size * row_stride), as a (num_pages, page_size, heads, col) cache's.
  bool pages_continue;

  PagedRows(const at::Tensor& cache, const at::Tensor& table)
      : data(static_cast<T*>(cache.data_ptr())),
        page_stride(cache.stride(0)),
        head_stride(cache.stride(1)),
        row_stride(cache.stride(2)),
        block_table(table.data_ptr<int32_t>()),
        table_width(table.size(1)),
        page_size(cache.size(2)),
        page_shift(page_size > 0 && (page_size & (page_size - 1)) == 0
                       ? __builtin_ctzll(uint64_t(page_size))
                       : -1),
        pages_continue(page_stride == page_size * row_stride) {}

  T* row(int64_t b, int64_t h, int64_t r) const {
    const int64_t page = block_table[b * table_width + page_of(r)];
    return data + page * page_stride + row_in_page(r) * row_stride + h * head_stride;
  }
  // The end of r's page, or of the pages after it that follow it in the pool (pages_continue),
  // looked for up to `limit`. The decode's products and its requests for the next key block go
  // run by run: pages of 16 rows cut each of its 64-key blocks into four runs, and one run a block
  // made the in-cache decode of pages in order 0.92-0.95 of its time on a Zen 5 (docs/benchmarks,
  // "Pages in order read as one run").
  int64_t run_end(int64_t b, int64_t r, int64_t limit) const {
    int64_t page = page_of(r), end = (page + 1) * page_size;
    if (pages_continue) {
      const int32_t* pages = block_table + b * table_width;
      for (; end < limit && pages[page + 1] == pages[page] + 1; ++page) {
        end += page_size;
      }
    }
    return end;
  }
  // r / page_size and r % page_size (r >= 0): a shift and a mask for pages of a power of two rows
  // (16 and 64, the usual sizes), whose divisions, several a key block, were about 3 % of an
  // in-cache int8 decode's samples on a Zen 5.
  int64_t page_of(int64_t r) const { return page_shift >= 0 ? r >> page_shift : r / page_size; }
  int64_t row_in_page(int64_t r) const {
    return page_shift >= 0 ? r & (page_size - 1) : r % page_size;
  }
  // A page holds the rows of every head side by side: (page_size, heads, col) in flash-attn's
  // layout.
  static constexpr bool kInterleavedHeads = true;
  static constexpr bool kOneRun = false;
  using row_t = std::remove_const_t<T>;
  using stored_t = row_t;
  static constexpr bool kWidens = false;
};

// Whether a KeyRows source's rows come with scales (an 8-bit cache's, quantized_rows.h: stored
// value x scale = key or value, from scales_from(b, h, r)), which the products leave to their
// callers.
template <typename KeyRows, typename = void>
inline constexpr bool has_row_scales_v = false;
template <typename KeyRows>
inline constexpr bool has_row_scales_v<
    KeyRows, std::void_t<decltype(std::declval<const KeyRows&>().scales_from(0, 0, 0))>> = true;

}  // namespace causal_attention::cpu::CPU_CAPABILITY
