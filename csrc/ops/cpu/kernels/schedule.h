// The schedule: the block shape a kernel takes (chosen in ../block_shapes.h), how work is cut
// into tasks, key splits, and the causal load balance. Every choice here depends on the shapes and
// the CPU only, never on the thread count, and each output element is summed by one task in a fixed
// order: results are bitwise identical at any thread count, with no atomics and no scratch indexed
// by thread number.
#pragma once

#include "../block_gemm.h"
#include "../block_shapes.h"
#include "geometry.h"

#include <ATen/Parallel.h>

#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

namespace causal_attention::cpu::CPU_CAPABILITY {

// The block shape of a kernel whose products of two inputs take gemm_t (block_shapes.h).
template <typename gemm_t>
BlockSizes block_sizes(const AttentionDims& d) {
  return cpu::block_sizes(d.head_dim, d.value_dim, d.keys_seen(), d.windowed(),
                          c10::CppTypeToScalarType<gemm_t>::value);
}

// Query rows of a forward task: several query blocks, which take each key block in turn while
// it is in cache, so that K and V stream from memory (or a shared L3) once per tile rather than
// once per query block. Long sequences only, where the rows of a head's K and V outgrow L2 and
// there are still tiles enough to balance.
inline int64_t forward_tile_rows(const AttentionDims& d, const BlockSizes& blocks) {
  return d.len_q >= 1024 ? 4 * blocks.query_rows : blocks.query_rows;
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

// As for_each_head_block, for work items of uneven cost (packed sequences of different lengths,
// key masks that hide whole blocks): cost(head, block) estimates an item's work, zero for an
// item with nothing to do, which is skipped. The balanced order is cut into one range of equal
// total cost per thread. Which task runs an item changes no sum inside it, so results still do
// not depend on the thread count.
template <typename Cost, typename MakeScratch, typename Fn>
void for_each_weighted_head_block(int64_t num_heads, int64_t num_blocks, const Cost& cost,
                                  const MakeScratch& make_scratch, const Fn& fn) {
  const int64_t items = num_heads * num_blocks;
  const auto item_at = [&](int64_t i) {
    return std::pair<int64_t, int64_t>{i / num_blocks, balanced_block(i % num_blocks, num_blocks)};
  };
  std::vector<double> cost_before(items + 1, 0.0);
  for (int64_t i = 0; i < items; ++i) {
    const auto [head, block] = item_at(i);
    cost_before[i + 1] = cost_before[i] + double(cost(head, block));
  }
  const int64_t parts = std::min<int64_t>(at::get_num_threads(), items);
  const auto first_item = [&](int64_t part) {
    const double from = cost_before[items] * double(part) / double(parts);
    return int64_t(std::lower_bound(cost_before.begin(), cost_before.end() - 1, from) -
                   cost_before.begin());
  };
  at::parallel_for(0, parts, 1, [&](int64_t begin, int64_t end) {
    auto scratch = make_scratch();
    for (int64_t part = begin; part < end; ++part) {
      const int64_t last = part + 1 == parts ? items : first_item(part + 1);
      for (int64_t i = first_item(part); i < last; ++i) {
        if (cost_before[i + 1] > cost_before[i]) {
          const auto [head, block] = item_at(i);
          fn(head, block, scratch);
        }
      }
    }
    block_gemm_release();
  });
}

// The kernels' schedule: dense calls take for_each_head_block (whose balanced order evens out
// the causal cost), ragged ones (packed sequences, a key mask) weigh their items by `cost`.
template <typename Cost, typename MakeScratch, typename Fn>
void schedule_head_blocks(const AttentionDims& d, int64_t num_heads, int64_t num_blocks,
                          const Cost& cost, const MakeScratch& make_scratch, const Fn& fn) {
  if (d.cu_q || d.key_mask) {
    for_each_weighted_head_block(num_heads, num_blocks, cost, make_scratch, fn);
  } else {
    for_each_head_block(num_heads, num_blocks, make_scratch, fn);
  }
}

// Up to this many query rows the forward decodes (decode.h). Decoding measured faster than the
// block path up to 64 rows against a 4096-key cache; 32 keeps the rows one task carries (the GQA
// group times this) small enough for its scores and outputs to stay in L1/L2.
constexpr int64_t kMaxDecodeQueryRows = 32;
inline bool forward_decodes(const AttentionDims& d) {
  return d.len_q <= kMaxDecodeQueryRows;
}

// The longest chain of k a score is summed in where few query rows (decoding, and the backward
// of such calls) make the cost small and a peaked softmax likely: the decode path's transposed
// scores (row_products.h) and, there, score_chain.
constexpr int64_t kShortScoreChain = 32;

// The longest chain of k the scores S = Q K^T (and the backward's dP = dO V^T) are summed in
// (multiply_in_chains, operands.h): the same in the forward's block path and the backward, so
// that both compute the same scores. kScoreChain keeps D <= 64 to one product and costs D = 128
// one more (measured 2-4 % of a float32 call at L = 2048); where the forward decoded,
// kShortScoreChain.
constexpr int64_t kScoreChain = 64;
inline int64_t score_chain(const AttentionDims& d) {
  return forward_decodes(d) ? kShortScoreChain : kScoreChain;
}

// Fewer work items than this and the forward splits the keys of each item into chunks computed
// by separate tasks, merged afterwards in chunk order (split_combine.h).
constexpr int64_t kMinItemsWithoutSplit = 32;
// Keys per split: long enough that the merge is negligible next to the split's own work.
constexpr int64_t kKeysPerSplit = 1024;
// The partial results of the splits (a float32 output row, max and sum per query row and split)
// may add at most this share of the call's inputs and output to its memory.
constexpr double kSplitMemoryShare = 0.05;

// How many chunks the keys of each of `items` work items are cut into.
inline int64_t key_splits(const AttentionDims& d, int64_t items, int64_t element_bytes) {
  if (items >= kMinItemsWithoutSplit) {
    return 1;
  }
  const int64_t rows = d.batch * d.heads_q * d.len_q;
  const double call_bytes =
      double(element_bytes) * (d.batch * d.heads_kv * d.len_k * (d.head_dim + d.value_dim) +
                               rows * (d.head_dim + d.value_dim));
  const double bytes_per_split = 4.0 * rows * (d.value_dim + 2);
  const auto affordable = int64_t(kSplitMemoryShare * call_bytes / bytes_per_split);
  return std::clamp<int64_t>(affordable, 1, std::max<int64_t>(1, ceil_div(d.len_k, kKeysPerSplit)));
}

// Key blocks a one-pass backward task takes at once (attention_backward_kernel.cpp): as many as
// keep their packed K^T, V^T and dK, dV accumulators (float32) within half of L2, at most
// kMaxKeyTileBlocks.
constexpr int64_t kMaxKeyTileBlocks = 8;
inline int64_t backward_key_tile_blocks(const AttentionDims& d, const BlockSizes& blocks) {
  static const int64_t l2_bytes = cache_bytes(_SC_LEVEL2_CACHE_SIZE, 512 * 1024);
  const int64_t bytes_per_block =
      2 * blocks.keys * (d.head_dim + d.value_dim) * int64_t(sizeof(float));
  return std::clamp<int64_t>(l2_bytes / 2 / bytes_per_block, 1, kMaxKeyTileBlocks);
}

// The backward runs in one pass over the blocks of each (batch, KV head) when there are at least
// this many of them to share between threads (see attention_backward_kernel.cpp).
constexpr int64_t kMinOnePassItems = 8;

}  // namespace causal_attention::cpu::CPU_CAPABILITY
