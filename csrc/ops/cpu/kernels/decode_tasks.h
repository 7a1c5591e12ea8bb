// The decode path's tasks (decode.h says what a task does): which query rows of which (batch,
// KV head) item i of its schedule carries, and how many KV heads at once, found from the sizes
// alone.
//
// Included only by the per-instruction-set kernel sources (see geometry.h).
#pragma once

#include "geometry.h"

#include <algorithm>
#include <cstdint>

namespace causal_attention::cpu::CPU_CAPABILITY {

template <typename KeyRows>
struct DecodeTasks {
  // At most this many query rows a task: with D = Dv = 64 its scratch then takes ~0.5 MiB.
  static constexpr int64_t kMaxTaskRows = 256;

  // Rows [first_row, first_row + rows) of a (batch, KV head), whose query heads have
  // rows_per_head rows each.
  struct TaskRows {
    int64_t b, h_kv, first_row, rows, rows_per_head;
    int64_t head(int64_t r, const AttentionDims& d) const {
      return h_kv * d.group() + (first_row + r) / rows_per_head;
    }
    int64_t query_row(int64_t r) const { return (first_row + r) % rows_per_head; }
  };

  // The query rows of a (batch, KV head): row g is query row g % rows_q of query head
  // h_kv * group + g / rows_q. Tasks take chunks of them (sized for the longest sequence).
  static int64_t group_rows(const AttentionDims& d) { return d.group() * d.len_q; }
  static int64_t row_chunks(const AttentionDims& d) {
    return ceil_div(group_rows(d), kMaxTaskRows);
  }
  static int64_t task_rows(const AttentionDims& d) { return std::min(group_rows(d), kMaxTaskRows); }

  // The KV heads one task carries through each key block: every one of its sequence's where
  // KeyRows interleaves the heads' rows (a paged cache's pages hold the rows of every head side
  // by side, so a block of them is then read as one stream; one head a task reads every Hkv-th
  // stretch: 1.2-1.5x the time on that row layout in benchmarks.paged), else one.
  static int64_t heads_together(const AttentionDims& d) {
    return KeyRows::kInterleavedHeads ? d.heads_kv : 1;
  }
  // The (batch, KV head, row chunk) of KV head `head` of an item of heads_together() heads.
  static int64_t head_item(const AttentionDims& d, int64_t item, int64_t head) {
    const int64_t chunk = item % row_chunks(d), first = item / row_chunks(d);
    return (first * heads_together(d) + head) * row_chunks(d) + chunk;
  }

  static TaskRows task(const AttentionDims& d, int64_t item) {
    const int64_t b_hkv = item / row_chunks(d), chunk = item % row_chunks(d);
    const int64_t b = b_hkv / d.heads_kv, first_row = chunk * kMaxTaskRows;
    const int64_t rows_per_head = d.rows_q(b);
    return {b, b_hkv % d.heads_kv, first_row,
            std::min(kMaxTaskRows, d.group() * rows_per_head - first_row), rows_per_head};
  }
};

}  // namespace causal_attention::cpu::CPU_CAPABILITY
