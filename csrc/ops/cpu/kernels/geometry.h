// The problem's geometry: its sizes, strided row access to its tensors, and visibility, the one
// place that says which keys a query row sees. Block skipping, the masked entries of a block pair
// and the rows that reach a key block are all derived here; a mask (padding, windows, packed
// sequences) extends these functions and nothing else re-derives them.
//
// Included only by the per-instruction-set kernel sources: everything here lives in the
// namespace named by CPU_CAPABILITY, so that inline code compiled with AVX-512 flags is never
// merged by the linker with its AVX2 or baseline twin.
#pragma once

#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cstdint>

namespace causal_attention::cpu::CPU_CAPABILITY {

inline int64_t ceil_div(int64_t a, int64_t b) {
  return (a + b - 1) / b;
}

struct AttentionDims {
  int64_t batch;  // product of the leading dims
  int64_t heads_q;
  int64_t heads_kv;
  int64_t len_q;
  int64_t len_k;
  int64_t head_dim;
  int64_t value_dim;

  AttentionDims(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v)
      : batch(q.size(0)),
        heads_q(q.size(1)),
        heads_kv(k.size(1)),
        len_q(q.size(2)),
        len_k(k.size(2)),
        head_dim(q.size(3)),
        value_dim(v.size(3)) {}

  // Query heads per KV head: query head h reads KV head h / group().
  int64_t group() const { return heads_q / heads_kv; }

  // Visibility, causal and bottom-right aligned: query row `row` sees keys [0, key_end(row)),
  // i.e. key j iff j <= row + (len_k - len_q).
  int64_t key_end(int64_t row) const {
    return std::clamp<int64_t>(row + (len_k - len_q) + 1, 0, len_k);
  }
  // The first query row that sees key `key` (every later row sees it too).
  int64_t first_row_seeing(int64_t key) const {
    return std::max<int64_t>(key - (len_k - len_q), 0);
  }
  // How many of the `cols` keys from k0 on query row `row` sees (they are a prefix).
  int64_t visible_in_block(int64_t row, int64_t k0, int64_t cols) const {
    return std::clamp<int64_t>(key_end(row) - k0, 0, cols);
  }
  // Whether some row of [q0, q0 + rows) misses a key of [k0, k0 + cols): the block pair
  // straddles the boundary, so its products carry masked zeros. Causally the first row sees the
  // fewest keys, so it alone decides; a mask that hides keys from later rows needs `rows`.
  bool has_masked_entries(int64_t q0, int64_t rows, int64_t k0, int64_t cols) const {
    return visible_in_block(q0, k0, cols) < cols;
  }
};

// Row pointers into a (batch, head, row, col) tensor with unit stride along col.
template <typename T>
struct HeadRows {
  T* data;
  int64_t batch_stride;
  int64_t head_stride;
  int64_t row_stride;

  explicit HeadRows(const at::Tensor& t)
      : data(static_cast<T*>(t.data_ptr())),
        batch_stride(t.stride(0)),
        head_stride(t.stride(1)),
        row_stride(t.stride(2)) {}

  T* row(int64_t b, int64_t h, int64_t r) const {
    return data + b * batch_stride + h * head_stride + r * row_stride;
  }
};

}  // namespace causal_attention::cpu::CPU_CAPABILITY
