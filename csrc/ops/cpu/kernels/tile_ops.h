// What the forward and backward kernels share: the problem's geometry, strided row access,
// packing of block operands for block_gemm, and vectorized row operations of the softmax.
//
// Included only by the per-instruction-set kernel sources: everything here lives in the
// namespace named by CPU_CAPABILITY, so that inline code compiled with AVX-512 flags is never
// merged by the linker with its AVX2 or baseline twin.
#pragma once

#include "../block_gemm.h"

#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace causal_attention::cpu::CPU_CAPABILITY {

// Rows of queries and keys per block: a 64 x 64 float32 score tile is 16 KiB, and with the
// K/V blocks of D <= 128 it stays in L1/L2 beside the running output block.
constexpr int64_t kQueryBlock = 64;
constexpr int64_t kKeyBlock = 64;

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

// Runs Kernel<scalar_t, gemm_t>(tensors).run() for the inputs' dtype, with the operand type the
// micro-kernel multiplies best on this CPU: bfloat16 itself where the bfloat16 micro-kernel
// runs (AVX-512 builds only), else the accumulation type.
template <template <typename, typename> class Kernel, typename Tensors>
void run_for_dtype(const Tensors& tensors) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, tensors.q.scalar_type(),
                                  "causal_attention_cpu", [&] {
                                    using acc_t = at::opmath_type<scalar_t>;
#if defined(CPU_CAPABILITY_AVX512)
                                    if constexpr (std::is_same_v<scalar_t, at::BFloat16>) {
                                      if (bf16_block_gemm_available()) {
                                        Kernel<scalar_t, at::BFloat16>(tensors).run();
                                        return;
                                      }
                                    }
#endif
                                    Kernel<scalar_t, acc_t>(tensors).run();
                                  });
}

// Causal blocks differ in cost (the last query block sees every key, the first only a few).
// Tasks take contiguous ranges of work items, so items are ordered 0, n-1, 1, n-2, ... within
// each head: any contiguous range then mixes cheap and expensive blocks. Only the order of the
// work items changes, never the order of the sums inside one, so results do not depend on the
// split between threads.
inline int64_t balanced_block(int64_t position, int64_t num_blocks) {
  return position % 2 == 0 ? position / 2 : num_blocks - 1 - position / 2;
}

// Calls fn(head, block, scratch) for every block of every head, in parallel tasks that take
// contiguous ranges of the balanced order; each task owns one Scratch made by make_scratch().
template <typename MakeScratch, typename Fn>
void for_each_head_block(int64_t num_heads, int64_t num_blocks, const MakeScratch& make_scratch,
                         const Fn& fn) {
  at::parallel_for(0, num_heads * num_blocks, 1, [&](int64_t begin, int64_t end) {
    auto scratch = make_scratch();
    for (int64_t item = begin; item < end; ++item) {
      fn(item / num_blocks, balanced_block(item % num_blocks, num_blocks), scratch);
    }
    block_gemm_release();
  });
}

template <typename dst_t, typename src_t>
inline void convert_row(const src_t* src, dst_t* dst, int64_t n) {
  if constexpr (std::is_same_v<dst_t, src_t>) {
    std::memcpy(dst, src, n * sizeof(dst_t));
  } else {
    at::vec::convert(src, dst, n);
  }
}

// dst[j * ld_dst + i] = src[i * ld_src + j] for a rows x cols block of src, converting to dst_t.
// Same-type blocks go through at::vec's register transposes (8x8 with AVX2, 16x16 with
// AVX-512): the kernels transpose a block for nearly every block product, so this matters.
template <typename dst_t, typename src_t>
inline void transpose_block(const src_t* src, int64_t rows, int64_t cols, int64_t ld_src,
                            dst_t* dst, int64_t ld_dst) {
  int64_t full_rows = 0, full_cols = 0;
  if constexpr (std::is_same_v<dst_t, src_t> && std::is_same_v<src_t, float>) {
#if defined(CPU_CAPABILITY_AVX512)
    constexpr int64_t kTile = 16;
#else
    constexpr int64_t kTile = 8;
#endif
    full_rows = rows / kTile * kTile;
    full_cols = cols / kTile * kTile;
    for (int64_t i = 0; i < full_rows; i += kTile) {
      for (int64_t j = 0; j < full_cols; j += kTile) {
        at::vec::transpose_mxn<float, kTile, kTile>(src + i * ld_src + j, ld_src,
                                                    dst + j * ld_dst + i, ld_dst);
      }
    }
  }
  // The edges the register transposes did not cover: columns past full_cols of the tiled rows,
  // and every row past full_rows.
  for (int64_t i = 0; i < rows; ++i) {
    for (int64_t j = i < full_rows ? full_cols : 0; j < cols; ++j) {
      dst[j * ld_dst + i] = static_cast<dst_t>(src[i * ld_src + j]);
    }
  }
}

// How block operands reach block_gemm for operand type gemm_t (the type the micro-kernel
// multiplies): float32 and float64 row-major, used in place when the source already has that
// type; bfloat16 with B in VNNI layout and the reduction dim K padded to even with zeros.
template <typename gemm_t>
struct Operands {
  static constexpr bool kVnni = std::is_same_v<gemm_t, c10::BFloat16>;

  static int64_t padded_k(int64_t k) { return kVnni ? k + (k & 1) : k; }
  // Scratch elements that any operand of at most `rows` x `cols` (either orientation) needs.
  static int64_t scratch_size(int64_t rows, int64_t cols) {
    return padded_k(rows + 1) * padded_k(cols + 1);
  }

  // A = src (rows x k, leading dim ld).
  template <typename src_t>
  static const gemm_t* a(const src_t* src, int64_t rows, int64_t k, int64_t ld, gemm_t* scratch,
                         int64_t* ld_out) {
    const int64_t kp = padded_k(k);
    if constexpr (std::is_same_v<src_t, gemm_t>) {
      if (kp == k) {
        *ld_out = ld;
        return src;
      }
    }
    for (int64_t r = 0; r < rows; ++r) {
      convert_row(src + r * ld, scratch + r * kp, k);
      std::fill(scratch + r * kp + k, scratch + (r + 1) * kp, gemm_t(0));
    }
    *ld_out = kp;
    return scratch;
  }

  // A = src^T, where src is (k x rows) with leading dim ld.
  template <typename src_t>
  static const gemm_t* a_transposed(const src_t* src, int64_t k, int64_t rows, int64_t ld,
                                    gemm_t* scratch, int64_t* ld_out) {
    const int64_t kp = padded_k(k);
    transpose_block(src, k, rows, ld, scratch, kp);
    if (kp != k) {
      for (int64_t r = 0; r < rows; ++r) {
        scratch[r * kp + k] = gemm_t(0);
      }
    }
    *ld_out = kp;
    return scratch;
  }

  // B = src (k x n, leading dim ld).
  template <typename src_t>
  static const gemm_t* b(const src_t* src, int64_t k, int64_t n, int64_t ld, gemm_t* scratch,
                         int64_t* ld_out) {
    *ld_out = n;
    if constexpr (kVnni) {
      for (int64_t p = 0; p < k / 2; ++p) {
        const src_t* even = src + 2 * p * ld;
        const src_t* odd = even + ld;
        gemm_t* out = scratch + 2 * p * n;
        for (int64_t j = 0; j < n; ++j) {
          out[2 * j] = static_cast<gemm_t>(even[j]);
          out[2 * j + 1] = static_cast<gemm_t>(odd[j]);
        }
      }
      if (k & 1) {
        const src_t* last = src + (k - 1) * ld;
        gemm_t* out = scratch + (k - 1) * n;
        for (int64_t j = 0; j < n; ++j) {
          out[2 * j] = static_cast<gemm_t>(last[j]);
          out[2 * j + 1] = gemm_t(0);
        }
      }
      return scratch;
    } else {
      if constexpr (std::is_same_v<src_t, gemm_t>) {
        *ld_out = ld;
        return src;
      }
      for (int64_t i = 0; i < k; ++i) {
        convert_row(src + i * ld, scratch + i * n, n);
      }
      return scratch;
    }
  }

  // B = src^T, where src is (n x k) with leading dim ld: K_j^T from the rows of K.
  template <typename src_t>
  static const gemm_t* b_transposed(const src_t* src, int64_t n, int64_t k, int64_t ld,
                                    gemm_t* scratch, int64_t* ld_out) {
    *ld_out = n;
    if constexpr (kVnni) {
      // VNNI pairs are consecutive along k, i.e. along a row of src: one 32-bit word each.
      static_assert(std::is_same_v<src_t, gemm_t>, "VNNI operands come from bfloat16 rows");
      const int64_t pairs = k / 2;
      for (int64_t j = 0; j < n; ++j) {
        const src_t* row = src + j * ld;
        for (int64_t p = 0; p < pairs; ++p) {
          std::memcpy(scratch + (p * n + j) * 2, row + 2 * p, 2 * sizeof(gemm_t));
        }
        if (k & 1) {
          scratch[(pairs * n + j) * 2] = row[k - 1];
          scratch[(pairs * n + j) * 2 + 1] = gemm_t(0);
        }
      }
    } else {
      transpose_block(src, n, k, ld, scratch, n);
    }
    return scratch;
  }
};

// exp that keeps NaN (exp_u20 clamps its input first, which would turn a NaN score into a
// finite probability and hide a poisoned row).
// Keeps a non-finite key, value, query or output gradient inside the rows the causal mask lets
// it reach. In a block pair that straddles the diagonal, the A operand of a block product (P, dS
// or their transposes) holds exact zeros where the mask hides an entry, and 0 * inf or 0 * NaN
// from a B row would spread that row's inf or NaN to rows (or keys) that cannot see it. So when
// such a B block has non-finite rows, the micro-kernel gets a copy with those rows zeroed, and
// their contributions are added back only where the mask allows. Finite blocks, and block
// pairs with no masked entry, take the plain path; the zeroed copy changes no finite sum, so the
// rows the mask protects get bitwise the results they get without the non-finite values.
template <typename scalar_t>
class NonFiniteRowGuard {
 public:
  // The B source to pack: `src` itself, or a copy without its non-finite rows when the pair
  // `has_masked_entries`. `*ld_out` receives its leading dimension.
  const scalar_t* prepare(bool has_masked_entries, const scalar_t* src, int64_t n_rows,
                          int64_t width, int64_t ld, int64_t* ld_out) {
    bad_rows_.clear();
    *ld_out = ld;
    if (!has_masked_entries) {
      return src;
    }
    for (int64_t i = 0; i < n_rows; ++i) {
      const scalar_t* row = src + i * ld;
      if (!std::all_of(row, row + width, [](scalar_t x) { return std::isfinite(float(x)); })) {
        bad_rows_.push_back(i);
      }
    }
    if (bad_rows_.empty()) {
      return src;
    }
    cleaned_.resize(n_rows * width);
    for (int64_t i = 0; i < n_rows; ++i) {
      std::copy_n(src + i * ld, width, cleaned_.data() + i * width);
    }
    for (int64_t i : bad_rows_) {
      std::fill_n(cleaned_.data() + i * width, width, scalar_t(0));
    }
    *ld_out = width;
    return cleaned_.data();
  }

  // After C[m, :] += A[m, k] * B[k, :] on the cleaned B: adds A[r, i] * B[i, :] for each
  // non-finite row i and each row r that sees it (i < visible[r]).
  template <typename acc_t>
  void add_back(const acc_t* a, int64_t lda, int64_t m, const scalar_t* src, int64_t ld,
                int64_t width, const int64_t* visible, acc_t* c, int64_t ldc) const {
    for (int64_t i : bad_rows_) {
      for (int64_t r = 0; r < m; ++r) {
        if (i < visible[r]) {
          axpy(a[r * lda + i], src + i * ld, width, c + r * ldc);
        }
      }
    }
  }

  // After C[k, :] += A^T[k, m] * B[m, :] on the cleaned B, with A (m x k) given untransposed:
  // adds A[i, j] * B[i, :] to row j of C for each non-finite row i and each j < visible[i].
  template <typename acc_t>
  void add_back_transposed(const acc_t* a, int64_t lda, const scalar_t* src, int64_t ld,
                           int64_t width, const int64_t* visible, acc_t* c, int64_t ldc) const {
    for (int64_t i : bad_rows_) {
      for (int64_t j = 0; j < visible[i]; ++j) {
        axpy(a[i * lda + j], src + i * ld, width, c + j * ldc);
      }
    }
  }

 private:
  template <typename acc_t>
  static void axpy(acc_t alpha, const scalar_t* x, int64_t n, acc_t* y) {
    for (int64_t d = 0; d < n; ++d) {
      y[d] += alpha * static_cast<acc_t>(x[d]);
    }
  }

  std::vector<int64_t> bad_rows_;
  std::vector<scalar_t> cleaned_;
};

template <typename acc_t>
inline at::vec::Vectorized<acc_t> vec_exp(const at::vec::Vectorized<acc_t>& x) {
  if constexpr (std::is_same_v<acc_t, float>) {
    // exp_u20: the accuracy torch's own CPU flash attention uses.
    return at::vec::Vectorized<float>::blendv(x.exp_u20(), x, x.isnan());
  } else {
    return x.exp();
  }
}

// row[c] *= scale for c < visible; returns the max of those (NaN if any is NaN, -inf if none).
template <typename acc_t>
inline acc_t scale_and_max(acc_t* row, int64_t visible, acc_t scale) {
  using Vec = at::vec::Vectorized<acc_t>;
  const Vec scale_vec(scale);
  Vec max_vec(-std::numeric_limits<acc_t>::infinity());
  int64_t c = 0;
  for (; c + Vec::size() <= visible; c += Vec::size()) {
    const Vec x = Vec::loadu(row + c) * scale_vec;
    x.store(row + c);
    max_vec = at::vec::maximum(max_vec, x);
  }
  acc_t result = at::vec::vec_reduce_all<acc_t>(
      [](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, max_vec);
  for (; c < visible; ++c) {
    row[c] *= scale;
    result = std::isnan(row[c]) ? row[c] : std::max(result, row[c]);
  }
  return result;
}

// row[c] = exp(row[c] * scale - shift) for c < visible, 0 for visible <= c < cols; returns the
// sum of the exponentials. (scale = 1, shift = row max in the forward; scale, shift = lse in the
// backward.)
template <typename acc_t>
inline acc_t exp_and_sum(acc_t* row, int64_t visible, int64_t cols, acc_t scale, acc_t shift) {
  using Vec = at::vec::Vectorized<acc_t>;
  const Vec scale_vec(scale), shift_vec(shift);
  Vec sum_vec(acc_t(0));
  int64_t c = 0;
  for (; c + Vec::size() <= visible; c += Vec::size()) {
    const Vec p = vec_exp(at::vec::fmsub(Vec::loadu(row + c), scale_vec, shift_vec));
    p.store(row + c);
    sum_vec = sum_vec + p;
  }
  if (c < visible) {
    const int64_t tail = visible - c;
    const Vec p = vec_exp(at::vec::fmsub(Vec::loadu(row + c, tail), scale_vec, shift_vec));
    p.store(row + c, tail);
    sum_vec = sum_vec + Vec::set(Vec(acc_t(0)), p, tail);
  }
  std::fill(row + visible, row + cols, acc_t(0));
  return at::vec::vec_reduce_all<acc_t>([](Vec& a, Vec& b) { return a + b; }, sum_vec);
}

// ds[c] = p[c] * (ds[c] - delta): the softmax gradient, given ds = dO V^T on entry.
template <typename acc_t>
inline void softmax_gradient(const acc_t* p, acc_t* ds, int64_t cols, acc_t delta) {
  using Vec = at::vec::Vectorized<acc_t>;
  const Vec delta_vec(delta);
  at::vec::map2<acc_t>([&](Vec pv, Vec dv) { return pv * (dv - delta_vec); }, ds, p, ds, cols);
}

// Sum of row[0, n).
template <typename acc_t>
inline acc_t row_sum(const acc_t* row, int64_t n) {
  using Vec = at::vec::Vectorized<acc_t>;
  return at::vec::reduce_all<acc_t>([](Vec& a, Vec& b) { return a + b; }, row, n);
}

// row[c] -= factor * other[c].
template <typename acc_t>
inline void subtract_scaled_row(acc_t* row, const acc_t* other, int64_t n, acc_t factor) {
  using Vec = at::vec::Vectorized<acc_t>;
  const Vec factor_vec(factor);
  at::vec::map2<acc_t>([&](Vec x, Vec y) { return x - y * factor_vec; }, row, row, other, n);
}

template <typename acc_t>
inline void scale_row(acc_t* row, int64_t n, acc_t factor) {
  using Vec = at::vec::Vectorized<acc_t>;
  const Vec factor_vec(factor);
  at::vec::map<acc_t>([&](Vec x) { return x * factor_vec; }, row, row, n);
}

// dst[c] = src[c] * factor, converted to the output dtype.
template <typename scalar_t, typename acc_t>
inline void store_scaled_row(const acc_t* src, int64_t n, acc_t factor, scalar_t* dst) {
  if constexpr (std::is_same_v<scalar_t, acc_t>) {
    using Vec = at::vec::Vectorized<acc_t>;
    const Vec factor_vec(factor);
    at::vec::map<acc_t>([&](Vec x) { return x * factor_vec; }, dst, src, n);
  } else {
    for (int64_t c = 0; c < n; ++c) {
      dst[c] = static_cast<scalar_t>(src[c] * factor);
    }
  }
}

// sum_c a[c] * b[c], accumulated in acc_t.
template <typename acc_t, typename scalar_t>
inline acc_t dot_row(const scalar_t* a, const scalar_t* b, int64_t n) {
  acc_t sum = 0;
  for (int64_t c = 0; c < n; ++c) {
    sum += static_cast<acc_t>(a[c]) * static_cast<acc_t>(b[c]);
  }
  return sum;
}

}  // namespace causal_attention::cpu::CPU_CAPABILITY
