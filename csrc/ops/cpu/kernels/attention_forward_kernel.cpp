// CPU forward, FlashAttention-2 style: one task owns a (batch, query head, query block, key
// split) and walks its visible key blocks in order with an online softmax (running max, sum and
// output per row). Nothing of size Lq x Lk is ever allocated.
//
// Key splits serve decoding (few query rows against a long KV cache, few heads): with too few
// (batch, head, query block) items to keep every thread busy, the keys of each item are cut
// into chunks computed by separate tasks and merged afterwards in chunk order. Whether and how
// to split depends only on the shapes, never on the thread count, so results stay bitwise
// identical at any thread count.
#include "kernel_api.h"
#include "tile_ops.h"

#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>

#include <vector>

namespace causal_attention::cpu::CPU_CAPABILITY {
namespace {

// Fewer (batch, head, query block) items than this and the keys are split.
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
        num_qblocks_(ceil_div(dims_.len_q, kQueryBlock)) {
    const int64_t items = dims_.batch * dims_.heads_q * num_qblocks_;
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
    for_each_head_block(
        num_heads, num_qblocks_ * num_splits_, [this] { return Scratch(dims_); },
        [&](int64_t bh, int64_t block, Scratch& s) {
          run_item(bh, block / num_splits_ * kQueryBlock, block % num_splits_, s);
        });
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

  void run_item(int64_t bh, int64_t q0, int64_t split, Scratch& s) {
    const int64_t b = bh / dims_.heads_q, h = bh % dims_.heads_q;
    const int64_t h_kv = h / dims_.group();
    const int64_t D = dims_.head_dim, Dv = dims_.value_dim;
    const int64_t rows = std::min(kQueryBlock, dims_.len_q - q0);
    const int64_t chunk = ceil_div(ceil_div(dims_.len_k, num_splits_), kKeyBlock) * kKeyBlock;
    const int64_t key_begin = split * chunk;
    const int64_t key_end = std::min(dims_.visible_keys(q0 + rows - 1), key_begin + chunk);
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
      for (int64_t r = 0; r < rows; ++r) {
        s.visible[r] = std::clamp<int64_t>(dims_.visible_keys(q0 + r) - k0, 0, cols);
        update_row(s.scores.data() + r * cols, cols, s.visible[r], state, r, Dv);
      }
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

    if (num_splits_ == 1) {
      finish_rows(state, rows, bh, q0);
    } else {
      const int64_t offset = (bh * num_splits_ + split) * dims_.len_q + q0;
      std::copy_n(state.max.begin(), rows, split_max_.data_ptr<acc_t>() + offset);
      std::copy_n(state.sum.begin(), rows, split_sum_.data_ptr<acc_t>() + offset);
      std::copy_n(state.out.begin(), rows * Dv, split_out_.data_ptr<acc_t>() + offset * Dv);
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
      // max marks it so that finish_rows returns NaN for it (and only for it).
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

  void finish_rows(const RowState<acc_t>& state, int64_t rows, int64_t bh, int64_t q0) {
    const int64_t b = bh / dims_.heads_q, h = bh % dims_.heads_q;
    for (int64_t r = 0; r < rows; ++r) {
      finish_row(state.max[r], state.sum[r], state.out.data() + r * dims_.value_dim,
                 out_.row(b, h, q0 + r), lse_ + bh * dims_.len_q + q0 + r);
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
  int64_t num_splits_;
  at::Tensor split_max_, split_sum_, split_out_;
};

}  // namespace

void forward_kernel(const ForwardTensors& tensors) {
  run_for_dtype<ForwardKernel>(tensors);
}

}  // namespace causal_attention::cpu::CPU_CAPABILITY
