// The problem's geometry: its sizes and visibility, the one place that says which keys a query
// row sees. Block skipping, the masked entries of a block pair and the rows that reach a key
// block are all derived here; a mask (padding, windows, packed sequences, attn_mask's tiles of
// attn_mask_view.h) extends these functions and nothing else re-derives them. Where the rows of
// the tensors lie is row_sources.h.
//
// Included only by the per-instruction-set kernel sources: everything here lives in the
// namespace named by CPU_CAPABILITY, so that inline code compiled with AVX-512 flags is never
// merged by the linker with its AVX2 or baseline twin.
#pragma once

#include "attn_mask_view.h"
#include "kernel_api.h"

#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cstdint>

namespace causal_attention::cpu::CPU_CAPABILITY {

inline int64_t ceil_div(int64_t a, int64_t b) {
  return (a + b - 1) / b;
}

// Keys [begin, end) of a block, relative to its first key; begin == end when empty.
struct KeyRange {
  int64_t begin, end;
};

// What hides keys of one block pair besides the window: the key mask of its keys where it hides
// some (else null), and whether attn_mask's entries must be read (its tiles there are mixed).
struct BlockMasks {
  const bool* kept = nullptr;
  bool attn_mask = false;
};

// The problem's sizes, with what narrows visibility: the window, packed sequences (varlen), where
// batch item b is the query rows [cu_q[b], cu_q[b + 1]) and keys [cu_k[b], cu_k[b + 1]) of
// tensors viewed as (1, heads, total rows, dim), and a key mask (batch, len_k) that hides keys
// from every row. len_q and len_k are the longest sequence's, which size the scratch.
struct AttentionDims {
  int64_t batch;  // product of the leading dims, or the number of packed sequences
  int64_t heads_q;
  int64_t heads_kv;
  int64_t len_q;
  int64_t len_k;
  int64_t head_dim;
  int64_t value_dim;
  const int32_t* cu_q = nullptr;  // packed sequences: cumulative lengths (batch + 1), else null
  const int32_t* cu_k = nullptr;
  const bool* key_mask = nullptr;              // (batch, len_k), true where a key may be attended
  const int32_t* kept_before = nullptr;        // (batch, len_k + 1): kept keys before each key
  int64_t window_left = -1, window_right = 0;  // see key_begin, key_end
  AttentionMaskView attn_mask;                 // hides (or biases) entries of (b, h_q, row, key)

  template <typename Tensors>
  explicit AttentionDims(const Tensors& t)
      : batch(t.sequences.packed() ? t.sequences.cu_q.numel() - 1 : t.q.size(0)),
        heads_q(t.q.size(1)),
        heads_kv(t.k.size(1)),
        len_q(t.sequences.packed() ? t.sequences.max_len_q : t.q.size(2)),
        len_k(t.sequences.packed() ? t.sequences.max_len_k : t.k.size(2)),
        head_dim(t.q.size(3)),
        value_dim(t.v.size(3)),
        window_left(t.options.window_left),
        window_right(t.options.window_right),
        attn_mask(t.attn_mask),
        dense_offset_(t.query_offset.value_or(len_k - len_q)) {
    if (t.sequences.packed()) {
      cu_q = t.sequences.cu_q.template data_ptr<int32_t>();
      cu_k = t.sequences.cu_k.template data_ptr<int32_t>();
    }
    if (t.key_mask.defined()) {
      key_mask = t.key_mask.template data_ptr<bool>();
      kept_before = t.kept_keys_before.template data_ptr<int32_t>();
    }
  }

  // Query heads per KV head: query head h reads KV head h / group().
  int64_t group() const { return heads_q / heads_kv; }

  // The query rows and keys of batch item b.
  int64_t rows_q(int64_t b) const { return cu_q ? cu_q[b + 1] - cu_q[b] : len_q; }
  int64_t rows_k(int64_t b) const { return cu_k ? cu_k[b + 1] - cu_k[b] : len_k; }
  // The key position of query row 0 of batch item b: rows_k - rows_q (bottom-right), or the
  // dense call's query_offset where it gave one.
  int64_t off(int64_t b) const { return cu_q ? rows_k(b) - rows_q(b) : dense_offset_; }

  // Visibility within batch item b, aligned at off(b): query row `row` sees keys
  // [key_begin(b, row), key_end(b, row)), i.e. key j iff
  // row + off - window_left <= j <= row + off + window_right with off(b) (-1: unbounded on that
  // side), less the keys the key mask hides (see hidden_keys). Both bounds
  // never decrease from one row to the next, which the block skipping below relies on.
  int64_t key_begin(int64_t b, int64_t row) const {
    return window_left < 0 ? 0 : std::clamp<int64_t>(row + off(b) - window_left, 0, rows_k(b));
  }
  int64_t key_end(int64_t b, int64_t row) const {
    return window_right < 0 ? rows_k(b)
                            : std::clamp<int64_t>(row + off(b) + window_right + 1, 0, rows_k(b));
  }
  // The first query row that sees key `key` (or a later key).
  int64_t first_row_seeing(int64_t b, int64_t key) const {
    return window_right < 0 ? 0 : std::clamp<int64_t>(key - off(b) - window_right, 0, rows_q(b));
  }
  // The most keys a query row sees: every key, or a sliding window's span where that is shorter.
  int64_t keys_seen() const { return windowed() ? window_left + window_right + 1 : len_k; }
  // Whether a sliding window's span is shorter than the keys: the keys a row sees then start
  // past the first, where a key block aligned before the window's start computes keys it hides.
  bool windowed() const {
    return window_left >= 0 && window_right >= 0 && window_left + window_right + 1 < len_k;
  }
  // One past the last query row that sees a key before `key_end_excl`.
  int64_t rows_seeing_before(int64_t b, int64_t key_end_excl) const {
    return window_left < 0 ? rows_q(b)
                           : std::clamp<int64_t>(key_end_excl - off(b) + window_left, 0, rows_q(b));
  }
  // The keys of the `cols` from k0 that row `row` reaches, relative to k0 (the key mask may
  // hide some of them).
  KeyRange visible_in_block(int64_t b, int64_t row, int64_t k0, int64_t cols) const {
    const int64_t begin = std::clamp<int64_t>(key_begin(b, row) - k0, 0, cols);
    return {begin, std::clamp<int64_t>(key_end(b, row) - k0, begin, cols)};
  }
  // How many of keys [k0, k0 + cols) the key mask keeps.
  int64_t kept_keys(int64_t b, int64_t k0, int64_t cols) const {
    if (!key_mask) {
      return cols;
    }
    const int32_t* before = kept_before + b * (len_k + 1);
    return before[k0 + cols] - before[k0];
  }
  // The (query row, key) pairs of rows [row_begin, row_end) and keys [key_begin, key_end) of
  // batch item b that are visible: the work of a task, for the schedule's balance. O(rows).
  int64_t visible_pairs(int64_t b, int64_t row_begin, int64_t row_end, int64_t key_begin,
                        int64_t key_end) const {
    int64_t pairs = 0;
    for (int64_t row = row_begin; row < row_end; ++row) {
      const int64_t begin = std::max(key_begin, this->key_begin(b, row));
      const int64_t end = std::min(key_end, this->key_end(b, row));
      pairs += end > begin ? kept_keys(b, begin, end - begin) : 0;
    }
    return pairs;
  }
  // The key mask of keys [k0, k0 + cols) if it hides some of them (a block with holes), else
  // null. A block the mask hides entirely is skipped (kept_keys == 0) and never asks.
  const bool* hidden_keys(int64_t b, int64_t k0, int64_t cols) const {
    return kept_keys(b, k0, cols) < cols ? key_mask + b * len_k + k0 : nullptr;
  }
  // Whether attn_mask (present) hides every entry of rows [q0, q0 + rows) x keys [k0, k0 + cols)
  // of query head h: a block skipped as the window's are.
  bool mask_hides(int64_t b, int64_t h, int64_t q0, int64_t rows, int64_t k0, int64_t cols) const {
    return attn_mask.block(b, h, q0, rows, k0, cols) == kTileHidden;
  }
  // The rows [begin, end) of rows [q0, q0 + rows) left when attn_mask's tiles that hide every
  // key of [k0, k0 + cols) from their rows are cut from either end, relative to q0; likewise
  // the keys of [k0, k0 + cols) left, relative to k0, for those rows: the others can be left out
  // of the block pair's products. For a present mask (for_each_part).
  KeyRange rows_not_hidden(int64_t b, int64_t h, int64_t q0, int64_t rows, int64_t k0,
                           int64_t cols) const {
    return trimmed(q0, rows, KernelAttentionMask::kTileRows, [&](int64_t first, int64_t count) {
      return attn_mask.block(b, h, first, count, k0, cols) == kTileHidden;
    });
  }
  KeyRange keys_not_hidden(int64_t b, int64_t h, int64_t q0, int64_t rows, int64_t k0,
                           int64_t cols) const {
    return trimmed(k0, cols, KernelAttentionMask::kTileKeys, [&](int64_t first, int64_t count) {
      return attn_mask.block(b, h, q0, rows, first, count) == kTileHidden;
    });
  }
  // Keys of the parts of a block pair whose attn_mask is read: at most a block, a multiple of
  // the mask's tiles.
  static constexpr int64_t kMaskedPartKeys = 64;

  // Calls fn(q0, rows, k0, cols) for what attn_mask leaves of a block pair: the pair itself
  // without a mask; nothing where the mask hides it entirely (skipped, as a block outside the
  // window); else, for a pair whose mask is read, its parts of kMaskedPartKeys keys (where
  // documents meet inside a block, each part serves the rows of one of them), each left out
  // where the mask hides it and cut to the rows and keys its tiles do not hide.
  template <typename Fn>
  void for_each_part(int64_t b, int64_t h, int64_t q0, int64_t rows, int64_t k0, int64_t cols,
                     const Fn& fn) const {
    if (attn_mask.absent()) {
      fn(q0, rows, k0, cols);
      return;
    }
    const MaskTile state = attn_mask.block(b, h, q0, rows, k0, cols);
    if (state == kTileHidden) {
      return;
    }
    if (state == kTileVisible) {  // no tile to cut or skip
      fn(q0, rows, k0, cols);
      return;
    }
    for (int64_t p0 = k0; p0 < k0 + cols; p0 += kMaskedPartKeys) {
      const int64_t part = std::min(kMaskedPartKeys, k0 + cols - p0);
      if (part < cols && mask_hides(b, h, q0, rows, p0, part)) {
        continue;
      }
      const KeyRange seen = rows_not_hidden(b, h, q0, rows, p0, part);
      const int64_t first = q0 + seen.begin, rows_seen = seen.end - seen.begin;
      const KeyRange keys = keys_not_hidden(b, h, first, rows_seen, p0, part);
      fn(first, rows_seen, p0 + keys.begin, keys.end - keys.begin);
    }
  }

  // The masks of a block pair that is not skipped.
  BlockMasks block_masks(int64_t b, int64_t h, int64_t q0, int64_t rows, int64_t k0,
                         int64_t cols) const {
    return {hidden_keys(b, k0, cols),
            !attn_mask.absent() && attn_mask.block(b, h, q0, rows, k0, cols) != kTileVisible};
  }
  // Whether some row of [q0, q0 + rows) may miss a key of [k0, k0 + cols): the block pair
  // straddles a window boundary or has masks, so its products may carry masked zeros. The
  // bounds never decrease, so the first row has the lowest end and the last the highest begin.
  bool has_masked_entries(int64_t b, int64_t q0, int64_t rows, int64_t k0, int64_t cols,
                          const BlockMasks& masks) const {
    return visible_in_block(b, q0, k0, cols).end < cols ||
           visible_in_block(b, q0 + rows - 1, k0, cols).begin > 0 || masks.kept != nullptr ||
           masks.attn_mask;
  }

  // [begin, end) relative to `first` of the `count` indices from `first`, less the whole tiles
  // of `tile` indices (aligned to multiples of it) at either end that hidden(first, count) says
  // attn_mask hides.
  template <typename Hidden>
  KeyRange trimmed(int64_t first, int64_t count, int64_t tile, const Hidden& hidden) const {
    int64_t begin = 0, end = count;
    while (begin < end) {
      const int64_t next = std::min(end, ((first + begin) / tile + 1) * tile - first);
      if (!hidden(first + begin, next - begin)) {
        break;
      }
      begin = next;
    }
    while (end > begin) {
      const int64_t previous = std::max(begin, (first + end - 1) / tile * tile - first);
      if (!hidden(first + previous, end - previous)) {
        break;
      }
      end = previous;
    }
    return {begin, end};
  }

 private:
  int64_t dense_offset_;  // off() of a dense call
};

}  // namespace causal_attention::cpu::CPU_CAPABILITY
