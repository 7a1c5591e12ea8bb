// K and V packed once per call for the block products: K_j^T (the B operand of S = Q_i K_j^T,
// multiplied as gemm_t) and V_j, as the forward needs it (ValueOperand::kRows: the B operand of
// O += P V_j, the value rows widened to the accumulation dtype where they are not in it;
// backward_block_pair.h says why; kPairs: bfloat16 rows as the value pairs that multiply P's
// (hi, lo) pairs, operands.h) or as the backward does (kTransposed: V_j^T, the B operand of
// dP = dO_i V_j^T, as gemm_t). Every query block and every query head of the GQA group then
// reuses the block packed for its (batch, KV head), instead of repacking it per pair. The
// backward of bfloat16 with native products also gets K_j as value pairs (kKeyPairs: the B
// operand of dQ += dS K_j with dS as (hi, lo) pairs), packed once here where it was packed once a
// block pair. The copies take a few times the size of K and V, O(L) memory; a call packs them a
// group of (batch, KV head) pairs at a time where its tasks serve one pair each (pack_in_groups),
// else at once, in the storage the calling thread keeps (PackingStorage). K and V rows come from
// KeyRows: a tensor's (HeadRows) or a paged cache's (PagedRows), whose blocks are packed run by
// run (a page's rows after the other) into one operand, V then always copied; or an 8-bit
// cache's (QuantizedPagedRows), whose blocks are widened with their scales first.
#pragma once

#include "../block_shapes.h"
#include "geometry.h"
#include "operands.h"
#include "row_sources.h"

#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

namespace causal_attention::cpu::CPU_CAPABILITY {

enum class ValueOperand { kRows, kPairs, kTransposed };

// The storage of a PackedKeyValues: the calling thread's kept one, which it keeps from one call
// to the next while it holds at most cpu::packing_budget() bytes, or (where a PackedKeyValues of
// this thread still holds that) its own. Packed groups fit the budget and are rewritten every
// call; fresh storage would be faulted in afresh by the OS every call (glibc gives blocks
// of over 32 MiB back when they are freed): at B 4, H 8, L 2048, D 128 in bfloat16 the forward
// then took 17 % longer per batch item than at B 1 on a Zen 5 (docs/benchmarks, stop 63).
class PackingStorage {
 public:
  PackingStorage() : kept_(in_use() ? nullptr : &kept()) {
    // Read first, so that its environment variable's error is thrown before anything is held
    // (and never by the destructor's read).
    cpu::packing_budget();
    if (kept_ != nullptr) {
      in_use() = true;
    }
  }
  ~PackingStorage() {
    if (kept_ != nullptr) {
      if (kept_->defined() && kept_->nbytes() > size_t(cpu::packing_budget())) {
        *kept_ = at::Tensor();
      }
      in_use() = false;
    }
  }
  PackingStorage(const PackingStorage&) = delete;
  PackingStorage& operator=(const PackingStorage&) = delete;

  // At least `count` bytes from a cache line; earlier ones are given up.
  char* bytes(int64_t count) {
    at::Tensor& storage = kept_ != nullptr ? *kept_ : own_;
    if (!storage.defined() || storage.nbytes() < size_t(count)) {
      storage = at::Tensor();  // freed before the larger one is taken
      storage = at::empty({count}, at::kByte);
    }
    return static_cast<char*>(storage.data_ptr());
  }

 private:
  static at::Tensor& kept() {
    thread_local at::Tensor storage;
    return storage;
  }
  static bool& in_use() {
    thread_local bool used = false;
    return used;
  }
  at::Tensor* const kept_;
  at::Tensor own_;
};

template <typename scalar_t, typename gemm_t, ValueOperand kValues = ValueOperand::kRows,
          typename KeyRows = HeadRows<const scalar_t>>
class PackedKeyValues {
  using acc_t = at::opmath_type<scalar_t>;
  using Pack = Packing<gemm_t>;
  using ValuePack = Packing<acc_t>;
  static constexpr bool kTransposedValues = kValues == ValueOperand::kTransposed;
  static constexpr bool kValuePairs = kValues == ValueOperand::kPairs;
  static_assert(!kValuePairs || (std::is_same_v<scalar_t, gemm_t> && Pack::kVnni &&
                                 KeyRows::kOneRun && !KeyRows::kWidens),
                "value pairs are packed from a tensor's own bfloat16/float16 rows");
  using value_t = std::conditional_t<kTransposedValues || kValuePairs, gemm_t, acc_t>;
  // The backward's K_j value pairs (backward_block_pair.h's kFactorPairs: bfloat16 natively).
  static constexpr bool kKeyPairs = kTransposedValues && std::is_same_v<scalar_t, c10::BFloat16> &&
                                    std::is_same_v<gemm_t, scalar_t>;

 public:
  // Value rows are read in place only where they need no conversion and lie at one stride.
  static constexpr bool kPacksValues = kTransposedValues || kValuePairs ||
                                       ValuePack::template b_is_packed<scalar_t>() ||
                                       !KeyRows::kOneRun;

  // The key blocks of `key_block` keys that some query row of batch item b reaches causally (the
  // first blocks_of(b) of them), of every (batch, KV head), to be packed by pack() or
  // pack_in_groups(); blocks the key mask hides entirely are left unpacked.
  PackedKeyValues(const AttentionDims& d, const KeyRows& k, const KeyRows& v, int64_t key_block)
      : dims_(d),
        k_(k),
        v_(v),
        key_block_(key_block),
        key_slot_(Pack::padded_k(d.head_dim) * key_block),
        value_slot_(!kPacksValues       ? 0
                    : kTransposedValues ? Pack::padded_k(d.value_dim) * key_block
                    : kValuePairs       ? key_block * d.value_dim * 2
                                        : key_block * d.value_dim),
        key_pair_slot_(kKeyPairs ? key_block * d.head_dim * 2 : 0),
        first_block_(d.batch + 1, 0) {
    for (int64_t b = 0; b < d.batch; ++b) {
      first_block_[b + 1] = first_block_[b] + blocks_of(b);
    }
  }

  static constexpr int64_t kGroupItemsPerThread = 4;

  // The (batch, KV head) pairs, p = b * heads_kv + h_kv.
  int64_t pairs() const { return dims_.batch * dims_.heads_kv; }

  // The bytes the packed blocks of pairs [first, last) take.
  int64_t bytes(int64_t first, int64_t last) const {
    return (first_slot(last) - first_slot(first)) *
           (key_slot_ * int64_t(sizeof(gemm_t)) + value_slot_ * int64_t(sizeof(value_t)) +
            key_pair_slot_ * int64_t(sizeof(gemm_t)));
  }

  // Packs the pairs a group at a time, calling run_group(first, last) once the blocks of pairs
  // [first, last) are packed, before the next group's take their storage. Each group's copies
  // (K_j^T and V's pairs, 1.5 MiB a pair at L 2048, D 128 in bfloat16) are then read again by
  // every task that reaches them from cache, while the group fits cpu::packing_budget(), and the
  // storage the calling thread keeps stays that size whatever the batch. Only when the packing
  // runs changes, not a sum. A group takes pairs while their bytes fit, and at least as many as
  // give every thread kGroupItemsPerThread of the `items_per_pair` work items each pair gives
  // the tasks (a group's tasks then balance as a whole call's did).
  template <typename RunGroup>
  void pack_in_groups(int64_t items_per_pair, const RunGroup& run_group) {
    const int64_t min_pairs = ceil_div(kGroupItemsPerThread * at::get_num_threads(),
                                       std::max<int64_t>(1, items_per_pair));
    for (int64_t first = 0, last; first < pairs(); first = last) {
      last = std::min(pairs(), first + min_pairs);
      while (last < pairs() && bytes(first, last + 1) <= cpu::packing_budget()) {
        ++last;
      }
      pack(first, last);
      run_group(first, last);
    }
  }

  // Packs the blocks of pairs [first, last), in parallel, in place of those packed before: only
  // theirs may be read until the next call. The storage grows to the largest range asked for
  // and is reused.
  void pack(int64_t first, int64_t last) {
    slot_base_ = first_slot(first);
    const int64_t slots = first_slot(last) - slot_base_;
    if (slots == 0) {
      return;
    }
    // keys, values and key pairs one after the other, each from a cache line
    const int64_t key_bytes = aligned(slots * key_slot_ * int64_t(sizeof(gemm_t)));
    const int64_t value_bytes = aligned(slots * value_slot_ * int64_t(sizeof(value_t)));
    char* storage =
        storage_.bytes(key_bytes + value_bytes + slots * key_pair_slot_ * int64_t(sizeof(gemm_t)));
    keys_ = reinterpret_cast<gemm_t*>(storage);
    values_ = reinterpret_cast<value_t*>(storage + key_bytes);
    key_pairs_ = reinterpret_cast<gemm_t*>(storage + key_bytes + value_bytes);
    at::parallel_for(slot_base_, slot_base_ + slots, 1, [&](int64_t begin, int64_t end) {
      WideRows wide(KeyRows::kWidens ? key_block_ : 0, dims_.head_dim);
      for (int64_t slot = begin; slot < end; ++slot) {
        const int64_t b =
            std::upper_bound(first_block_.begin(), first_block_.end(), slot / dims_.heads_kv) -
            first_block_.begin() - 1;
        const int64_t within = slot - first_block_[b] * dims_.heads_kv;
        const int64_t h_kv = within / blocks_of(b), k0 = within % blocks_of(b) * key_block_;
        const int64_t cols = block_width(b, k0);
        if (dims_.kept_keys(b, k0, cols) == 0) {
          continue;
        }
        const int64_t stored = slot - slot_base_;  // its place in storage
        if constexpr (KeyRows::kWidens) {
          static_assert(!kTransposedValues, "8-bit caches are read by the forward only");
          pack_widened(k_, b, h_kv, k0, cols, keys_ + stored * key_slot_, wide);
          v_.widen(b, h_kv, k0, cols, dims_.value_dim, values_ + stored * value_slot_,
                   dims_.value_dim);
        } else {
          pack_transposed(k_, b, h_kv, k0, cols, dims_.head_dim, keys_ + stored * key_slot_);
          if constexpr (kKeyPairs) {
            Pack::b_value_pairs(k_.row(b, h_kv, k0), cols, dims_.head_dim, k_.row_stride,
                                key_pairs_ + stored * key_pair_slot_);
          }
          if constexpr (kTransposedValues) {
            pack_transposed(v_, b, h_kv, k0, cols, dims_.value_dim, values_ + stored * value_slot_);
          } else if constexpr (kValuePairs) {
            Pack::b_value_pairs(v_.row(b, h_kv, k0), cols, dims_.value_dim, v_.row_stride,
                                values_ + stored * value_slot_);
          } else if constexpr (kPacksValues) {
            for (int64_t r = 0; r < cols; ++r) {  // widened row by row, each where it lies
              convert_row(v_.row(b, h_kv, k0 + r),
                          values_ + stored * value_slot_ + r * dims_.value_dim, dims_.value_dim);
            }
          }
        }
      }
    });
  }

  // K_j^T from key k0 of its block (a product may use its first columns only).
  Operand<gemm_t> keys_t(int64_t b, int64_t h_kv, int64_t k0) const {
    const int64_t start = block_start(k0);
    return Pack::b_columns_from({keys_ + slot(b, h_kv, start) * key_slot_, block_width(b, start)},
                                k0 - start);
  }

  // V_j^T from key k0 of its block (kTransposed); a product may use its first columns only.
  Operand<gemm_t> values_t(int64_t b, int64_t h_kv, int64_t k0) const {
    static_assert(kTransposedValues, "values_t() is the backward's operand");
    const int64_t start = block_start(k0);
    return Pack::b_columns_from(
        {values_ + slot(b, h_kv, start) * value_slot_, block_width(b, start)}, k0 - start);
  }

  // The value pairs of V_j from key k0 of its block (kPairs), the B operand of O += P V_j with
  // P as (hi, lo) pairs.
  Operand<gemm_t> value_pairs(int64_t b, int64_t h_kv, int64_t k0) const {
    static_assert(kValuePairs, "value_pairs() is the operand of split probabilities");
    return pairs_from(values_, value_slot_, dims_.value_dim, b, h_kv, k0);
  }

  // The value pairs of K_j from key k0 of its block (kKeyPairs), the B operand of dQ += dS K_j
  // with dS as (hi, lo) pairs.
  Operand<gemm_t> key_pairs(int64_t b, int64_t h_kv, int64_t k0) const {
    static_assert(kKeyPairs, "key_pairs() is the operand of the backward's split dS");
    return pairs_from(key_pairs_, key_pair_slot_, dims_.head_dim, b, h_kv, k0);
  }

  // The rows of V_j from key k0 of its block as the B operand of O += P V_j (kRows): packed, or
  // the value rows themselves.
  Operand<acc_t> values(int64_t b, int64_t h_kv, int64_t k0) const {
    static_assert(kValues == ValueOperand::kRows, "values() is the forward's operand");
    if constexpr (kPacksValues) {
      const int64_t start = block_start(k0);
      return {values_ + slot(b, h_kv, start) * value_slot_ + (k0 - start) * dims_.value_dim,
              dims_.value_dim};
    } else {
      return {v_.row(b, h_kv, k0), v_.row_stride};
    }
  }

 private:
  // A key block widened from an 8-bit cache: float32 rows, and gemm_t's where that differs.
  struct WideRows {
    std::vector<float> rows;
    std::vector<gemm_t> converted;
    WideRows(int64_t keys, int64_t width)
        : rows(keys * width), converted(std::is_same_v<gemm_t, float> ? 0 : keys * width) {}
  };

  // As pack_transposed, from an 8-bit cache: the block's rows widened, then packed as
  // one run (the rows of a reduced gemm_t rounded from the dequantized values).
  void pack_widened(const KeyRows& rows, int64_t b, int64_t h, int64_t k0, int64_t cols,
                    gemm_t* dst, WideRows& wide) const {
    const int64_t width = dims_.head_dim;
    rows.widen(b, h, k0, cols, width, wide.rows.data(), width);
    const gemm_t* block = nullptr;
    if constexpr (std::is_same_v<gemm_t, float>) {
      block = wide.rows.data();
    } else {
      convert_row(wide.rows.data(), wide.converted.data(), cols * width);
      block = wide.converted.data();
    }
    Pack::b_transposed(block, cols, width, width, dst, cols);
  }

  // The `cols` rows of (b, h) from k0, width `width`, as one B operand of their transpose at
  // `dst` (leading dim cols): each run of rows (KeyRows::run_end) packed into its columns.
  static void pack_transposed(const KeyRows& rows, int64_t b, int64_t h, int64_t k0, int64_t cols,
                              int64_t width, gemm_t* dst) {
    for (int64_t r0 = k0, end; r0 < k0 + cols; r0 = end) {
      end = std::min(k0 + cols, rows.run_end(b, r0, k0 + cols));
      Pack::b_transposed(rows.row(b, h, r0), end - r0, width, rows.row_stride,
                         dst + Pack::column_offset(r0 - k0), cols);
    }
  }

  // The value pairs of rows `width` wide from key k0 of its block, in `storage` of slot_size
  // elements a block.
  Operand<gemm_t> pairs_from(const gemm_t* storage, int64_t slot_size, int64_t width, int64_t b,
                             int64_t h_kv, int64_t k0) const {
    const int64_t start = block_start(k0);
    return {storage + slot(b, h_kv, start) * slot_size + (k0 - start) * width * 2, width};
  }

  static int64_t aligned(int64_t bytes) { return ceil_div(bytes, int64_t(64)) * 64; }

  // The key blocks of batch item b that its last query row reaches.
  int64_t blocks_of(int64_t b) const {
    return dims_.rows_q(b) == 0 ? 0 : ceil_div(dims_.key_end(b, dims_.rows_q(b) - 1), key_block_);
  }
  // The first key of key k0's block.
  int64_t block_start(int64_t k0) const { return k0 / key_block_ * key_block_; }
  int64_t block_width(int64_t b, int64_t k0) const {
    return std::min(key_block_, dims_.rows_k(b) - k0);
  }
  // Slots of batch item b: blocks_of(b) per KV head, after those of the items before it; a pair's
  // slots follow the pair before it's. In storage from the first slot packed (slot_base_).
  int64_t first_slot(int64_t pair) const {
    const int64_t b = pair / dims_.heads_kv;
    return b == dims_.batch
               ? first_block_[b] * dims_.heads_kv
               : first_block_[b] * dims_.heads_kv + pair % dims_.heads_kv * blocks_of(b);
  }
  int64_t slot(int64_t b, int64_t h_kv, int64_t k0) const {
    return first_slot(b * dims_.heads_kv + h_kv) + k0 / key_block_ - slot_base_;
  }

  const AttentionDims dims_;
  const KeyRows k_, v_;
  const int64_t key_block_, key_slot_, value_slot_, key_pair_slot_;
  std::vector<int64_t> first_block_;  // (batch + 1): blocks per KV head before each item
  int64_t slot_base_ = 0;             // the first slot packed
  PackingStorage storage_;
  gemm_t* keys_ = nullptr;
  value_t* values_ = nullptr;
  gemm_t* key_pairs_ = nullptr;
};

}  // namespace causal_attention::cpu::CPU_CAPABILITY
