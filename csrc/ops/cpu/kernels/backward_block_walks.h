// The walks over block pairs that the steps of the backward take (the row statistics of
// backward_row_statistics.h, the gradients of attention_backward_kernel.cpp and the row panels of
// backward_row_panels.h): every query block of every (batch, query head), in parallel, and the
// parts of the key blocks one query block sees, in order.
//
// Included only by the per-instruction-set kernel sources (see geometry.h).
#pragma once

#include "geometry.h"
#include "schedule.h"

#include <algorithm>
#include <cstdint>

namespace causal_attention::cpu::CPU_CAPABILITY {

// A part of a block pair (AttentionDims::for_each_part).
struct PairPart {
  int64_t q0, rows, k0, cols;
};

// Calls fn(bh, q0, scratch) for every query block of every (batch, query head), in parallel.
template <typename Scratch, typename Fn>
void for_each_query_block(const AttentionDims& d, const BlockSizes& blocks, const Fn& fn) {
  // A query block costs its visible pairs plus its rows; zero past the end of a packed
  // sequence.
  const auto query_block_cost = [&](int64_t bh, int64_t block) -> int64_t {
    const int64_t b = bh / d.heads_q, q0 = block * blocks.query_rows;
    const int64_t rows = std::min(blocks.query_rows, d.rows_q(b) - q0);
    return rows <= 0 ? 0 : rows + d.visible_pairs(b, q0, q0 + rows, 0, d.rows_k(b));
  };
  schedule_head_blocks(
      d, d.batch * d.heads_q, ceil_div(d.len_q, blocks.query_rows), query_block_cost,
      [&] { return Scratch(d, blocks, /*tile=*/1); },
      [&](int64_t bh, int64_t block, Scratch& s) { fn(bh, block * blocks.query_rows, s); });
}

// Calls fn(pair, scratch) for every (batch, KV head) pair p = b * heads_kv + h_kv of [first,
// last), a task each, in parallel (the one-pass and row-panel gradients). A pair costs its
// visible (query row, key) pairs, plus its rows and keys.
template <typename MakeScratch, typename Fn>
void for_each_key_value_head(const AttentionDims& d, int64_t first, int64_t last,
                             const MakeScratch& make_scratch, const Fn& fn) {
  const auto cost = [&](int64_t pair, int64_t) {
    const int64_t b = (first + pair) / d.heads_kv;
    return d.rows_q(b) + d.rows_k(b) + d.visible_pairs(b, 0, d.rows_q(b), 0, d.rows_k(b));
  };
  schedule_head_blocks(d, last - first, 1, cost, make_scratch,
                       [&](int64_t pair, int64_t, auto& scratch) { fn(first + pair, scratch); });
}

// Calls fn(part) for the parts of each key block that a row of query rows [q0, q0 + rows) of
// batch item b, query head h, sees, in order (blocks the key mask or attn_mask hides entirely
// are skipped).
template <typename Fn>
void for_each_visible_key_block(const AttentionDims& d, const BlockSizes& blocks, int64_t b,
                                int64_t h, int64_t q0, int64_t rows, const Fn& fn) {
  const int64_t key_end = d.key_end(b, q0 + rows - 1);
  const int64_t first_block = d.key_begin(b, q0) / blocks.keys * blocks.keys;
  for (int64_t k0 = first_block; k0 < key_end; k0 += blocks.keys) {
    const int64_t cols = std::min(blocks.keys, key_end - k0);
    if (d.kept_keys(b, k0, cols) > 0) {
      d.for_each_part(b, h, q0, rows, k0, cols, [&](int64_t q, int64_t r, int64_t k, int64_t c) {
        fn(PairPart{q, r, k, c});
      });
    }
  }
}

}  // namespace causal_attention::cpu::CPU_CAPABILITY
