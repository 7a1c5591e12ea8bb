// K and V packed once per call for the forward's block products: K_j^T (the B operand of
// S = Q_i K_j^T) and, where the micro-kernel cannot read value rows in place (VNNI pairs, or
// a dtype it does not multiply), V_j. Every query block and every query head of the GQA group
// then reuses the block packed for its (batch, KV head), instead of repacking it per pair. The
// copy has the size of K (and V), O(L) memory, and is freed with the call.
#pragma once

#include "geometry.h"
#include "operands.h"

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cstdint>

namespace causal_attention::cpu::CPU_CAPABILITY {

template <typename scalar_t, typename gemm_t>
class PackedKeyValues {
  using Pack = Packing<gemm_t>;

 public:
  static constexpr bool kPacksValues = Pack::template b_is_packed<scalar_t>();

  // Packs the key blocks [0, num_blocks) of `key_block` keys of every (batch, KV head).
  PackedKeyValues(const AttentionDims& d, const HeadRows<const scalar_t>& k,
                  const HeadRows<const scalar_t>& v, int64_t key_block, int64_t num_blocks)
      : dims_(d),
        v_(v),
        key_block_(key_block),
        num_blocks_(num_blocks),
        key_slot_(Pack::padded_k(d.head_dim) * key_block),
        value_slot_(kPacksValues ? (key_block + 1) * d.value_dim : 0) {
    const int64_t slots = d.batch * d.heads_kv * num_blocks;
    const auto options = at::TensorOptions().dtype(c10::CppTypeToScalarType<gemm_t>::value);
    keys_ = at::empty({slots * key_slot_}, options);
    values_ = at::empty({slots * value_slot_}, options);
    gemm_t* keys = keys_.data_ptr<gemm_t>();
    gemm_t* values = values_.data_ptr<gemm_t>();
    at::parallel_for(0, slots, 1, [&](int64_t begin, int64_t end) {
      for (int64_t slot = begin; slot < end; ++slot) {
        const int64_t b_hkv = slot / num_blocks, k0 = slot % num_blocks * key_block;
        const int64_t b = b_hkv / d.heads_kv, h_kv = b_hkv % d.heads_kv;
        const int64_t cols = std::min(key_block, d.len_k - k0);
        Pack::b_transposed(k.row(b, h_kv, k0), cols, d.head_dim, k.row_stride,
                           keys + slot * key_slot_);
        if constexpr (kPacksValues) {
          Pack::b(v.row(b, h_kv, k0), cols, d.value_dim, v.row_stride, values + slot * value_slot_);
        }
      }
    });
  }

  // K_j^T for the key block starting at k0; a product may use its first columns only.
  Operand<gemm_t> keys_t(int64_t b, int64_t h_kv, int64_t k0) const {
    return {keys_.data_ptr<gemm_t>() + slot(b, h_kv, k0) * key_slot_, block_width(k0)};
  }

  // The first `cols` rows of V_j as the B operand of O += P V_j: packed, or the value rows
  // themselves; null where the packed block cannot serve (an odd prefix of VNNI pairs would
  // pair its last row with the next, unseen one).
  Operand<gemm_t> values(int64_t b, int64_t h_kv, int64_t k0, int64_t cols) const {
    if constexpr (kPacksValues) {
      if (Pack::kVnni && cols % 2 == 1 && cols < block_width(k0)) {
        return {nullptr, 0};
      }
      return {values_.data_ptr<gemm_t>() + slot(b, h_kv, k0) * value_slot_, dims_.value_dim};
    } else {
      return {v_.row(b, h_kv, k0), v_.row_stride};
    }
  }

 private:
  int64_t block_width(int64_t k0) const { return std::min(key_block_, dims_.len_k - k0); }
  int64_t slot(int64_t b, int64_t h_kv, int64_t k0) const {
    return (b * dims_.heads_kv + h_kv) * num_blocks_ + k0 / key_block_;
  }

  const AttentionDims dims_;
  const HeadRows<const scalar_t> v_;
  const int64_t key_block_, num_blocks_, key_slot_, value_slot_;
  at::Tensor keys_, values_;
};

}  // namespace causal_attention::cpu::CPU_CAPABILITY
