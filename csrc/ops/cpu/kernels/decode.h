// The decode path of the forward: a few query rows (new tokens) against a long KV cache. One
// task owns a (batch, KV head, key split) and carries every query row of every query head that
// shares the KV head (the GQA group) through the keys at once, with the register products of
// row_products.h on K and V rows read in place, so that K and V stream from memory once. Only a
// group of hundreds of heads (its rows then make the products compute-bound) is cut into
// several tasks of at most kMaxTaskRows rows, so that a task's scratch stays small. K and V rows
// come from KeyRows: a tensor's (HeadRows) or a paged cache's (PagedRows, whose pages cut a key
// block's products into runs, one a page or a stretch of pages that follow one another). Where
// KeyRows interleaves the heads' rows (a page), a task carries every KV head of its sequence
// through each key block instead (heads_together). Rows of an 8-bit cache (ScaledPagedRows,
// quantized_rows.h) are read in place too, widened in registers as bfloat16 rows are (int8 rows
// against bfloat16 or float16 query rows: multiplied as integers, integer_products.h; float8
// value rows against bfloat16 ones: by bfloat16 pair products, float8_pair_values.h);
// their scales are folded into the scores (K's) and into the probabilities the values are
// weighted by (V's), one multiply a key.
#pragma once

#include "../block_shapes.h"
#include "attn_mask_view.h"
#include "decode_tasks.h"
#include "float8_pair_values.h"
#include "geometry.h"
#include "integer_products.h"
#include "non_finite_guard.h"
#include "online_softmax.h"
#include "operands.h"
#include "row_products.h"
#include "row_sources.h"
#include "schedule.h"
#include "scratch_vector.h"
#include "split_combine.h"

#include <ATen/OpMathType.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <utility>
#include <vector>

namespace causal_attention::cpu::CPU_CAPABILITY {

template <typename scalar_t, typename KeyRows = HeadRows<const scalar_t>>
class DecodeForward {
  using acc_t = at::opmath_type<scalar_t>;
  using Tasks = DecodeTasks<KeyRows>;
  using TaskRows = typename Tasks::TaskRows;
  // The K and V rows the products read, in place.
  using kv_t = typename KeyRows::row_t;
  // What the block products of many-row tasks multiply (multiplies_blocks): q's dtype, which
  // their K rows then share (bfloat16 and float16 natively where the CPU can, block_gemm.h).
  using gemm_t = scalar_t;
  using Pack = Packing<gemm_t>;
  using ValueRequests = StreamAhead::ValueRequests;

 public:
  DecodeForward(const AttentionDims& d, const HeadRows<const scalar_t>& q, const KeyRows& k,
                const KeyRows& v, const OutputRows<scalar_t, acc_t>& output,
                const ScoreModifiers<acc_t>& modifiers)
      : dims_(d),
        q_(q),
        k_(k),
        v_(v),
        output_(output),
        modifiers_(modifiers),
        native_products_(kReducedRows &&
                         native_products_now(c10::CppTypeToScalarType<scalar_t>::value)),
        pair_dots_(kBFloat16PairDots && native_products_now(at::kBFloat16) && pair_dots_here() &&
                   pair_dots_fit<kv_t>(d.head_dim)),
        integer_scores_(kIntegerQueryRows && integer_scores_fit(d.head_dim)),
        integer_values_(kIntegerQueryRows && integer_values_fit(d.value_dim)),
        float8_pair_values_(kFloat8Values && native_products_now(at::kBFloat16) &&
                            float8_pair_values_fit(d.value_dim)),
        values_apart_here_(products_on_tiles(at::kBFloat16)) {}

  void run() const {
    const int64_t items =
        dims_.batch * dims_.heads_kv / Tasks::heads_together(dims_) * Tasks::row_chunks(dims_);
    KeySplits<scalar_t, acc_t> splits(
        dims_, key_splits(dims_, items, sizeof(typename KeyRows::stored_t)), output_);
    // An item's cost: its rows times (one more than) the keys they reach; zero for a chunk past
    // the rows of its (batch, KV head), which has nothing to do.
    const auto cost = [&](int64_t item, int64_t split) -> int64_t {
      const TaskRows t = Tasks::task(dims_, Tasks::head_item(dims_, item, 0));
      if (t.rows <= 0) {
        return 0;
      }
      const auto [key_begin, key_end] = task_keys(t, split, splits);
      const int64_t keys =
          key_end > key_begin ? dims_.kept_keys(t.b, key_begin, key_end - key_begin) : 0;
      return Tasks::heads_together(dims_) * t.rows * (1 + keys);
    };
    const auto make_scratch = [this] {
      std::vector<Scratch> scratch;
      scratch.reserve(Tasks::heads_together(dims_));
      for (int64_t h = 0; h < Tasks::heads_together(dims_); ++h) {
        scratch.emplace_back(dims_, multiplies_blocks(Tasks::task_rows(dims_)));
      }
      return scratch;
    };
    schedule_head_blocks(dims_, items, splits.count(), cost, make_scratch,
                         [&](int64_t item, int64_t split, std::vector<Scratch>& s) {
                           run_item(item, split, splits, s);
                         });
    splits.merge();
  }

 private:
  // Keys per block: every query row of the task passes over these K and V rows (32 KiB in
  // float32 at D = 64) while the next block's are requested. Measured on a Zen 4 (paged decode,
  // 4 rows a KV head, D 128, 1 thread): 32 and 64 keys 7-10 % faster than 128, the same as each
  // other in bfloat16; 64 keeps the per-block work of many-row groups (MLA's 128 heads) small.
  // On a Zen 5 (B 8, 2 threads) 128 keys ran faster in cache and slower from memory (a paged
  // block of every KV head's K and V rows, with the next one requested, is then 1 MiB in
  // bfloat16, that chip's L2), 32 slower in cache and no faster from memory (stop 65).
  static constexpr int64_t kKeyBlock = 64;

  // A task of at least this many rows multiplies each key block through block_gemm
  // (multiplies_blocks): so many rows (MLA's 16-128 absorbed heads, a verified chunk's rows times
  // its group) make the scores compute-bound, where the CPU's own bfloat16/float16 products run
  // twice as fast as the register products' float32 ones.
  static constexpr int64_t kMinBlockProductRows = 16;
  // Whether the rows are bfloat16 or float16 in q's dtype, which the block products then take as
  // they are. float32 rows gain nothing from them (slower in a trial on a Zen 4, a verify step
  // reading its rows from memory); 8-bit rows keep the register products, which fold the rows'
  // scales in.
  static constexpr bool kReducedRows =
      std::is_same_v<kv_t, scalar_t> &&
      (std::is_same_v<scalar_t, c10::BFloat16> || std::is_same_v<scalar_t, c10::Half>);
  // Whether bfloat16 query rows may score K rows by bfloat16 dot products (query_key_scores'
  // q_pairs): K rows whose values bfloat16 holds exactly, where the block products of bfloat16
  // are native (so CAUSAL_ATTENTION_REDUCED_PRODUCTS=widened and ONEDNN_MAX_CPU_ISA, which the
  // tests use to run the other chips' path, turn them off too).
  static constexpr bool kBFloat16PairDots =
      std::is_same_v<scalar_t, c10::BFloat16> && kPairDots<acc_t, kv_t>;
  // Whether reduced query rows may take int8 K and V rows by integer products
  // (integer_products.h), the query rows held as int16 (query_integers).
  static constexpr bool kIntegerQueryRows = kIntegerProducts<scalar_t, kv_t>;
  // Whether float8 value rows beside bfloat16 query rows may take the pair products
  // (float8_pair_values.h), where the block products of bfloat16 are native (as kBFloat16PairDots).
  static constexpr bool kFloat8Values = kFloat8PairValues<scalar_t, kv_t>;
  // Whether a task of `rows` rows takes the block products: only where this call's products of
  // two inputs are native (block_gemm.h). Widened, they were slower than the register products
  // in a trial build (MLA's 16 heads, a verify step), which compute the same sums of exact
  // products in another float32 order.
  bool multiplies_blocks(int64_t rows) const {
    return native_products_ && rows >= kMinBlockProductRows;
  }

  // The vector-padded count of `rows` that key_query_scores computes with (query_key_scores
  // serves fewer rows than a vector holds). The scores of the padding rows are discarded.
  static int64_t padded(int64_t rows) {
    constexpr int64_t N = at::vec::Vectorized<acc_t>::size();
    return rows < N ? 0 : ceil_div(rows, N) * N;
  }

  struct Scratch {
    ScratchVector<acc_t> queries, queries_t, keys, scores, scores_t;
    ScratchVector<scalar_t> query_pairs;  // the query rows for pair_dots_ (order_query_pairs)
    // the query rows for integer_scores_ as int16, each times its scale (quantize_row), and
    // whether every row could be held so (finite)
    ScratchVector<int16_t> query_integers;
    ScratchVector<acc_t> query_scales;
    bool integer_rows = false;
    IntegerWeights integer_weights;               // for integer_values_
    Float8PairWeights<kv_t> float8_weights;       // for float8_pair_values_
    std::vector<int64_t> first_visible, visible;  // keys of the current block a row sees
    std::vector<MaskRow<acc_t>> mask_rows;        // and each row's attn_mask, where it is read
    // The runs of K and V rows of the current block and the next (block_runs), and the first key
    // of the next (-1: none found yet in this item), whose runs become the current ones there.
    std::vector<RowRun<kv_t>> key_runs, value_runs, next_key_runs, next_value_runs;
    // The current block's prefetches, one a run (register_scores), and when they request the
    // next block's value rows (StreamAhead::value_requests).
    std::vector<StreamAhead> streams;
    ValueRequests value_requests = ValueRequests::kWithKeys;
    int64_t next_runs_key = -1;
    std::vector<int64_t> run_first, run_visible;  // first_visible, visible relative to a run
    std::vector<MaskRow<acc_t>> run_mask_rows;
    RowState<acc_t> state;
    NonFiniteRowGuard<kv_t> guard;
    // The block's row scales, where KeyRows has them, and its value rows widened once, for many
    // query rows.
    ScratchVector<acc_t> key_scales, value_scales, wide_values;
    // The block products' operands (multiplies_blocks): the task's query rows and K_j^T, and one
    // chain's scores (multiply_in_chains). A scratch that has them keeps the register products'
    // too: an item's task may have fewer rows than the largest (a group's last chunk, a sequence
    // with fewer new tokens) and take the register products.
    ScratchVector<gemm_t> query_operand, keys_t;
    ScratchVector<acc_t> partial;
    TaskRows task{};  // the rows this scratch serves in the current item
    Scratch(const AttentionDims& d, bool block_products)
        : queries(Tasks::task_rows(d) * d.head_dim),
          queries_t(padded(Tasks::task_rows(d)) * d.head_dim),
          keys(kKeyBlock * d.head_dim),
          scores(Tasks::task_rows(d) * kKeyBlock),
          scores_t(padded(Tasks::task_rows(d)) * kKeyBlock),
          query_pairs(kBFloat16PairDots ? Tasks::task_rows(d) * d.head_dim : 0),
          query_integers(kIntegerQueryRows ? Tasks::task_rows(d) * d.head_dim : 0),
          query_scales(kIntegerQueryRows ? Tasks::task_rows(d) : 0),
          integer_weights(kIntegerQueryRows ? Tasks::task_rows(d) : 0,
                          kIntegerQueryRows ? kKeyBlock : 0, kIntegerQueryRows ? d.value_dim : 0),
          float8_weights(kFloat8Values ? Tasks::task_rows(d) : 0, kFloat8Values ? kKeyBlock : 0,
                         kFloat8Values ? d.value_dim : 0),
          first_visible(Tasks::task_rows(d)),
          visible(Tasks::task_rows(d)),
          mask_rows(Tasks::task_rows(d)),
          run_first(Tasks::task_rows(d)),
          run_visible(Tasks::task_rows(d)),
          run_mask_rows(Tasks::task_rows(d)),
          state(Tasks::task_rows(d), d.value_dim),
          key_scales(kScaled ? kKeyBlock : 0),
          value_scales(kScaled ? kKeyBlock : 0),
          wide_values(kWidensValues && padded(Tasks::task_rows(d)) > 0 ? kKeyBlock * d.value_dim
                                                                       : 0) {
      if (block_products) {
        query_operand.resize(Tasks::task_rows(d) * Pack::padded_k(d.head_dim));
        keys_t.resize(Pack::padded_k(d.head_dim) * kKeyBlock);
        partial.resize(Tasks::task_rows(d) * kKeyBlock);
      }
    }
  };

  // The keys of chunk `split` that the task's rows see, from the first key block one of them
  // sees.
  std::pair<int64_t, int64_t> task_keys(const TaskRows& t, int64_t split,
                                        const KeySplits<scalar_t, acc_t>& splits) const {
    int64_t first_key = dims_.rows_k(t.b);
    for (int64_t r = 0; r < t.rows; ++r) {
      first_key = std::min(first_key, dims_.key_begin(t.b, t.query_row(r)));
    }
    int64_t key_end = 0;
    for (int64_t r = 0; r < t.rows; ++r) {
      key_end = std::max(key_end, dims_.key_end(t.b, t.query_row(r)));
    }
    return splits.key_range(split, first_key / kKeyBlock * kKeyBlock, key_end);
  }

  // The rows of the item's heads (scratch[h] for the h-th) against the keys of one split, key
  // block after key block, each block serving every head in turn. The heads' rows see the same
  // keys (their query rows are the same), so each head's sums run as its own task's would.
  void run_item(int64_t item, int64_t split, KeySplits<scalar_t, acc_t>& splits,
                std::vector<Scratch>& scratch) const {
    const TaskRows first = Tasks::task(dims_, Tasks::head_item(dims_, item, 0));
    if (first.rows <= 0) {
      return;
    }
    const int64_t D = dims_.head_dim;
    for (int64_t h = 0; h < Tasks::heads_together(dims_); ++h) {
      Scratch& s = scratch[h];
      const TaskRows& t = s.task = Tasks::task(dims_, Tasks::head_item(dims_, item, h));
      if (multiplies_blocks(t.rows)) {  // the block products' operand only
        const int64_t padded_dim = Pack::padded_k(D);
        for (int64_t r = 0; r < t.rows; ++r) {
          gemm_t* row = s.query_operand.data() + r * padded_dim;
          convert_row(q_.row(t.b, t.head(r, dims_), t.query_row(r)), row, D);
          std::fill(row + D, row + padded_dim, gemm_t(0));
        }
      } else {
        s.integer_rows = (integer_scores_ || integer_values_) && padded(t.rows) == 0;
        for (int64_t r = 0; r < t.rows; ++r) {
          const scalar_t* query = q_.row(t.b, t.head(r, dims_), t.query_row(r));
          convert_row(query, s.queries.data() + r * D, D);
          if constexpr (kIntegerQueryRows) {
            if (s.integer_rows) {
              s.query_scales[r] =
                  quantize_row(s.queries.data() + r * D, D, s.query_integers.data() + r * D);
              s.integer_rows = s.query_scales[r] != 0;
            }
          }
          if constexpr (kBFloat16PairDots) {
            if (pair_dots_) {
              order_query_pairs<kv_t>(query, D, s.query_pairs.data() + r * D);
            }
          }
        }
        if (const int64_t ld = padded(t.rows); ld > 0) {
          transpose_block(s.queries.data(), t.rows, D, D, s.queries_t.data(), ld);
          for (int64_t d = 0; d < D; ++d) {  // the padding rows, whose scores are discarded
            std::fill(s.queries_t.data() + d * ld + t.rows, s.queries_t.data() + (d + 1) * ld,
                      acc_t(0));
          }
        }
      }
      s.state.reset(t.rows);
      s.next_runs_key = -1;
    }
    const auto [key_begin, key_end] = task_keys(first, split, splits);
    for (int64_t k0 = key_begin, cols; k0 < key_end; k0 += cols) {
      cols = block_keys(k0, key_end);
      if (dims_.kept_keys(first.b, k0, cols) > 0) {  // a block the key mask hides is skipped
        for (Scratch& s : scratch) {
          key_block(s.task, k0, cols, key_end, s, &s == &scratch[0] ? nullptr : &scratch[0]);
        }
      }
    }
    for (const Scratch& s : scratch) {
      for (int64_t r = 0; r < s.task.rows; ++r) {
        splits.emit(s.state, r, s.task.b * dims_.heads_q + s.task.head(r, dims_),
                    s.task.query_row(r), split);
      }
    }
  }

  // S = Q K_j^T through the register products (row_products.h), run by run, each run told where
  // the next block's rows lie (the prefetches). Key rows are read in place for fewer rows than a
  // vector holds; with more, each key element is broadcast to many rows and a key block of a
  // reduced dtype is converted once instead (measured faster).
  void register_scores(int64_t rows, int64_t cols, Scratch& s) const {
    const int64_t D = dims_.head_dim;
    size_t next = 0;
    for (size_t i = 0; i < s.key_runs.size(); ++i) {
      const RowRun<kv_t>& run = s.key_runs[i];
      StreamAhead& stream = s.streams.emplace_back(run_stream(s, i, next));
      stream.value_requests = s.value_requests;
      if (padded(rows) > 0) {
        const Operand<acc_t> keys = Packing<acc_t>::a(run.first, run.count, D, k_.row_stride,
                                                      s.keys.data() + run.offset * D);
        key_query_scores(s.queries_t.data(), padded(rows), padded(rows), keys.data, keys.ld,
                         run.count, D, s.scores_t.data() + run.offset * padded(rows), padded(rows),
                         stream);
      } else {
        if constexpr (kIntegerQueryRows) {
          if (s.integer_rows && integer_scores_) {
            query_key_integer_scores(s.query_integers.data(), D, s.query_scales.data(), rows,
                                     run.first, k_.row_stride, run.count, D,
                                     s.scores.data() + run.offset, cols, stream);
            continue;
          }
        }
        const c10::BFloat16* query_pairs = nullptr;
        if constexpr (kBFloat16PairDots) {
          query_pairs = pair_dots_ ? s.query_pairs.data() : nullptr;
        }
        query_key_scores(s.queries.data(), query_pairs, D, rows, run.first, k_.row_stride,
                         run.count, D, s.scores.data() + run.offset, cols, stream);
      }
    }
    if (padded(rows) > 0) {
      transpose_block(s.scores_t.data(), cols, rows, padded(rows), s.scores.data(), cols);
    }
  }

  // When the next block's value rows are requested (StreamAhead::ValueRequests). The values'
  // pass requests them only where its register tiles read them in place (fewer rows than a vector
  // holds, a tile's at least): instead of the scores' pass for rows narrower than float32's on
  // chips where that measured faster (values_apart_here_) and for 8-bit rows everywhere, and
  // again for 16-bit rows elsewhere. On a Zen 5, 16-bit rows asked by the values' pass alone
  // read no faster from memory than asked twice; float32 rows, whose requests need the scores'
  // longer lead, slower (docs/benchmarks, "The value rows requested twice" and "Requests key by
  // key"). The 8-bit decode from memory took 0.95 of its time asked apart, once the values' pass
  // asked four rows at a time (RunRows::kRequestRows).
  ValueRequests value_requests(int64_t rows) const {
    const bool tiles_read_in_place = padded(rows) == 0 && rows >= kValueTileRows &&
                                     dims_.value_dim >= at::vec::Vectorized<acc_t>::size();
    if (!tiles_read_in_place || sizeof(kv_t) == sizeof(float)) {
      return ValueRequests::kWithKeys;
    }
    if (values_apart_here_ || sizeof(kv_t) == 1) {
      return ValueRequests::kApart;
    }
    return ValueRequests::kTwice;
  }

  // The next block's value rows requested at once, where the values' pass was to request them
  // alone but does not read every row of the block through its tiles.
  static void request_values(const Scratch& s) {
    if (s.value_requests == ValueRequests::kApart) {
      for (const StreamAhead& stream : s.streams) {
        stream.at_values(0, stream.keys);
      }
    }
  }

  // S = Q K_j^T through block_gemm (multiplies_blocks): K_j^T packed run by run (a page's rows lie
  // at one stride) into one operand, the head dim summed in chains of kScoreChain, as the block
  // path sums its scores (the short chains of few rows were slower for 128 heads in a trial).
  // Before a run is packed, the next block's rows from the same offset are requested, whole: the
  // packing's transposes read a line of each of 16 rows at once, which the hardware's prefetchers
  // did not follow (with them waiting on memory, MLA's 16 heads ran no faster than on the register
  // products).
  void block_scores(int64_t rows, int64_t cols, Scratch& s) const {
    if constexpr (kReducedRows) {
      const int64_t D = dims_.head_dim;
      size_t next = 0;
      for (size_t i = 0; i < s.key_runs.size(); ++i) {
        const RowRun<kv_t>& run = s.key_runs[i];
        run_stream(s, i, next).at_keys(0, run.count);
        Pack::b_transposed(run.first, run.count, D, k_.row_stride,
                           s.keys_t.data() + Pack::column_offset(run.offset), cols);
      }
      multiply_in_chains(rows, cols, D, Operand<gemm_t>{s.query_operand.data(), Pack::padded_k(D)},
                         Operand<gemm_t>{s.keys_t.data(), cols}, s.scores.data(), cols, kScoreChain,
                         s.partial.data());
    }
  }

  // Whether every row of the task sees every key of the block (the keys are its first `cols`).
  static bool every_row_sees_all(int64_t rows, int64_t cols, const Scratch& s) {
    for (int64_t r = 0; r < rows; ++r) {
      if (s.first_visible[r] != 0 || s.visible[r] != cols) {
        return false;
      }
    }
    return true;
  }

  // O += P V_j through block_gemm (multiplies_blocks), for a block every row sees whole: a key
  // hidden from a row would weigh its value row by zero in the product, and an infinite value
  // would then give NaN. P is float32 and V widened to it (backward_block_pair.h says why), its
  // runs' rows copied into one operand.
  void block_values(int64_t rows, int64_t cols, Scratch& s) const {
    if constexpr (kReducedRows) {
      const int64_t Dv = dims_.value_dim;
      widen_values(s);
      block_gemm(rows, Dv, cols, s.scores.data(), cols, s.wide_values.data(), Dv,
                 s.state.out.data(), Dv, /*accumulate=*/true);
    }
  }

  // The keys of the block from k0: kKeyBlock, fewer at key_end. A block may cross the ends of
  // runs of K/V rows (pages): its products then go run by run (block_runs), while the online
  // softmax's per-block work (the row max, the correction of the running output) and the
  // prefetch distance stay those of a whole block.
  int64_t block_keys(int64_t k0, int64_t key_end) const {
    return std::min(kKeyBlock, key_end - k0);
  }

  // Whether KeyRows' rows come with scales (an 8-bit cache's) that the products leave out.
  static constexpr bool kScaled = has_row_scales_v<KeyRows>;
  // Whether the value rows are of a reduced or 8-bit dtype, widened to acc_t as they are read.
  static constexpr bool kWidensValues = !std::is_same_v<kv_t, acc_t>;
  // Whether the products read e4m3 rows without setting NaN apart (E4M3Over256), which the block
  // then does: each key whose row holds a NaN byte gets NaN scores, as q . k would give, and a
  // block whose value rows hold one takes the guarded values' path, which reads those rows
  // exactly (zeroed in a copy for the products, added back where they are seen).
  static constexpr bool kSetsNaNApart = std::is_same_v<kv_t, E4M3Over256>;

  // Whether the scores of a task of `rows` rows came from the pair dot products, whose byte
  // tables widen e4m3's NaN byte to bfloat16's NaN: a key row holding one then has NaN scores
  // already, as q . k would give.
  bool scores_keep_nan(int64_t rows) const { return pair_dots_ && padded(rows) == 0; }

  // Marks the block's keys whose K row holds a NaN byte with NaN scores, unless scores_keep_nan
  // (which spares the key rows' half of the test's reads: the test was a tenth of an in-cache e4m3
  // decode's samples on a Zen 5). Each run's rows are tested at once; a run with a NaN byte is
  // then searched row by row (rare: a NaN in a cache is a fault upstream).
  void set_nan_keys_apart(const Scratch& s, int64_t rows, int64_t cols, acc_t* scores) const {
    if (scores_keep_nan(rows)) {
      return;
    }
    for (const RowRun<kv_t>& run : s.key_runs) {
      if (!any_e4m3_nan(as_bytes(run.first), run.count, k_.row_stride, dims_.head_dim)) {
        continue;
      }
      for (int64_t j = 0; j < run.count; ++j) {
        if (any_e4m3_nan(as_bytes(run.first + j * k_.row_stride), 1, 0, dims_.head_dim)) {
          for (int64_t r = 0; r < rows; ++r) {
            scores[r * cols + run.offset + j] = std::numeric_limits<acc_t>::quiet_NaN();
          }
        }
      }
    }
  }

  // Whether a value row of the block holds a NaN byte.
  bool any_nan_value_row(const Scratch& s) const {
    for (const RowRun<kv_t>& run : s.value_runs) {
      if (any_e4m3_nan(as_bytes(run.first), run.count, v_.row_stride, dims_.value_dim)) {
        return true;
      }
    }
    return false;
  }
  static const uint8_t* as_bytes(const kv_t* row) {
    static_assert(sizeof(kv_t) == 1);  // strides in rows are strides in bytes
    return reinterpret_cast<const uint8_t*>(row);
  }

  // The block's value rows (its runs') widened to acc_t into s.wide_values, value_dim apart: with
  // as many query rows as a vector holds, the values' 4-row tiles would widen each value vector
  // once a tile (MLA's 16-128 absorbed heads: 4-32 times).
  void widen_values(Scratch& s) const {
    using Vec = at::vec::Vectorized<acc_t>;
    const int64_t Dv = dims_.value_dim;
    for (const RowRun<kv_t>& run : s.value_runs) {
      for (int64_t j = 0; j < run.count; ++j) {
        const kv_t* src = run.first + j * v_.row_stride;
        acc_t* dst = s.wide_values.data() + (run.offset + j) * Dv;
        int64_t c = 0;
        for (; c + Vec::size() <= Dv; c += Vec::size()) {
          load_as<acc_t>(src + c).store(dst + c);
        }
        if (c < Dv) {
          load_as<acc_t>(src + c, Dv - c).store(dst + c, Dv - c);
        }
      }
    }
  }

  // The block's K and V row scales of KV head h_kv of batch item b into the scratch, a page
  // (run) at a time: its scales lie at one stride.
  void block_scales(int64_t b, int64_t h_kv, int64_t k0, Scratch& s) const {
    for (const RowRun<kv_t>& run : s.key_runs) {
      const auto keys = k_.scales_from(b, h_kv, k0 + run.offset);
      const auto values = v_.scales_from(b, h_kv, k0 + run.offset);
      for (int64_t j = 0; j < run.count; ++j) {
        s.key_scales[run.offset + j] = keys.first[j * keys.stride] * keys.factor;
        s.value_scales[run.offset + j] = values.first[j * values.stride] * values.factor;
      }
    }
  }

  // m[r * ld + j] *= factors[j] for r < rows, j < cols.
  static void scale_columns(acc_t* m, int64_t ld, int64_t rows, int64_t cols,
                            const acc_t* factors) {
    for (int64_t r = 0; r < rows; ++r) {
      multiply_row(m + r * ld, factors, cols);
    }
  }

  // The runs of K and V rows (KeyRows::run_end) that keys [k0, k0 + cols) of KV head h_kv of
  // batch item b lie on, in order: one, for a tensor's rows. Found once a block (and for a page's
  // heads by their item's first, runs_of_head), as a page's rows are found through the block
  // table.
  void block_runs(int64_t b, int64_t h_kv, int64_t k0, int64_t cols,
                  std::vector<RowRun<kv_t>>& keys, std::vector<RowRun<kv_t>>& values) const {
    keys.clear();
    values.clear();
    for (int64_t offset = 0, count; offset < cols; offset += count) {
      const int64_t key = k0 + offset;
      count = std::min({cols - offset, k_.run_end(b, key, k0 + cols) - key,
                        v_.run_end(b, key, k0 + cols) - key});
      keys.push_back({offset, count, k_.row(b, h_kv, key)});
      values.push_back({offset, count, v_.row(b, h_kv, key)});
    }
  }

  // s's next runs as `lead`'s (the first head of s's item, whose key block came first), moved to
  // KV head h_kv: a page holds every head's rows head_stride apart (KeyRows::kInterleavedHeads,
  // where an item's heads share its key blocks), so only the first head looks its pages up (the
  // lookups of every head were 4-5 % of an in-cache int8 decode's samples on a Zen 5).
  // (Only such sources have an item of several heads, so only they are given a lead.)
  void runs_of_head(const Scratch& lead, int64_t h_kv, Scratch& s) const {
    if constexpr (KeyRows::kInterleavedHeads) {
      const int64_t heads = h_kv - lead.task.h_kv;
      s.next_key_runs = lead.next_key_runs;
      s.next_value_runs = lead.next_value_runs;
      for (RowRun<kv_t>& run : s.next_key_runs) {
        run.first += heads * k_.head_stride;
      }
      for (RowRun<kv_t>& run : s.next_value_runs) {
        run.first += heads * v_.head_stride;
      }
    }
  }

  // The prefetches of run i of the block: the next block's rows from the same offset, up to the
  // end of the next block's run holding it (where pages divide the block, the next block's runs
  // pair with this one's). `next` is that run's index, found on from its value.
  StreamAhead run_stream(const Scratch& s, size_t i, size_t& next) const {
    const RowRun<kv_t>& run = s.key_runs[i];
    StreamAhead stream;
    stream.keys = run.count;
    const auto& ahead = s.next_key_runs;
    while (next < ahead.size() && ahead[next].offset + ahead[next].count <= run.offset) {
      ++next;
    }
    if (next < ahead.size()) {
      const int64_t skipped = run.offset - ahead[next].offset;
      const int64_t count = std::min(run.count, ahead[next].count - skipped);
      stream.next_keys = StreamAhead::Rows::of(ahead[next].first + skipped * k_.row_stride, count,
                                               dims_.head_dim, k_.row_stride);
      stream.next_values =
          StreamAhead::Rows::of(s.next_value_runs[next].first + skipped * v_.row_stride, count,
                                dims_.value_dim, v_.row_stride);
    }
    return stream;
  }

  // Folds keys [k0, k0 + cols) into the task's rows: through the register products, value rows
  // read in place (widened in registers if of a reduced dtype), or through block_gemm for a task
  // of many rows (multiplies_blocks).
  void key_block(const TaskRows& t, int64_t k0, int64_t cols, int64_t key_end, Scratch& s,
                 const Scratch* lead) const {
    const int64_t Dv = dims_.value_dim, rows = t.rows, b = t.b, h_kv = t.h_kv;
    const bool* kept = dims_.hidden_keys(b, k0, cols);
    // attn_mask may hide a key from some rows and not others (heads and rows differ): then every
    // non-finite value row is left out of the products and added back where a row sees it.
    bool attn_mask_read = false;
    for (int64_t r = 0; r < rows; ++r) {
      const BlockMasks masks{kept, !dims_.attn_mask.absent() &&
                                       dims_.attn_mask.block(b, t.head(r, dims_), t.query_row(r), 1,
                                                             k0, cols) != kTileVisible};
      s.mask_rows[r] = modifiers_.row(dims_, b, t.head(r, dims_), t.query_row(r), k0, masks).mask;
      attn_mask_read = attn_mask_read || masks.attn_mask;
    }
    // S = Q K_j^T, run by run (K and V in runs, one a page or pages in order; the next block's, for
    // the prefetches, found once: the previous block found this one's, unless the key mask skipped
    // a block)
    if (s.next_runs_key == k0) {
      std::swap(s.key_runs, s.next_key_runs);
      std::swap(s.value_runs, s.next_value_runs);
    } else {
      block_runs(b, h_kv, k0, cols, s.key_runs, s.value_runs);
    }
    s.next_key_runs.clear();
    s.next_value_runs.clear();
    s.next_runs_key = -1;
    if (k0 + cols < key_end) {  // a row past key_end may lie on no page
      if (lead != nullptr) {
        runs_of_head(*lead, h_kv, s);
      } else {
        block_runs(b, h_kv, k0 + cols, block_keys(k0 + cols, key_end), s.next_key_runs,
                   s.next_value_runs);
      }
      s.next_runs_key = k0 + cols;
    }
    s.streams.clear();
    s.value_requests = value_requests(rows);  // kWithKeys for multiplies_blocks' many rows
    if (multiplies_blocks(rows)) {
      block_scores(rows, cols, s);
    } else {
      register_scores(rows, cols, s);
    }
    if constexpr (kScaled) {  // q . (k x scale) as (q . k) x scale
      block_scales(b, h_kv, k0, s);
      scale_columns(s.scores.data(), cols, rows, cols, s.key_scales.data());
    }
    if constexpr (kSetsNaNApart) {
      set_nan_keys_apart(s, rows, cols, s.scores.data());
    }
    // x = the modified scores; m' = max(m, rowmax(x)); P = exp(x - m');
    // l = e^(m-m') l + rowsum(P); O = e^(m-m') O
    for (int64_t r = 0; r < rows; ++r) {
      const KeyRange range = dims_.visible_in_block(b, t.query_row(r), k0, cols);
      s.first_visible[r] = range.begin;
      s.visible[r] = range.end;
      const BlockMasks masks{kept, s.mask_rows[r].active()};
      s.state.fold_row(s.scores.data() + r * cols, r, range, cols,
                       modifiers_.row(dims_, b, t.head(r, dims_), t.query_row(r), k0, masks));
    }
    if constexpr (kScaled) {  // P (v x scale) as (P x scale) v
      scale_columns(s.scores.data(), cols, rows, cols, s.value_scales.data());
    }
    // O += P V_j, each row reading only the value rows it reaches (hidden ones weigh zero).
    // Every non-finite value row is left out of the products and added back where a row sees
    // it when attn_mask may hide a key from some rows and not others, or when the products would
    // misread it (kSetsNaNApart).
    const bool sees_all = !attn_mask_read && !kept && every_row_sees_all(rows, cols, s);
    // The float8 pair products take the block where every row sees every key and the block
    // products do not; their tables read e4m3's NaN byte as NaN, which every row then gets where
    // its column is, as the guard would give: such a block needs no test of its value rows (the
    // test was 5 % of an in-cache e4m3 decode's samples on a Zen 4).
    bool float8_pairs = false;
    if constexpr (kFloat8Values) {
      float8_pairs = float8_pair_values_ && sees_all && !multiplies_blocks(rows);
    }
    bool nan_values = false;
    if constexpr (kSetsNaNApart) {
      nan_values = !float8_pairs && any_nan_value_row(s);
    }
    const bool guard_every_row = attn_mask_read || nan_values;
    if (!guard_every_row && !kept) {
      if (multiplies_blocks(rows) && sees_all) {
        block_values(rows, cols, s);
        return;
      }
      // The block's value rows; where every row sees them all, the values' pass asks for the next
      // block's as it goes (unless the scores did: kWithKeys), else request_values asks at once.
      RunRows<kv_t> values{s.value_runs.data(), int64_t(s.value_runs.size()), v_.row_stride};
      if (sees_all && s.value_requests != ValueRequests::kWithKeys) {
        values.streams = s.streams.data();
      }
      if constexpr (kFloat8Values) {
        if (float8_pairs) {
          accumulate_float8_pair_values(s.scores.data(), cols, rows, cols, values, Dv,
                                        s.state.out.data(), Dv, s.float8_weights);
          return;
        }
      }
      if constexpr (kIntegerQueryRows) {
        static_assert(kKeyBlock <= kMaxIntegerKeys);
        if (s.integer_rows && integer_values_ && sees_all) {
          if (accumulate_integer_values(s.scores.data(), cols, rows, cols, values, Dv,
                                        s.state.out.data(), Dv, s.integer_weights)) {
            return;
          }
        }
      }
      if constexpr (kWidensValues) {
        if (padded(rows) > 0) {
          widen_values(s);
          const RowRun<acc_t> wide{0, cols, s.wide_values.data()};
          accumulate_weighted_values(s.scores.data(), cols, rows, s.first_visible.data(),
                                     s.visible.data(), RunRows<acc_t>{&wide, 1, Dv}, Dv,
                                     s.state.out.data(), Dv);
          return;
        }
      }
      if (!sees_all) {
        request_values(s);
      }
      accumulate_weighted_values(s.scores.data(), cols, rows, s.first_visible.data(),
                                 s.visible.data(), values, Dv, s.state.out.data(), Dv);
      return;
    }
    // Else run by run: the guard leaves a run's non-finite rows out of its products.
    request_values(s);
    for (const RowRun<kv_t>& run : s.value_runs) {
      for (int64_t r = 0; r < rows; ++r) {
        s.run_first[r] = std::clamp<int64_t>(s.first_visible[r] - run.offset, 0, run.count);
        s.run_visible[r] =
            std::clamp<int64_t>(s.visible[r] - run.offset, s.run_first[r], run.count);
        s.run_mask_rows[r] = s.mask_rows[r].from(run.offset);
      }
      const bool* run_kept = kept ? kept + run.offset : nullptr;
      const Operand<kv_t> value_rows{run.first, v_.row_stride};
      const Operand<kv_t> values =
          guard_every_row
              ? s.guard.without_non_finite_rows(value_rows, run.count, Dv)
              : s.guard.without_hidden_non_finite_rows(value_rows, run.count, Dv, run_kept);
      const RowRun<kv_t> cleaned{0, run.count, values.data};
      accumulate_weighted_values(s.scores.data() + run.offset, cols, rows, s.run_first.data(),
                                 s.run_visible.data(), RunRows<kv_t>{&cleaned, 1, values.ld}, Dv,
                                 s.state.out.data(), Dv);
      if (guard_every_row) {
        s.guard.add_back(rows, Dv,
                         MaskedFactor<acc_t>{s.scores.data() + run.offset, cols, s.run_first.data(),
                                             s.run_visible.data(), /*transposed=*/false, run_kept,
                                             s.run_mask_rows.data()},
                         value_rows, s.state.out.data(), Dv);
      }
    }
  }

  const AttentionDims dims_;
  const HeadRows<const scalar_t> q_;
  const KeyRows k_, v_;
  const OutputRows<scalar_t, acc_t> output_;
  const ScoreModifiers<acc_t> modifiers_;
  const bool native_products_;  // read once a call (multiplies_blocks)
  const bool pair_dots_;        // and these (kBFloat16PairDots)
  const bool integer_scores_;   // (kIntegerQueryRows)
  const bool integer_values_;
  const bool float8_pair_values_;  // (kFloat8Values)
  // Whether value_requests gives kApart to 16-bit rows too (8-bit rows take it everywhere): on
  // the AMX Xeon, where the next block's value rows requested by the values' pass made a bfloat16
  // paged decode from memory 0.91-0.94 of its time with them requested alongside the keys
  // (docs/benchmarks, stop 58). On a Zen 5 the values' pass
  // then waited on its rows (69 % of its tiles' samples on the value loads, contiguous bfloat16
  // cache): requested with the keys, a block ahead, that decode's median went from 34.6 to 32.9
  // ms (`python -m benchmarks.paired <A> <B> contiguous --threads 2`), the paged ones unchanged
  // (stop 62). Which requests go when changes no arithmetic.
  const bool values_apart_here_;
};

}  // namespace causal_attention::cpu::CPU_CAPABILITY
