// Operands of the block products: how a block of rows reaches block_gemm for operand type gemm_t
// (the type the micro-kernel multiplies). float32 and float64 row-major, used in place when the
// source already has that type; bfloat16 and float16 (native products) with B in VNNI layout
// (pairs of consecutive k interleaved) and the reduction dim K padded to even with zeros. Every
// packing function returns the operand it made: a pointer and a leading dimension.
#pragma once

#include "../block_gemm.h"
#include "row_ops.h"

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

namespace causal_attention::cpu::CPU_CAPABILITY {

// A row-major block: element (r, c) at data[r * ld + c] (VNNI blocks: see block_gemm.h).
template <typename T>
struct Operand {
  const T* data;
  int64_t ld;
};

template <typename dst_t, typename src_t>
inline void convert_row(const src_t* src, dst_t* dst, int64_t n) {
  if constexpr (std::is_same_v<dst_t, src_t>) {
    std::memcpy(dst, src, n * sizeof(dst_t));
  } else {
    at::vec::convert(src, dst, n);
  }
}

// dst[j * ld_dst + i] = src[i * ld_src + j] for a rows x cols block of src, converting to dst_t.
// Same-type float blocks go through at::vec's register transposes (8x8 with AVX2, 16x16 with
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

template <typename gemm_t>
struct Packing {
  static constexpr bool kVnni =
      std::is_same_v<gemm_t, c10::BFloat16> || std::is_same_v<gemm_t, c10::Half>;

  static int64_t padded_k(int64_t k) { return kVnni ? k + (k & 1) : k; }
  // The columns from `first` of a B operand: row-major and VNNI alike (VNNI holds each column's
  // pair of k together), with the same leading dimension.
  static Operand<gemm_t> b_columns_from(Operand<gemm_t> b, int64_t first) {
    return {b.data + column_offset(first), b.ld};
  }
  // Where column `first` of a B operand starts, in elements from its first column's.
  static int64_t column_offset(int64_t first) { return (kVnni ? 2 : 1) * first; }
  // Scratch elements that any operand of at most `rows` x `cols` (either orientation) needs.
  static int64_t scratch_size(int64_t rows, int64_t cols) {
    return padded_k(rows + 1) * padded_k(cols + 1);
  }
  // Whether b() of a block of src_t rows needs scratch (else it reads the rows in place).
  template <typename src_t>
  static constexpr bool b_is_packed() {
    return kVnni || !std::is_same_v<src_t, gemm_t>;
  }

  // A = src (rows x k, leading dim ld).
  template <typename src_t>
  static Operand<gemm_t> a(const src_t* src, int64_t rows, int64_t k, int64_t ld, gemm_t* scratch) {
    const int64_t kp = padded_k(k);
    if constexpr (std::is_same_v<src_t, gemm_t>) {
      if (kp == k) {
        return {src, ld};
      }
    }
    for (int64_t r = 0; r < rows; ++r) {
      convert_row(src + r * ld, scratch + r * kp, k);
      std::fill(scratch + r * kp + k, scratch + (r + 1) * kp, gemm_t(0));
    }
    return {scratch, kp};
  }

  // A = src^T, where src is (k x rows) with leading dim ld.
  template <typename src_t>
  static Operand<gemm_t> a_transposed(const src_t* src, int64_t k, int64_t rows, int64_t ld,
                                      gemm_t* scratch) {
    const int64_t kp = padded_k(k);
    transpose_block(src, k, rows, ld, scratch, kp);
    if (kp != k) {
      for (int64_t r = 0; r < rows; ++r) {
        scratch[r * kp + k] = gemm_t(0);
      }
    }
    return {scratch, kp};
  }

  // B = src (k x n, leading dim ld).
  template <typename src_t>
  static Operand<gemm_t> b(const src_t* src, int64_t k, int64_t n, int64_t ld, gemm_t* scratch) {
    if constexpr (!b_is_packed<src_t>()) {
      return {src, ld};
    } else if constexpr (kVnni) {
      for (int64_t p = 0; p < k / 2; ++p) {
        interleave_pair(src + 2 * p * ld, src + (2 * p + 1) * ld, n, scratch + 2 * p * n);
      }
      if (k & 1) {
        interleave_pair<src_t>(src + (k - 1) * ld, nullptr, n, scratch + (k - 1) * n);
      }
      return {scratch, n};
    } else {
      for (int64_t i = 0; i < k; ++i) {
        convert_row(src + i * ld, scratch + i * n, n);
      }
      return {scratch, n};
    }
  }

  // B = the k x n rows of src (leading dim ld), each value as a whole VNNI pair (v, v): the
  // operand that multiplies the (hi, lo) pairs of split_into_pairs, pair i of each column being
  // row i of src twice, so that the product sums hi v + lo v over the k rows.
  static Operand<gemm_t> b_value_pairs(const gemm_t* src, int64_t k, int64_t n, int64_t ld,
                                       gemm_t* scratch) {
    static_assert(kVnni, "value pairs are VNNI operands");
    for (int64_t i = 0; i < k; ++i) {
      const gemm_t* row = src + i * ld;
      gemm_t* pairs = scratch + i * n * 2;
      for (int64_t j = 0; j < n; ++j) {
        const uint32_t word = uint32_t(row[j].x) * 0x10001u;  // the value in both halves
        std::memcpy(pairs + 2 * j, &word, sizeof(word));
      }
    }
    return {scratch, n};
  }

  // A = the transpose of n x width 32-bit words (pairs of values, leading dim 2 width): width
  // rows of n pairs. With the value pairs of n rows (b_value_pairs), the A of rows^T F against
  // the (hi, lo) pairs of F held as a VNNI B (dV^T += dO^T P, dK^T += Q^T dS).
  static Operand<gemm_t> a_transposed_words(const gemm_t* words, int64_t n, int64_t width,
                                            gemm_t* scratch) {
    static_assert(kVnni, "value pairs are VNNI operands");
    transpose_pairs(words, n, width, 2 * width, scratch, n);
    return {scratch, 2 * n};
  }

  // B = src^T, where src is (n x k) with leading dim ld: K_j^T from the rows of K. The operand
  // has leading dim ld_b (n where not given): a block packed from several runs of rows takes
  // each run's columns at b_columns_from of the same operand.
  template <typename src_t>
  static Operand<gemm_t> b_transposed(const src_t* src, int64_t n, int64_t k, int64_t ld,
                                      gemm_t* scratch, int64_t ld_b = 0) {
    ld_b = ld_b > 0 ? ld_b : n;
    if constexpr (kVnni) {
      // VNNI pairs are consecutive along k, i.e. along a row of src: one 32-bit word each.
      static_assert(std::is_same_v<src_t, gemm_t>,
                    "VNNI operands come from rows of their own dtype");
      const int64_t pairs = k / 2;
      transpose_pairs(src, n, pairs, ld, scratch, ld_b);
      for (int64_t j = 0; j < n; ++j) {
        const src_t* row = src + j * ld;
        if (k & 1) {
          scratch[(pairs * ld_b + j) * 2] = row[k - 1];
          scratch[(pairs * ld_b + j) * 2 + 1] = gemm_t(0);
        }
      }
    } else {
      transpose_block(src, n, k, ld, scratch, ld_b);
    }
    return {scratch, ld_b};
  }

 private:
  // dst[(p * ld_dst + j) * 2 + i] = src[j * ld + 2 * p + i] for p < pairs, j < n: the
  // transpose of the n x pairs matrix of 32-bit words (pairs of 16-bit values) that the rows of
  // src hold. Whole tiles go through at::vec's register transposes of float (pure moves: the
  // bits are kept) where the rows are 32-bit aligned, the rest word by word.
  static void transpose_pairs(const gemm_t* src, int64_t n, int64_t pairs, int64_t ld, gemm_t* dst,
                              int64_t ld_dst) {
#if defined(CPU_CAPABILITY_AVX512)
    constexpr int64_t kTile = 16;
#else
    constexpr int64_t kTile = 8;
#endif
    const bool aligned = ld % 2 == 0 && reinterpret_cast<uintptr_t>(src) % 4 == 0 &&
                         reinterpret_cast<uintptr_t>(dst) % 4 == 0;
    int64_t full_rows = 0, full_pairs = 0;
    if (aligned) {
      full_rows = n / kTile * kTile;
      full_pairs = pairs / kTile * kTile;
      const auto* words = reinterpret_cast<const float*>(src);
      auto* out = reinterpret_cast<float*>(dst);
      for (int64_t j = 0; j < full_rows; j += kTile) {
        for (int64_t p = 0; p < full_pairs; p += kTile) {
          at::vec::transpose_mxn<float, kTile, kTile>(words + j * (ld / 2) + p, ld / 2,
                                                      out + p * ld_dst + j, ld_dst);
        }
      }
    }
    for (int64_t j = 0; j < n; ++j) {
      for (int64_t p = j < full_rows ? full_pairs : 0; p < pairs; ++p) {
        std::memcpy(dst + (p * ld_dst + j) * 2, src + j * ld + 2 * p, 2 * sizeof(gemm_t));
      }
    }
  }

  // out[2 * j + i] = row i (even, then odd; a missing odd row is zeros) at column j.
  template <typename src_t>
  static void interleave_pair(const src_t* even, const src_t* odd, int64_t n, gemm_t* out) {
    for (int64_t j = 0; j < n; ++j) {
      out[2 * j] = static_cast<gemm_t>(even[j]);
      out[2 * j + 1] = odd != nullptr ? static_cast<gemm_t>(odd[j]) : gemm_t(0);
    }
  }
};

// x rounded to bfloat16's 8 significant bits, to nearest even, as a float32: c10's rounding for
// any x but a NaN (whose low bits it may carry into the exponent), without c10's NaN test, which
// BFloat16Pair makes once for both of its halves.
inline float rounded_to_bfloat16(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  bits = (bits + 0x7FFFu + ((bits >> 16) & 1u)) & 0xFFFF0000u;
  float rounded;
  std::memcpy(&rounded, &bits, sizeof(rounded));
  return rounded;
}

// A float32 value x as two bfloat16 values: hi = x rounded to nearest even, and lo = x - hi
// (exact in float32) rounded likewise. hi + lo carries 16 of x's 24 significant bits (a relative
// error below 2^-16, against bfloat16's 2^-8 for x alone), and their products with a bfloat16
// value are exact in float32: a product of P or dS by bfloat16 rows as one bfloat16 product, A's
// pairs (hi, lo) against B's (v, v) (Packing::b_value_pairs), keeps float32-grade P and dS at the
// speed of the chip's bfloat16 products (the split issue 38 names: on AMX tiles a bfloat16
// product with twice the reduction takes 0.6-0.85 of the float32 one's time). Where x - hi is not
// finite (x an inf or NaN, as a poisoned row's dS may be, or beyond bfloat16's range) hi is x's
// inf or a NaN, and lo 0: hi v + lo v is then x v, not the NaN that inf - inf would make of it.
struct BFloat16Pair {
  float hi, lo;  // bfloat16 values

  // Selects, not branches: the loops over a row's pairs stay vectorized.
  explicit BFloat16Pair(float x) : hi(rounded_to_bfloat16(x)), lo(rounded_to_bfloat16(x - hi)) {
    hi = std::isnan(x) ? std::numeric_limits<float>::quiet_NaN() : hi;
    lo = std::isfinite(lo) ? lo : 0.f;
  }
  float value() const { return hi + lo; }
  // hi's bits in the low half, lo's in the high half (the pair's order in memory on x86).
  uint32_t word() const {
    uint32_t hi_bits, lo_bits;
    std::memcpy(&hi_bits, &hi, sizeof(hi_bits));
    std::memcpy(&lo_bits, &lo, sizeof(lo_bits));
    return hi_bits >> 16 | lo_bits;
  }
};

// pairs[2 c], pairs[2 c + 1] = the (hi, lo) of x[c], for c < n. Each pair is stored as one
// 32-bit word, which the compiler vectorizes without the permutes that two 16-bit stores cost.
inline void split_into_pairs(const float* x, int64_t n, c10::BFloat16* pairs) {
  for (int64_t c = 0; c < n; ++c) {
    const uint32_t word = BFloat16Pair(x[c]).word();
    std::memcpy(pairs + 2 * c, &word, sizeof(word));
  }
}

// x[c] = hi + lo of x[c], for c < n: the values the pairs carry, multiplied in float32 where the
// chip has no native bfloat16 products (the same values, up to the order of the float32 sums:
// hi + lo is exact in float32).
inline void round_to_pairs(float* x, int64_t n) {
  for (int64_t c = 0; c < n; ++c) {
    x[c] = BFloat16Pair(x[c]).value();
  }
}

// C[M, N] (= or +=) A[M, K] * B[K, N], K padded as the operands were.
template <typename gemm_t, typename acc_t>
inline void multiply(int64_t M, int64_t N, int64_t K, Operand<gemm_t> a, Operand<gemm_t> b,
                     acc_t* c, int64_t ldc, bool accumulate) {
  block_gemm(M, N, Packing<gemm_t>::padded_k(K), a.data, a.ld, b.data, b.ld, c, ldc, accumulate);
}

// C[M, N] = A[M, K] * B[K, N] summed in chains of at most `chain` (even) k, each chain a product
// of its own (into `partial`, M x N) added to C in order, but for the last one: that is left in
// `partial` where the return says so (K longer than one chain), for the caller to add to each row
// of C as it next reads it. The forward's fold adds it a row at a time while the row is in L1:
// a pass of its own over a block of C and partial came from L2 (128 x 256 scores on AMX) and
// took 7 % of a bfloat16 forward (L 2048, D 128). The micro-kernel sums along K in one chain of
// fused multiply-adds, whose rounding error grows with its length: with K = 128 its scores
// measured twice the error of a blocked GEMM's, which a peaked softmax turns into twice the error
// of its P, and so of every gradient. Row-major and VNNI B alike hold k0 (even) at row k0 * ld.
template <typename gemm_t, typename acc_t>
inline bool multiply_in_chains_but_last(int64_t M, int64_t N, int64_t K, Operand<gemm_t> a,
                                        Operand<gemm_t> b, acc_t* c, int64_t ldc, int64_t chain,
                                        acc_t* partial) {
  const int64_t padded = Packing<gemm_t>::padded_k(K);
  block_gemm(M, N, std::min(padded, chain), a.data, a.ld, b.data, b.ld, c, ldc,
             /*accumulate=*/false);
  for (int64_t k0 = chain; k0 < padded; k0 += chain) {
    if (k0 > chain) {  // the chain before this one
      for (int64_t i = 0; i < M; ++i) {
        add_row(c + i * ldc, partial + i * N, N);
      }
    }
    block_gemm(M, N, std::min(chain, padded - k0), a.data + k0, a.ld, b.data + k0 * b.ld, b.ld,
               partial, N, /*accumulate=*/false);
  }
  return padded > chain;
}

// C[M, N] = A[M, K] * B[K, N] summed in chains, every chain added (multiply_in_chains_but_last).
template <typename gemm_t, typename acc_t>
inline void multiply_in_chains(int64_t M, int64_t N, int64_t K, Operand<gemm_t> a,
                               Operand<gemm_t> b, acc_t* c, int64_t ldc, int64_t chain,
                               acc_t* partial) {
  if (multiply_in_chains_but_last(M, N, K, a, b, c, ldc, chain, partial)) {
    for (int64_t i = 0; i < M; ++i) {
      add_row(c + i * ldc, partial + i * N, N);
    }
  }
}

}  // namespace causal_attention::cpu::CPU_CAPABILITY
