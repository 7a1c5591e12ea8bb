// CPU forward, FlashAttention-2 style: one task owns a (batch, query head, query block, key
// split) and walks its visible key blocks in order with an online softmax (running max, sum and
// output per row). Nothing of size Lq x Lk is ever allocated.
//
// Decoding (a few query rows against a long KV cache) takes another kind of task: one owns a
// (batch, KV head, key split) and carries every query row of every query head that shares the
// KV head (the GQA group) through the keys at once, with the register products of
// row_products.h instead of packed block products, so that K and V stream from memory once.
//
// Key splits serve few tasks (decoding, few heads): with too few items to keep every thread
// busy, the keys of each item are cut into chunks computed by separate tasks and merged
// afterwards in chunk order. Whether and how to split depends only on the shapes, never on the
// thread count, so results stay bitwise identical at any thread count.
#include "kernel_api.h"
#include "row_products.h"
#include "tile_ops.h"

#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>

#include <utility>
#include <vector>

namespace causal_attention::cpu::CPU_CAPABILITY {
namespace {

// Up to this many query rows a call decodes (see above). Decoding measured faster than the block
// path up to 64 rows against a 4096-key cache; 32 keeps the rows one task carries (the GQA group
// times this) small enough for its scores and outputs to stay in L1/L2.
constexpr int64_t kMaxDecodeQueryRows = 32;
// Keys per decoding block: every query row of the task passes over these K and V rows (64 KiB in
// float32 at D = 64, in L2) before the next block streams in; measured a few % faster than 64.
constexpr int64_t kDecodeKeyBlock = 128;
// Fewer items than this and the keys are split.
constexpr int64_t kMinItemsWithoutSplit = 32;
// Keys per split: long enough that the merge is negligible next to the split's own work.
constexpr int64_t kKeysPerSplit = 16 * kKeyBlock;

// The online-softmax state of one query block: row max, row sum and unnormalized output rows.
template <typename acc_t>
struct RowState {
  std::vector<acc_t> max, sum, out;
  RowState(int64_t rows, int64_t value_dim) : max(rows), sum(rows), out(rows * value_dim) {}

  void reset(int64_t rows, int64_t value_dim) {
    std::fill_n(max.begin(), rows, -std::numeric_limits<acc_t>::infinity());
    std::fill_n(sum.begin(), rows, acc_t(0));
    std::fill_n(out.begin(), rows * value_dim, acc_t(0));
  }
};

template <typename scalar_t, typename gemm_t>
class ForwardKernel {
  using acc_t = at::opmath_type<scalar_t>;
  using Ops = Operands<gemm_t>;

 public:
  explicit ForwardKernel(const ForwardTensors& t)
      : dims_(t.q, t.k, t.v),
        q_(t.q),
        k_(t.k),
        v_(t.v),
        out_(t.out),
        lse_(t.lse.data_ptr<acc_t>()),
        scale_(static_cast<acc_t>(t.scale)),
        num_qblocks_(ceil_div(dims_.len_q, kQueryBlock)),
        decode_(dims_.len_q <= kMaxDecodeQueryRows) {
    const int64_t items =
        decode_ ? dims_.batch * dims_.heads_kv : dims_.batch * dims_.heads_q * num_qblocks_;
    num_splits_ = items >= kMinItemsWithoutSplit
                      ? 1
                      : std::max<int64_t>(1, ceil_div(dims_.len_k, kKeysPerSplit));
  }

  void run() {
    const int64_t num_heads = dims_.batch * dims_.heads_q;
    const int64_t Dv = dims_.value_dim;
    if (num_splits_ > 1) {
      split_max_ = at::empty({num_heads, num_splits_, dims_.len_q},
                             at::TensorOptions().dtype(c10::CppTypeToScalarType<acc_t>::value));
      split_sum_ = at::empty_like(split_max_);
      split_out_ = at::empty({num_heads, num_splits_, dims_.len_q, Dv}, split_max_.options());
    }
    if (decode_) {
      for_each_head_block(
          dims_.batch * dims_.heads_kv, num_splits_, [this] { return DecodeScratch(dims_); },
          [&](int64_t b_hkv, int64_t split, DecodeScratch& s) {
            run_decode_item(b_hkv, split, s);
          });
    } else {
      for_each_head_block(
          num_heads, num_qblocks_ * num_splits_, [this] { return Scratch(dims_); },
          [&](int64_t bh, int64_t block, Scratch& s) {
            run_item(bh, block / num_splits_ * kQueryBlock, block % num_splits_, s);
          });
    }
    if (num_splits_ > 1) {
      merge_splits();
    }
  }

 private:
  struct Scratch {
    std::vector<gemm_t> q_tile, k_tile, v_tile, p_tile;
    std::vector<acc_t> scores;
    std::vector<int64_t> visible;  // keys of the current block each row sees
    NonFiniteRowGuard<scalar_t> v_guard;
    RowState<acc_t> state;
    explicit Scratch(const AttentionDims& d)
        : q_tile(Ops::scratch_size(kQueryBlock, d.head_dim)),
          k_tile(Ops::scratch_size(kKeyBlock, d.head_dim)),
          v_tile(Ops::scratch_size(kKeyBlock, d.value_dim)),
          p_tile(Ops::scratch_size(kQueryBlock, kKeyBlock)),
          scores(kQueryBlock * kKeyBlock),
          visible(kQueryBlock),
          state(kQueryBlock, d.value_dim) {}
  };

  // Query rows of a decoding task, and the vector-padded count of them that key_query_scores
  // computes with (query_key_scores serves fewer rows than a vector holds).
  static int64_t decode_rows(const AttentionDims& d) { return d.group() * d.len_q; }
  static int64_t padded_decode_rows(const AttentionDims& d) {
    constexpr int64_t N = at::vec::Vectorized<acc_t>::size();
    return decode_rows(d) < N ? 0 : ceil_div(decode_rows(d), N) * N;
  }

  struct DecodeScratch {
    // queries_t holds the query rows transposed, its padding rows zero from construction on.
    std::vector<acc_t> queries, queries_t, keys, scores, scores_t;
    std::vector<int64_t> visible;
    RowState<acc_t> state;
    explicit DecodeScratch(const AttentionDims& d)
        : queries(decode_rows(d) * d.head_dim),
          queries_t(padded_decode_rows(d) * d.head_dim),
          keys(kDecodeKeyBlock * d.head_dim),
          scores(decode_rows(d) * kDecodeKeyBlock),
          scores_t(padded_decode_rows(d) * kDecodeKeyBlock),
          visible(decode_rows(d)),
          state(decode_rows(d), d.value_dim) {}
  };

  // The first key of a split, and the end of the keys it covers that a row seeing
  // `visible_keys` keys needs.
  std::pair<int64_t, int64_t> key_range(int64_t split, int64_t visible_keys) const {
    const int64_t chunk = ceil_div(ceil_div(dims_.len_k, num_splits_), kKeyBlock) * kKeyBlock;
    return {split * chunk, std::min(visible_keys, (split + 1) * chunk)};
  }

  // One (batch, KV head, key split) of a decoding call: row r of the item is query row r % len_q
  // of query head h_kv * group + r / len_q.
  void run_decode_item(int64_t b_hkv, int64_t split, DecodeScratch& s) {
    const int64_t b = b_hkv / dims_.heads_kv, h_kv = b_hkv % dims_.heads_kv;
    const int64_t D = dims_.head_dim, Dv = dims_.value_dim, len_q = dims_.len_q;
    const int64_t first_head = h_kv * dims_.group();
    const int64_t rows = decode_rows(dims_), padded_rows = padded_decode_rows(dims_);
    for (int64_t r = 0; r < rows; ++r) {
      convert_row(q_.row(b, first_head + r / len_q, r % len_q), s.queries.data() + r * D, D);
    }
    if (padded_rows > 0) {
      transpose_block(s.queries.data(), rows, D, D, s.queries_t.data(), padded_rows);
    }
    const auto [key_begin, key_end] = key_range(split, dims_.visible_keys(len_q - 1));
    RowState<acc_t>& state = s.state;
    state.reset(rows, Dv);
    // Value rows are read in place (widened in registers if of a reduced dtype). So are key rows
    // for fewer rows than a vector holds; with more, each key element is broadcast to many rows
    // and a key block of a reduced dtype is converted once instead (measured faster).
    for (int64_t k0 = key_begin; k0 < key_end; k0 += kDecodeKeyBlock) {
      const int64_t cols = std::min(kDecodeKeyBlock, key_end - k0);
      const scalar_t* k_block = k_.row(b, h_kv, k0);
      const scalar_t* v_block = v_.row(b, h_kv, k0);
      StreamAhead stream;
      stream.values = StreamAhead::Rows::of(v_block, cols, Dv, v_.row_stride);
      stream.next_keys =
          StreamAhead::Rows::of(k_.row(b, h_kv, k0 + cols),
                                std::min(kDecodeKeyBlock, key_end - k0 - cols), D, k_.row_stride);
      if (padded_rows > 0) {
        int64_t ldk = 0;
        const acc_t* keys =
            Operands<acc_t>::a(k_block, cols, D, k_.row_stride, s.keys.data(), &ldk);
        key_query_scores(s.queries_t.data(), padded_rows, padded_rows, keys, ldk, cols, D,
                         s.scores_t.data(), padded_rows, stream);
        transpose_block(s.scores_t.data(), cols, rows, padded_rows, s.scores.data(), cols);
      } else {
        query_key_scores(s.queries.data(), D, rows, k_block, k_.row_stride, cols, D,
                         s.scores.data(), cols, stream);
      }
      fold_block(
          s.scores.data(), rows, k0, cols, [&](int64_t r) { return r % len_q; }, s.visible.data(),
          state);
      accumulate_weighted_values(s.scores.data(), cols, rows, s.visible.data(), v_block,
                                 v_.row_stride, Dv, state.out.data(), Dv, stream);
    }
    for (int64_t r = 0; r < rows; ++r) {
      emit_row(state, r, b * dims_.heads_q + first_head + r / len_q, r % len_q, split);
    }
  }

  void run_item(int64_t bh, int64_t q0, int64_t split, Scratch& s) {
    const int64_t b = bh / dims_.heads_q, h = bh % dims_.heads_q;
    const int64_t h_kv = h / dims_.group();
    const int64_t D = dims_.head_dim, Dv = dims_.value_dim;
    const int64_t rows = std::min(kQueryBlock, dims_.len_q - q0);
    const auto [key_begin, key_end] = key_range(split, dims_.visible_keys(q0 + rows - 1));
    RowState<acc_t>& state = s.state;
    state.reset(rows, Dv);

    int64_t ldq = 0;
    const gemm_t* q_rows = Ops::a(q_.row(b, h, q0), rows, D, q_.row_stride, s.q_tile.data(), &ldq);
    for (int64_t k0 = key_begin; k0 < key_end; k0 += kKeyBlock) {
      const int64_t cols = std::min(kKeyBlock, key_end - k0);
      int64_t ldk = 0, ldv = 0, ldp = 0;
      const gemm_t* k_t =
          Ops::b_transposed(k_.row(b, h_kv, k0), cols, D, k_.row_stride, s.k_tile.data(), &ldk);
      block_gemm(rows, cols, Ops::padded_k(D), q_rows, ldq, k_t, ldk, s.scores.data(), cols,
                 /*accumulate=*/false);
      fold_block(
          s.scores.data(), rows, k0, cols, [&](int64_t r) { return q0 + r; }, s.visible.data(),
          state);
      const gemm_t* p = Ops::a(s.scores.data(), rows, cols, cols, s.p_tile.data(), &ldp);
      const scalar_t* v_block = v_.row(b, h_kv, k0);
      int64_t ld_v_block = 0;
      const scalar_t* v_source =
          s.v_guard.prepare(s.visible[0] < cols, v_block, cols, Dv, v_.row_stride, &ld_v_block);
      const gemm_t* v_rows = Ops::b(v_source, cols, Dv, ld_v_block, s.v_tile.data(), &ldv);
      block_gemm(rows, Dv, Ops::padded_k(cols), p, ldp, v_rows, ldv, state.out.data(), Dv,
                 /*accumulate=*/true);
      s.v_guard.add_back(s.scores.data(), cols, rows, v_block, v_.row_stride, Dv, s.visible.data(),
                         state.out.data(), Dv);
    }

    for (int64_t r = 0; r < rows; ++r) {
      emit_row(state, r, bh, q0 + r, split);
    }
  }

  // Folds a block of scores (rows x cols, keys k0 ..) into the rows' online-softmax state, row r
  // being query row query_row(r); leaves in visible[r] how many of the block's keys row r sees.
  template <typename QueryRow>
  void fold_block(acc_t* scores, int64_t rows, int64_t k0, int64_t cols, const QueryRow& query_row,
                  int64_t* visible, RowState<acc_t>& state) const {
    for (int64_t r = 0; r < rows; ++r) {
      visible[r] = std::clamp<int64_t>(dims_.visible_keys(query_row(r)) - k0, 0, cols);
      update_row(scores + r * cols, cols, visible[r], state, r, dims_.value_dim);
    }
  }

  // Folds one block of scores (row r, `visible` of `cols` keys visible) into the row's state and
  // leaves the block's probabilities (relative to the new max) in `scores`.
  void update_row(acc_t* scores, int64_t cols, int64_t visible, RowState<acc_t>& state, int64_t r,
                  int64_t Dv) const {
    const acc_t block_max = scale_and_max(scores, visible, scale_);
    const acc_t old_max = state.max[r];
    const acc_t new_max = std::isnan(block_max) ? block_max : std::max(old_max, block_max);
    if (new_max == -std::numeric_limits<acc_t>::infinity() || std::isnan(new_max)) {
      // Nothing visible yet, or a NaN score: the row contributes nothing further, and a NaN
      // max marks it so that finish_row returns NaN for it (and only for it).
      state.max[r] = new_max;
      std::fill(scores, scores + cols, acc_t(0));
      return;
    }
    const acc_t correction = std::exp(old_max - new_max);
    state.sum[r] =
        state.sum[r] * correction + exp_and_sum(scores, visible, cols, acc_t(1), new_max);
    state.max[r] = new_max;
    if (correction != acc_t(1)) {
      scale_row(state.out.data() + r * Dv, Dv, correction);
    }
  }

  // Row r of `state` is query row q_row of head bh (batch * heads_q + head): finished into the
  // output when keys are not split, else kept for merge_splits.
  void emit_row(const RowState<acc_t>& state, int64_t r, int64_t bh, int64_t q_row, int64_t split) {
    const int64_t Dv = dims_.value_dim;
    const acc_t* acc = state.out.data() + r * Dv;
    if (num_splits_ == 1) {
      const int64_t b = bh / dims_.heads_q, h = bh % dims_.heads_q;
      finish_row(state.max[r], state.sum[r], acc, out_.row(b, h, q_row),
                 lse_ + bh * dims_.len_q + q_row);
    } else {
      const int64_t at_row = (bh * num_splits_ + split) * dims_.len_q + q_row;
      split_max_.data_ptr<acc_t>()[at_row] = state.max[r];
      split_sum_.data_ptr<acc_t>()[at_row] = state.sum[r];
      std::copy_n(acc, Dv, split_out_.data_ptr<acc_t>() + at_row * Dv);
    }
  }

  // out = acc / sum and lse = max + log(sum); a row with no visible key gets zeros and -inf.
  void finish_row(acc_t max, acc_t sum, const acc_t* acc, scalar_t* out, acc_t* lse) const {
    const int64_t Dv = dims_.value_dim;
    if (std::isnan(max)) {
      std::fill(out, out + Dv, static_cast<scalar_t>(max));
      *lse = max;
    } else if (sum == acc_t(0)) {
      std::fill(out, out + Dv, scalar_t(0));
      *lse = -std::numeric_limits<acc_t>::infinity();
    } else {
      store_scaled_row(acc, Dv, acc_t(1) / sum, out);
      *lse = max + std::log(sum);
    }
  }

  // Combines the key splits of every query row, in split order.
  void merge_splits() {
    const int64_t Dv = dims_.value_dim, len_q = dims_.len_q;
    const acc_t* split_max = split_max_.data_ptr<acc_t>();
    const acc_t* split_sum = split_sum_.data_ptr<acc_t>();
    const acc_t* split_out = split_out_.data_ptr<acc_t>();
    at::parallel_for(0, dims_.batch * dims_.heads_q * len_q, 1, [&](int64_t begin, int64_t end) {
      std::vector<acc_t> acc(Dv);
      for (int64_t item = begin; item < end; ++item) {
        const int64_t bh = item / len_q, r = item % len_q;
        acc_t max = -std::numeric_limits<acc_t>::infinity();
        for (int64_t s = 0; s < num_splits_; ++s) {
          const acc_t m = split_max[(bh * num_splits_ + s) * len_q + r];
          max = std::isnan(m) || std::isnan(max) ? std::numeric_limits<acc_t>::quiet_NaN()
                                                 : std::max(max, m);
        }
        acc_t sum = 0;
        std::fill(acc.begin(), acc.end(), acc_t(0));
        if (!std::isnan(max) && max != -std::numeric_limits<acc_t>::infinity()) {
          for (int64_t s = 0; s < num_splits_; ++s) {
            const int64_t at_row = (bh * num_splits_ + s) * len_q + r;
            const acc_t weight = std::exp(split_max[at_row] - max);
            sum += split_sum[at_row] * weight;
            const acc_t* out = split_out + at_row * Dv;
            for (int64_t d = 0; d < Dv; ++d) {
              acc[d] += out[d] * weight;
            }
          }
        }
        const int64_t b = bh / dims_.heads_q, h = bh % dims_.heads_q;
        finish_row(max, sum, acc.data(), out_.row(b, h, r), lse_ + bh * len_q + r);
      }
    });
  }

  const AttentionDims dims_;
  const HeadRows<const scalar_t> q_, k_, v_;
  const HeadRows<scalar_t> out_;
  acc_t* const lse_;
  const acc_t scale_;
  const int64_t num_qblocks_;
  const bool decode_;
  int64_t num_splits_;
  at::Tensor split_max_, split_sum_, split_out_;
};

}  // namespace

void forward_kernel(const ForwardTensors& tensors) {
  run_for_dtype<ForwardKernel>(tensors);
}

}  // namespace causal_attention::cpu::CPU_CAPABILITY
