// The block path of the forward, FlashAttention-2 style: K (and V where it needs packing) is
// packed once per call (packed_kv.h), a group of (batch, KV head) pairs at a time, whose query
// tiles run while their copies are in cache; one task owns a (batch, query head, query tile, key
// split) and walks its visible key blocks in order, each key block serving the tile's query
// blocks one after the other while it is in cache, with an online softmax per row
// (online_softmax.h). Nothing of size Lq x Lk is ever allocated. Few query rows against a long
// cache take the decode path instead (decode.h); the kernels choose. K and V rows come from
// KeyRows, a tensor's or a paged cache's (the packing reads the pages in place, page by page).
#pragma once

#include "attn_mask_view.h"
#include "geometry.h"
#include "non_finite_guard.h"
#include "online_softmax.h"
#include "operands.h"
#include "packed_kv.h"
#include "row_sources.h"
#include "schedule.h"
#include "scratch_vector.h"
#include "split_combine.h"

#include <ATen/OpMathType.h>

#include <type_traits>
#include <vector>

namespace causal_attention::cpu::CPU_CAPABILITY {

template <typename scalar_t, typename gemm_t, typename KeyRows = HeadRows<const scalar_t>>
class BlockForward {
  using acc_t = at::opmath_type<scalar_t>;
  using Pack = Packing<gemm_t>;
  using ValuePack = Packing<acc_t>;
  // bfloat16 inputs multiply P V with P as (hi, lo) pairs (operands.h): natively one bfloat16
  // product against V's value pairs, widened P = hi + lo against V in float32. A tensor's own
  // rows only: a paged cache's V (packed run by run) and an 8-bit cache's (widened with its
  // scales, not bfloat16 values) keep P in float32.
  static constexpr bool kSplitsProbabilities =
      std::is_same_v<scalar_t, c10::BFloat16> && KeyRows::kOneRun && !KeyRows::kWidens;
  static constexpr bool kValuePairs = kSplitsProbabilities && std::is_same_v<gemm_t, scalar_t>;
  using Packed = PackedKeyValues<scalar_t, gemm_t,
                                 kValuePairs ? ValueOperand::kPairs : ValueOperand::kRows, KeyRows>;
  // The value rows the non-finite guard reads: V's own where they lie at one stride, else their
  // packed copy (widened: a non-finite value stays so).
  using value_row_t = std::conditional_t<KeyRows::kOneRun, scalar_t, acc_t>;

 public:
  BlockForward(const AttentionDims& d, const HeadRows<const scalar_t>& q, const KeyRows& k,
               const KeyRows& v, const OutputRows<scalar_t, acc_t>& output,
               const ScoreModifiers<acc_t>& modifiers)
      : dims_(d),
        blocks_(block_sizes<gemm_t>(dims_)),
        tile_rows_(forward_tile_rows(dims_, blocks_)),
        q_(q),
        k_(k),
        v_(v),
        modifiers_(modifiers),
        output_(output) {}

  void run() const {
    const int64_t num_heads = dims_.batch * dims_.heads_q;
    const int64_t num_tiles = ceil_div(dims_.len_q, tile_rows_);
    KeySplits<scalar_t, acc_t> splits(
        dims_, key_splits(dims_, num_heads * num_tiles, sizeof(scalar_t)), output_);
    Packed packed(dims_, k_, v_, blocks_.keys);
    // An item's cost: its visible pairs (under attn_mask, those of the block pairs it
    // computes, whose tiles say what it hides), plus one per row for finishing it; zero only
    // for the items past the end of a packed sequence, which have no rows (every row is
    // written, even one that sees no key).
    const auto cost = [&](int64_t bh, int64_t item) -> int64_t {
      const int64_t b = bh / dims_.heads_q, t0 = item / splits.count() * tile_rows_;
      const int64_t rows = std::min(tile_rows_, dims_.rows_q(b) - t0);
      if (rows <= 0) {
        return 0;
      }
      const auto [key_begin, key_end] = tile_keys(b, t0, rows, item % splits.count(), splits);
      if (dims_.attn_mask.absent()) {
        return rows + dims_.visible_pairs(b, t0, t0 + rows, key_begin, key_end);
      }
      int64_t pairs = rows;
      for_each_block_pair(
          b, bh % dims_.heads_q, t0, rows, key_begin, key_end,
          [&](int64_t, int64_t block_rows, int64_t, int64_t cols) { pairs += block_rows * cols; });
      return pairs;
    };
    // Pair p's blocks serve query heads p * group to (p + 1) * group - 1.
    const int64_t group = dims_.group(), items_per_head = num_tiles * splits.count();
    packed.pack_in_groups(group * items_per_head, [&](int64_t first, int64_t last) {
      const int64_t head0 = first * group;
      schedule_head_blocks(
          dims_, (last - first) * group, items_per_head,
          [&](int64_t head, int64_t item) { return cost(head0 + head, item); },
          [this] { return Scratch(dims_, blocks_, tile_rows_); },
          [&](int64_t head, int64_t item, Scratch& s) {
            query_tile(head0 + head, item / splits.count() * tile_rows_, item % splits.count(),
                       packed, splits, s);
          });
    });
    splits.merge();
  }

 private:
  struct Scratch {
    ScratchVector<gemm_t> q_tile;
    ScratchVector<acc_t> v_tile, scores;  // v_tile: a block the guard cleaned (not kValuePairs)
    ScratchVector<acc_t> partial;  // the last chain of the scores (multiply_in_chains_but_last)
    // P as (hi, lo) pairs (kValuePairs), and the value pairs of a block the guard cleaned (sized
    // when one is).
    ScratchVector<gemm_t> probability_pairs, value_pairs;
    // The keys of the current block each row of a query block sees: [first_visible, visible).
    std::vector<int64_t> first_visible, visible;
    std::vector<MaskRow<acc_t>> mask_rows;  // and the attn_mask row of each, where it is read
    NonFiniteRowGuard<value_row_t> v_guard;
    RowState<acc_t> state;  // every row of the tile
    Scratch(const AttentionDims& d, const BlockSizes& blocks, int64_t tile_rows)
        : q_tile(Pack::scratch_size(tile_rows, d.head_dim)),
          v_tile(kValuePairs ? 0 : blocks.keys * d.value_dim),
          scores(blocks.query_rows * blocks.keys),
          partial(blocks.query_rows * blocks.keys),
          probability_pairs(kValuePairs ? blocks.query_rows * blocks.keys * 2 : 0),
          first_visible(blocks.query_rows),
          visible(blocks.query_rows),
          mask_rows(blocks.query_rows),
          state(tile_rows, d.value_dim) {}
  };

  // The keys of chunk `split` that query rows [t0, t0 + rows) of batch item b see, from the
  // first key block any of them sees.
  std::pair<int64_t, int64_t> tile_keys(int64_t b, int64_t t0, int64_t rows, int64_t split,
                                        const KeySplits<scalar_t, acc_t>& splits) const {
    const int64_t first_block = dims_.key_begin(b, t0) / blocks_.keys * blocks_.keys;
    return splits.key_range(split, first_block, dims_.key_end(b, t0 + rows - 1));
  }

  // Calls fn(q0, rows, k0, cols) for the block pairs of query rows [t0, t0 + rows) of (b, h)
  // against keys [key_begin, key_end) that are computed, key block after key block, each
  // serving the tile's query blocks in turn while it is in cache. Blocks outside the window of
  // every row of the query block, or that the key mask or attn_mask hides entirely, are
  // skipped, and the rows (keys) that attn_mask hides from every key (row) of a block are left
  // out of it, by whole tiles from either end.
  template <typename Fn>
  void for_each_block_pair(int64_t b, int64_t h, int64_t t0, int64_t rows, int64_t key_begin,
                           int64_t key_end, const Fn& fn) const {
    for (int64_t k0 = key_begin; k0 < key_end; k0 += blocks_.keys) {
      for (int64_t q0 = t0; q0 < t0 + rows; q0 += blocks_.query_rows) {
        const int64_t block_rows = std::min(blocks_.query_rows, t0 + rows - q0);
        const int64_t block_key_end = std::min(key_end, dims_.key_end(b, q0 + block_rows - 1));
        const int64_t cols = std::min(blocks_.keys, block_key_end - k0);
        if (cols > 0 && k0 + cols > dims_.key_begin(b, q0) && dims_.kept_keys(b, k0, cols) > 0) {
          dims_.for_each_part(b, h, q0, block_rows, k0, cols, fn);
        }
      }
    }
  }

  // Query rows [t0, t0 + tile_rows_) of head bh against the keys of chunk `split`.
  void query_tile(int64_t bh, int64_t t0, int64_t split, const Packed& packed,
                  KeySplits<scalar_t, acc_t>& splits, Scratch& s) const {
    const int64_t b = bh / dims_.heads_q, h = bh % dims_.heads_q;
    const int64_t rows = std::min(tile_rows_, dims_.rows_q(b) - t0);
    const auto [key_begin, key_end] = tile_keys(b, t0, rows, split, splits);
    s.state.reset(rows);
    const Operand<gemm_t> q_rows =
        Pack::a(q_.row(b, h, t0), rows, dims_.head_dim, q_.row_stride, s.q_tile.data());
    for_each_block_pair(b, h, t0, rows, key_begin, key_end,
                        [&](int64_t q0, int64_t block_rows, int64_t k0, int64_t cols) {
                          const Operand<gemm_t> q_block{q_rows.data + (q0 - t0) * q_rows.ld,
                                                        q_rows.ld};
                          key_block(b, h, q_block, q0, q0 - t0, block_rows, k0, cols, packed, s);
                        });
    for (int64_t r = 0; r < rows; ++r) {
      splits.emit(s.state, r, bh, t0 + r, split);
    }
  }

  // One query block of head h (rows [q0, q0 + rows), state rows from first_state_row) against
  // the `cols` keys from k0.
  void key_block(int64_t b, int64_t h, Operand<gemm_t> q_block, int64_t q0, int64_t first_state_row,
                 int64_t rows, int64_t k0, int64_t cols, const Packed& packed, Scratch& s) const {
    const int64_t h_kv = h / dims_.group();
    // S = Q_i K_j^T, its last chain of the head dim added row by row below
    const bool last_chain_left =
        multiply_in_chains_but_last(rows, cols, dims_.head_dim, q_block, packed.keys_t(b, h_kv, k0),
                                    s.scores.data(), cols, score_chain(dims_), s.partial.data());
    // x = the modified scores; m' = max(m, rowmax(x)); P = exp(x - m');
    // l = e^(m-m') l + rowsum(P); O = e^(m-m') O. Each row is finished while it is in L1: its
    // last chain added as the fold reads it, its P split into (hi, lo) pairs last (kValuePairs).
    const BlockMasks masks = dims_.block_masks(b, h, q0, rows, k0, cols);
    for (int64_t r = 0; r < rows; ++r) {
      const KeyRange range = dims_.visible_in_block(b, q0 + r, k0, cols);
      s.first_visible[r] = range.begin;
      s.visible[r] = range.end;
      acc_t* row = s.scores.data() + r * cols;
      const RowScoring<acc_t> scoring = modifiers_.row(dims_, b, h, q0 + r, k0, masks);
      s.mask_rows[r] = scoring.mask;
      s.state.fold_row(row, first_state_row + r, range, cols, scoring,
                       last_chain_left ? s.partial.data() + r * cols : nullptr);
      if constexpr (kValuePairs) {
        split_into_pairs(row, cols, s.probability_pairs.data() + r * 2 * cols);
      }
    }
    // O += P V_j
    accumulate_values(b, h_kv, q0, rows, k0, cols, masks, packed,
                      s.state.out.data() + first_state_row * dims_.value_dim, s);
  }

  // O += P V_j, with P in s.scores (float32 for every input dtype, V widened to it:
  // backward_block_pair.h says why; bfloat16's as (hi, lo) pairs, kSplitsProbabilities); V_j is
  // the packed block unless the guard cleaned it.
  void accumulate_values(int64_t b, int64_t h_kv, int64_t q0, int64_t rows, int64_t k0,
                         int64_t cols, const BlockMasks& masks, const Packed& packed, acc_t* out,
                         Scratch& s) const {
    const bool has_masked_entries = dims_.has_masked_entries(b, q0, rows, k0, cols, masks);
    const MaskedFactor<acc_t> factor{
        s.scores.data(),      cols,       s.first_visible.data(),
        s.visible.data(),
        /*transposed=*/false, masks.kept, masks.attn_mask ? s.mask_rows.data() : nullptr};
    if constexpr (kValuePairs) {
      const Operand<gemm_t> p_pairs{s.probability_pairs.data(), 2 * cols};
      const Operand<scalar_t> v_rows{v_.row(b, h_kv, k0), v_.row_stride};
      s.v_guard.multiply_add_by(
          has_masked_entries, rows, dims_.value_dim, cols, factor, v_rows,
          [&](Operand<scalar_t> source) {
            Operand<gemm_t> v_pairs;
            if (source.data == v_rows.data) {
              v_pairs = packed.value_pairs(b, h_kv, k0);
            } else {
              s.value_pairs.resize(cols * dims_.value_dim * 2);
              v_pairs = Pack::b_value_pairs(source.data, cols, dims_.value_dim, source.ld,
                                            s.value_pairs.data());
            }
            multiply(rows, dims_.value_dim, 2 * cols, p_pairs, v_pairs, out, dims_.value_dim,
                     /*accumulate=*/true);
          },
          out, dims_.value_dim);
    } else {
      if constexpr (kSplitsProbabilities) {
        round_to_pairs(s.scores.data(), rows * cols);
      }
      const Operand<acc_t> p{s.scores.data(), cols};
      Operand<value_row_t> v_rows;
      if constexpr (KeyRows::kOneRun) {
        v_rows = {v_.row(b, h_kv, k0), v_.row_stride};
      } else {
        v_rows = packed.values(b, h_kv, k0);
      }
      const auto pack_values = [&](Operand<value_row_t> source) {
        if (source.data == v_rows.data) {
          return packed.values(b, h_kv, k0);
        }
        return ValuePack::b(source.data, cols, dims_.value_dim, source.ld, s.v_tile.data());
      };
      s.v_guard.multiply_add(has_masked_entries, rows, dims_.value_dim, cols, p, factor, v_rows,
                             pack_values, out, dims_.value_dim);
    }
  }

  const AttentionDims dims_;
  const BlockSizes blocks_;
  const int64_t tile_rows_;
  const HeadRows<const scalar_t> q_;
  const KeyRows k_, v_;
  const ScoreModifiers<acc_t> modifiers_;
  const OutputRows<scalar_t, acc_t> output_;
};

}  // namespace causal_attention::cpu::CPU_CAPABILITY
