// A key block's value rows laid out for the decode's products that take two keys at once (the
// int8 rows' integer products, integer_products.h, and the float8 rows' bfloat16 pair products,
// float8_pair_values.h): each key's row in key order, and for each key the next block's row to
// request as the key's pair is reached; and the task's weights those products take.
//
// The requests come from this list, pair by pair inside the products' loop, rather than from a
// call there (StreamAhead's, by run): a call in the loop kept the tile's sixteen accumulators in
// memory across it (docs/benchmarks, stop 70).
//
// Included only by the per-instruction-set kernel sources (see geometry.h).
#pragma once

#include "register_tiles.h"
#include "scratch_vector.h"

#include <c10/macros/Macros.h>

#include <cstdint>
#include <cstring>
#include <vector>

namespace causal_attention::cpu::CPU_CAPABILITY {

template <typename row_t>
struct PairedValueRows {
  // keys + 1 each: an odd count's last pair takes row `cols` (gather) as its second, zero_row,
  // whose weight the caller sets to zero
  std::vector<const row_t*> rows;
  std::vector<const char*> next_rows;  // null: none to request
  int64_t row_bytes = 0;               // of a next row
  // dim_v zeros: a copy of the last row, weighted zero, would give 0 x inf = NaN where that row
  // holds an infinity (e5m2's)
  std::vector<row_t> zero_row;

  PairedValueRows(int64_t keys, int64_t dim_v)
      : rows(keys + 1), next_rows(keys + 1), zero_row(dim_v) {}

  // Lays out the first `cols` (> 0) rows of v's runs, and with v's streams the next block's row
  // each key stands for (key k of a run for the run's share of the next rows at k); returns the
  // number of pairs.
  int64_t gather(const RunRows<row_t>& v, int64_t cols) {
    for (int64_t i = 0; i < v.num_runs; ++i) {
      const RowRun<row_t>& run = v.runs[i];
      for (int64_t k = 0; k < run.count && run.offset + k < cols; ++k) {
        rows[run.offset + k] = run.first + k * v.ld;
      }
      if (v.streams != nullptr) {
        const StreamAhead::Rows& next = v.streams[i].next_values;
        row_bytes = next.row_bytes;
        for (int64_t k = 0; k < run.count && run.offset + k < cols; ++k) {
          const int64_t row = next.count == run.count ? k : next.count * k / run.count;
          next_rows[run.offset + k] =
              row < next.count ? next.data + row * next.stride_bytes : nullptr;
        }
      }
    }
    rows[cols] = zero_row.data();
    next_rows[cols] = nullptr;
    return (cols + 1) / 2;
  }

  // Requests key j's next row, a line at a time.
  C10_ALWAYS_INLINE void request(int64_t j) const {
    if (const char* row = next_rows[j]; row != nullptr) {
      StreamAhead::request_row(row, row_bytes);
    }
  }
};

// A task's scratch for the pair products of a key block's values: each of its rows' weights of
// the block in weight_t (`ld` apart, with room for an odd count's zero weight), and the block's
// value rows.
template <typename weight_t, typename row_t>
struct PairWeights {
  int64_t ld;
  ScratchVector<weight_t> weights;
  PairedValueRows<row_t> rows;
  PairWeights(int64_t task_rows, int64_t keys, int64_t dim_v)
      : ld(keys + 2), weights(task_rows * (keys + 2)), rows(keys, dim_v) {}
  weight_t* row_weights(int64_t r) { return weights.data() + r * ld; }
};

// Key pair t's two 16-bit weights of a row w, w[2t] in the low half and w[2t + 1] in the high: the
// lane a pair product broadcasts against the two keys' interleaved values.
template <typename weight_t>
C10_ALWAYS_INLINE int32_t weight_pair(const weight_t* w, int64_t t) {
  static_assert(sizeof(weight_t) == 2);
  int32_t pair;
  std::memcpy(&pair, w + 2 * t, sizeof(pair));
  return pair;
}

}  // namespace causal_attention::cpu::CPU_CAPABILITY
