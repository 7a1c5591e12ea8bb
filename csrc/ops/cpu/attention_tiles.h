// What the CPU forward and backward kernels share: the problem's geometry after flattening the
// leading dims, strided (batch, head, row) views, tile loads into the accumulation type, and the
// order in which tasks take blocks.
#pragma once

#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

namespace causal_attention::cpu {

// Rows of queries and keys per block. 64x64 float32 score tiles (16 KiB) and the K/V tiles for
// D <= 128 stay within L1/L2 together with the running output block.
constexpr int64_t kQueryBlock = 64;
constexpr int64_t kKeyBlock = 64;

struct AttentionDims {
  int64_t batch;  // product of the leading dims
  int64_t heads_q;
  int64_t heads_kv;
  int64_t len_q;
  int64_t len_k;
  int64_t head_dim;
  int64_t value_dim;

  int64_t group() const { return heads_q / heads_kv; }
  // Bottom-right alignment: query row r sees keys 0 .. r + (len_k - len_q).
  int64_t visible_keys(int64_t row) const {
    return std::clamp<int64_t>(row + (len_k - len_q) + 1, 0, len_k);
  }
  // The first query row that sees key `key`.
  int64_t first_row_seeing(int64_t key) const {
    return std::max<int64_t>(key - (len_k - len_q), 0);
  }
};

inline int64_t ceil_div(int64_t a, int64_t b) {
  return (a + b - 1) / b;
}

// (..., H, L, D) or (L, D) as a 4-D (batch, H, L, D) tensor with unit stride along D. A view
// whenever the leading dims can be merged (the transposed (B, L, H, D) layout included).
inline at::Tensor as_batch_heads_rows(const at::Tensor& t) {
  at::Tensor t4;
  if (t.dim() == 2) {
    t4 = t.unsqueeze(0).unsqueeze(0);
  } else if (t.dim() == 3) {
    t4 = t.unsqueeze(0);
  } else {
    int64_t batch = 1;
    for (int64_t d = 0; d + 3 < t.dim(); ++d) {
      batch *= t.size(d);
    }
    t4 = t.reshape({batch, t.size(-3), t.size(-2), t.size(-1)});
  }
  if (t4.stride(3) != 1 && t4.size(3) > 1) {
    t4 = t4.contiguous();
  }
  return t4;
}

inline AttentionDims dims_of(const at::Tensor& q4, const at::Tensor& k4, const at::Tensor& v4) {
  return {q4.size(0), q4.size(1), k4.size(1), q4.size(2), k4.size(2), q4.size(3), v4.size(3)};
}

// Row pointers into a (batch, head, row, col) tensor with unit stride along col.
template <typename T>
struct HeadRows {
  T* data;
  int64_t batch_stride;
  int64_t head_stride;
  int64_t row_stride;

  explicit HeadRows(const at::Tensor& t4)
      : data(static_cast<T*>(t4.data_ptr())),
        batch_stride(t4.stride(0)),
        head_stride(t4.stride(1)),
        row_stride(t4.stride(2)) {}

  T* row(int64_t b, int64_t h, int64_t r) const {
    return data + b * batch_stride + h * head_stride + r * row_stride;
  }
};

// Rows [0, rows) x cols [0, cols) of `src` as acc_t: the tensor memory itself when the types
// match, else a converted copy in `scratch`. `*ld_out` receives the leading dimension to use.
template <typename acc_t, typename scalar_t>
const acc_t* rows_as(const scalar_t* src, int64_t rows, int64_t cols, int64_t ld, acc_t* scratch,
                     int64_t* ld_out) {
  if constexpr (std::is_same_v<acc_t, scalar_t>) {
    *ld_out = ld;
    return src;
  } else {
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t c = 0; c < cols; ++c) {
        scratch[r * cols + c] = static_cast<acc_t>(src[r * ld + c]);
      }
    }
    *ld_out = cols;
    return scratch;
  }
}

// dst[c * rows + r] = src[r * ld + c]: the (cols x rows) transpose as acc_t, leading dim rows.
template <typename acc_t, typename scalar_t>
void transpose_as(const scalar_t* src, int64_t rows, int64_t cols, int64_t ld, acc_t* dst) {
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      dst[c * rows + r] = static_cast<acc_t>(src[r * ld + c]);
    }
  }
}

// dst rows = multiplier * src rows, converted to the output dtype.
template <typename scalar_t, typename acc_t>
void store_rows(const acc_t* src, int64_t rows, int64_t cols, int64_t ld_src, acc_t multiplier,
                scalar_t* dst, int64_t ld_dst) {
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      dst[r * ld_dst + c] = static_cast<scalar_t>(src[r * ld_src + c] * multiplier);
    }
  }
}

// Causal blocks differ in cost (the last query block sees every key, the first only a few). Tasks
// take a contiguous range of work items, so items are ordered 0, n-1, 1, n-2, ... within each
// head: any contiguous range then mixes cheap and expensive blocks. Only the order of work items
// changes, never the order of the sums inside one, so results do not depend on the split.
inline int64_t balanced_block(int64_t position, int64_t num_blocks) {
  return position % 2 == 0 ? position / 2 : num_blocks - 1 - position / 2;
}

}  // namespace causal_attention::cpu
