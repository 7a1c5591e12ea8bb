// attn_mask as the kernels read it (kernel_api.h's KernelAttentionMask): its entries by element
// strides (0 along broadcast dims) and its tile summary, or a mask over each sequence's new
// tokens (spec_mask) as bits and padded rows, from which a block pair learns whether the mask
// hides it, leaves it as it is or must be read entry by entry (geometry.h decides).
//
// Included only by the per-instruction-set kernel sources (see geometry.h).
#pragma once

#include "kernel_api.h"

#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <utility>

namespace causal_attention::cpu::CPU_CAPABILITY {

// attn_mask's entries of one query row from a block's first key: key c (relative) is
// bools[c * stride] (true: visible) or values[c * stride] (added to the score; -inf hides it).
// Inactive (both null) where the block needs no entry read.
template <typename acc_t>
struct MaskRow {
  const bool* bools = nullptr;
  const acc_t* values = nullptr;
  int64_t stride = 0;

  bool active() const { return bools != nullptr || values != nullptr; }
  // The same row's entries from key c (relative) on.
  MaskRow from(int64_t c) const {
    return {bools ? bools + c * stride : nullptr, values ? values + c * stride : nullptr, stride};
  }
  bool hides(int64_t c) const {
    return bools    ? !bools[c * stride]
           : values ? values[c * stride] == -std::numeric_limits<acc_t>::infinity()
                    : false;
  }
};

// attn_mask (kernel_api.h) as the kernels read it: its entries and tile summary by element
// strides, 0 along broadcast dims. absent() without a mask.
class AttentionMaskView {
 public:
  AttentionMaskView() = default;
  explicit AttentionMaskView(const KernelAttentionMask& m) {
    if (!m.defined()) {
      return;
    }
    if (m.over_new_tokens()) {
      bools_ = m.values.data_ptr();
      new_token_words_ = m.tiles.data_ptr<int64_t>();
      first_new_key_ = m.first_new_key.data_ptr<int64_t>();
      new_token_rows_ = m.tiles.size(1);
      return;
    }
    (m.values.scalar_type() == at::kBool ? bools_ : values_) = m.values.data_ptr();
    for (int d = 0; d < 4; ++d) {
      stride_[d] = m.values.stride(d);
      tile_stride_[d] = m.tiles.size(d) == 1 ? 0 : m.tiles.stride(d);
    }
    tiles_ = m.tiles.data_ptr<uint8_t>();
    // A mask broadcast along query rows (keys) has one tile along them: every row (key) reads it.
    rows_per_tile_ = m.tiles.size(2) == 1 ? 0 : KernelAttentionMask::kTileRows;
    keys_per_tile_ = m.tiles.size(3) == 1 ? 0 : KernelAttentionMask::kTileKeys;
  }

  bool absent() const { return bools_ == nullptr && values_ == nullptr; }

  // The mask over rows [q0, q0 + rows) and keys [k0, k0 + cols) of (b, h): hidden (visible)
  // where every tile it meets is, else mixed. O(tiles met).
  MaskTile block(int64_t b, int64_t h, int64_t q0, int64_t rows, int64_t k0, int64_t cols) const {
    if (first_new_key_ != nullptr) {
      return new_token_block(b, q0, rows, k0, cols);
    }
    const uint8_t* head = tiles_ + b * tile_stride_[0] + h * tile_stride_[1];
    const auto [first_row_tile, last_row_tile] = tile_span(q0, rows, rows_per_tile_);
    const auto [first_key_tile, last_key_tile] = tile_span(k0, cols, keys_per_tile_);
    const uint8_t first = head[first_row_tile * tile_stride_[2] + first_key_tile * tile_stride_[3]];
    for (int64_t i = first_row_tile; i <= last_row_tile; ++i) {
      for (int64_t j = first_key_tile; j <= last_key_tile; ++j) {
        if (head[i * tile_stride_[2] + j * tile_stride_[3]] != first) {
          return kTileMixed;
        }
      }
    }
    return MaskTile(first);
  }

  // Query row `row` of (b, h) from key k0.
  template <typename acc_t>
  MaskRow<acc_t> row(int64_t b, int64_t h, int64_t row, int64_t k0) const {
    if (first_new_key_ != nullptr) {
      // Read only for a block that reaches a new token (else its tile is visible), which starts
      // at most one block, kNewTokenPad keys, before the first.
      const int64_t from_first = k0 - first_new_key_[b];
      TORCH_CHECK(from_first >= -KernelAttentionMask::kNewTokenPad,
                  "spec_mask read for keys before its pad: ", from_first);
      const int64_t width = KernelAttentionMask::kNewTokenPad + new_token_rows_;
      return {static_cast<const bool*>(bools_) + (b * new_token_rows_ + row) * width +
                  KernelAttentionMask::kNewTokenPad + from_first,
              nullptr, 1};
    }
    const int64_t offset = b * stride_[0] + h * stride_[1] + row * stride_[2] + k0 * stride_[3];
    return {bools_ ? static_cast<const bool*>(bools_) + offset : nullptr,
            values_ ? static_cast<const acc_t*>(values_) + offset : nullptr, stride_[3]};
  }

 private:
  static std::pair<int64_t, int64_t> tile_span(int64_t first, int64_t count, int64_t per_tile) {
    return per_tile == 0
               ? std::pair<int64_t, int64_t>{0, 0}
               : std::pair<int64_t, int64_t>{first / per_tile, (first + count - 1) / per_tile};
  }

  // The mask over new tokens of rows [q0, q0 + rows) and keys [k0, k0 + cols) of sequence b.
  MaskTile new_token_block(int64_t b, int64_t q0, int64_t rows, int64_t k0, int64_t cols) const {
    const int64_t first = first_new_key_[b];
    if (k0 + cols <= first) {
      return kTileVisible;
    }
    // Bits of the new tokens among the block's keys (a sequence has at most 64).
    const int64_t begin = std::max<int64_t>(k0 - first, 0), end = k0 + cols - first;
    const uint64_t high = end >= 64 ? ~uint64_t(0) : (uint64_t(1) << end) - 1;
    const uint64_t span = high & ~((uint64_t(1) << begin) - 1);
    bool all_seen = true, none_seen = k0 >= first;
    for (int64_t r = q0; r < q0 + rows; ++r) {
      const uint64_t seen = uint64_t(new_token_words_[b * new_token_rows_ + r]) & span;
      all_seen = all_seen && seen == span;
      none_seen = none_seen && seen == 0;
    }
    return all_seen ? kTileVisible : none_seen ? kTileHidden : kTileMixed;
  }

  const void* bools_ = nullptr;
  const void* values_ = nullptr;
  int64_t stride_[4] = {0, 0, 0, 0};
  const uint8_t* tiles_ = nullptr;
  int64_t tile_stride_[4] = {0, 0, 0, 0};
  int64_t rows_per_tile_ = 0, keys_per_tile_ = 0;
  // The mask over new tokens (kernel_api.h): each row's word of bits, and each sequence's first
  // new key.
  const int64_t* new_token_words_ = nullptr;
  const int64_t* first_new_key_ = nullptr;
  int64_t new_token_rows_ = 0;
};

}  // namespace causal_attention::cpu::CPU_CAPABILITY
