// Keeps a non-finite key, value, query or output gradient inside the rows the mask lets it
// reach. In a block pair that straddles the visibility boundary, the A operand of a block product
// (P, dS or their transposes) holds exact zeros where the mask hides an entry, and 0 * inf or
// 0 * NaN from a B row would spread that row's inf or NaN to rows (or keys) that cannot see it.
// So when such a B block has non-finite rows, the micro-kernel gets a copy with those rows
// zeroed, and their contributions are added back only where the mask allows. Finite blocks, and
// block pairs with no masked entry, take the plain path; the zeroed copy changes no finite sum,
// so the rows the mask protects get bitwise the results they get without the non-finite values.
#pragma once

#include "attn_mask_view.h"
#include "operands.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace causal_attention::cpu::CPU_CAPABILITY {

// The A operand of a guarded product as the kernel holds it, untransposed: values[r * ld + c],
// where row r sees columns [first[r], visible[r]), less the columns c with kept[c] false where
// `kept` (the key mask of the block) is not null and those that row r's attn_mask hides where
// `mask_rows` (one per row) is not null. With `transposed`, the guarded rows meet the rows r
// of `values` and the product is c (width x cols) += rows^T values, a row's contribution landing
// in the columns of c (dV^T += dO^T P, dK^T += Q^T dS); else they meet its columns c and the
// product is c (rows x width) += values rows (O += P V, dQ += dS K).
template <typename acc_t>
struct MaskedFactor {
  const acc_t* values;
  int64_t ld;
  const int64_t* first;
  const int64_t* visible;
  bool transposed;
  const bool* kept;
  const MaskRow<acc_t>* mask_rows = nullptr;

  bool sees(int64_t r, int64_t c) const {
    return c >= first[r] && c < visible[r] && (!kept || kept[c]) &&
           (!mask_rows || !mask_rows[r].hides(c));
  }
};

// Whether row[0, n) holds no inf or NaN. For the 16-, 32- and 64-bit float types, from the
// exponent bits (all ones: inf or NaN) with an integer max and no early exit, which the compiler
// vectorizes: the guard asks this of every B row of every block pair with masked entries (each
// diagonal block), where a loop of std::isfinite took a few percent of a forward's time. 8-bit
// cache rows (rarely guarded: the decode's masked blocks) keep their conversions.
template <typename T>
inline bool all_finite(const T* row, int64_t n) {
  if constexpr (sizeof(T) == 1) {
    return std::all_of(row, row + n, [](T x) { return std::isfinite(float(x)); });
  } else {
    using Bits = std::conditional_t<sizeof(T) == 2, uint16_t,
                                    std::conditional_t<sizeof(T) == 4, uint32_t, uint64_t>>;
    static_assert(sizeof(T) == sizeof(Bits), "a 16-, 32- or 64-bit floating-point type");
    constexpr Bits exponent = std::is_same_v<T, c10::Half> ? Bits(0x7C00)
                              : sizeof(T) == 2             ? Bits(0x7F80)
                              : sizeof(T) == 4             ? Bits(0x7F800000u)
                                                           : Bits(0x7FF0000000000000ull);
    // bits & exponent reaches exponent only for inf and NaN: a max reduction (vectorized).
    Bits highest = 0;
    for (int64_t i = 0; i < n; ++i) {
      Bits bits;
      std::memcpy(&bits, row + i, sizeof(Bits));
      highest = std::max<Bits>(highest, bits & exponent);
    }
    return highest != exponent;
  }
}

template <typename scalar_t>
class NonFiniteRowGuard {
 public:
  // c[M, N] += a[M, K] * B, B made by pack_b(source rows) from the K x N rows b_rows: the rows
  // themselves, or (in a pair with masked entries and non-finite rows) a copy without those
  // rows, whose contributions are then added back where `factor` says they are visible.
  template <typename gemm_t, typename acc_t, typename PackB>
  void multiply_add(bool has_masked_entries, int64_t M, int64_t N, int64_t K, Operand<gemm_t> a,
                    const MaskedFactor<acc_t>& factor, Operand<scalar_t> b_rows,
                    const PackB& pack_b, acc_t* c, int64_t ldc) {
    multiply_add_by(
        has_masked_entries, M, N, K, factor, b_rows,
        [&](Operand<scalar_t> source) {
          multiply(M, N, K, a, pack_b(source), c, ldc, /*accumulate=*/true);
        },
        c, ldc);
  }

  // As multiply_add, with the product c += A B(source rows) made by multiply_by(source rows):
  // for operands whose reduction is not B's K rows one to one (P's (hi, lo) pairs, operands.h).
  template <typename acc_t, typename MultiplyBy>
  void multiply_add_by(bool has_masked_entries, int64_t M, int64_t N, int64_t K,
                       const MaskedFactor<acc_t>& factor, Operand<scalar_t> b_rows,
                       const MultiplyBy& multiply_by, acc_t* c, int64_t ldc) {
    // The guarded rows are K rows of c's width: N, or M where c is transposed (factor).
    multiply_by(prepare(has_masked_entries, b_rows, K, factor.transposed ? M : N));
    add_back(M, N, factor, b_rows, c, ldc);
  }

  // c[M, N] += the contributions of the rows a cleaned copy left out (without_non_finite_rows),
  // where `factor` says they are visible.
  template <typename acc_t>
  void add_back(int64_t M, int64_t N, const MaskedFactor<acc_t>& factor, Operand<scalar_t> b_rows,
                acc_t* c, int64_t ldc) const {
    for (int64_t i : bad_rows_) {
      const scalar_t* bad = b_rows.data + i * b_rows.ld;
      if (factor.transposed) {
        // Guarded row i (M values) meets row i of `values`, on the keys it sees: column j of c.
        for (int64_t j = factor.first[i]; j < factor.visible[i]; ++j) {
          if (factor.sees(i, j)) {
            const acc_t alpha = factor.values[i * factor.ld + j];
            for (int64_t d = 0; d < M; ++d) {
              c[d * ldc + j] += alpha * static_cast<acc_t>(bad[d]);
            }
          }
        }
      } else {
        for (int64_t r = 0; r < M; ++r) {
          if (factor.sees(r, i)) {
            axpy(factor.values[r * factor.ld + i], bad, N, c + r * ldc);
          }
        }
      }
    }
  }

  // `rows` with its non-finite rows zeroed in a copy (for add_back), or itself if it has none:
  // the value rows of a decode block whose attn_mask hides entries of some rows.
  Operand<scalar_t> without_non_finite_rows(Operand<scalar_t> rows, int64_t n_rows, int64_t width) {
    return without_non_finite_rows(rows, n_rows, width, [](int64_t) { return true; });
  }

  // The value rows of a decode block whose key mask hides some keys (kept[i] false): read in
  // place with the hidden rows' zero weights, so a hidden non-finite row is zeroed in a copy.
  Operand<scalar_t> without_hidden_non_finite_rows(Operand<scalar_t> rows, int64_t n_rows,
                                                   int64_t width, const bool* kept) {
    return without_non_finite_rows(rows, n_rows, width, [&](int64_t i) { return !kept[i]; });
  }

 private:
  // The B rows to pack: `rows` itself, or a copy without its non-finite rows when the pair
  // has masked entries.
  Operand<scalar_t> prepare(bool has_masked_entries, Operand<scalar_t> rows, int64_t n_rows,
                            int64_t width) {
    if (!has_masked_entries) {
      bad_rows_.clear();
      return rows;
    }
    return without_non_finite_rows(rows, n_rows, width);
  }

  // `rows`, or a copy with the non-finite rows among those `considered` zeroed (listed in
  // bad_rows_).
  template <typename Considered>
  Operand<scalar_t> without_non_finite_rows(Operand<scalar_t> rows, int64_t n_rows, int64_t width,
                                            const Considered& considered) {
    bad_rows_.clear();
    for (int64_t i = 0; i < n_rows; ++i) {
      const scalar_t* row = rows.data + i * rows.ld;
      if (considered(i) && !all_finite(row, width)) {
        bad_rows_.push_back(i);
      }
    }
    if (bad_rows_.empty()) {
      return rows;
    }
    cleaned_.resize(n_rows * width);
    for (int64_t i = 0; i < n_rows; ++i) {
      std::copy_n(rows.data + i * rows.ld, width, cleaned_.data() + i * width);
    }
    for (int64_t i : bad_rows_) {
      std::fill_n(cleaned_.data() + i * width, width, scalar_t(0));
    }
    return {cleaned_.data(), width};
  }

  template <typename acc_t>
  static void axpy(acc_t alpha, const scalar_t* x, int64_t n, acc_t* y) {
    for (int64_t d = 0; d < n; ++d) {
      y[d] += alpha * static_cast<acc_t>(x[d]);
    }
  }

  std::vector<int64_t> bad_rows_;
  std::vector<scalar_t> cleaned_;
};

}  // namespace causal_attention::cpu::CPU_CAPABILITY
