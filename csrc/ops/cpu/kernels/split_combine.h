// The split-key combine. With too few work items to keep every thread busy, the forward cuts the
// keys of each item into chunks computed by separate tasks; each chunk leaves, per query row,
// its max m_s, sum l_s and unnormalized output O_s, and the rows are finished afterwards in
// chunk order:  m = max_s m_s;  l = sum_s e^(m_s - m) l_s;  O = sum_s e^(m_s - m) O_s.
#pragma once

#include "geometry.h"
#include "online_softmax.h"
#include "row_ops.h"
#include "row_sources.h"
#include "score_modifiers.h"

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <utility>
#include <vector>

namespace causal_attention::cpu::CPU_CAPABILITY {

// Where finished rows go: out (batch, heads_q, len_q, value_dim) and lse (batch, heads_q, len_q).
template <typename scalar_t, typename acc_t>
struct OutputRows {
  HeadRows<scalar_t> out;
  HeadRows<acc_t> lse;
  int64_t heads_q, value_dim;
  ScoreModifiers<acc_t> modifiers;  // the sinks and dropout's 1 / (1 - p)

  // Finishes query row q_row of head bh (= batch * heads_q + head).
  void finish(int64_t bh, int64_t q_row, acc_t max, acc_t sum, const acc_t* acc) const {
    const int64_t b = bh / heads_q, h = bh % heads_q;
    finish_row(max, sum, acc, value_dim, modifiers.sink(h), modifiers.keep_scale(),
               out.row(b, h, q_row), lse.row(b, h, q_row));
  }
};

template <typename scalar_t, typename acc_t>
class KeySplits {
 public:
  // Chunks are multiples of this many keys, so that they hold whole key blocks of both paths.
  static constexpr int64_t kChunkAlignment = 128;

  KeySplits(const AttentionDims& d, int64_t num_splits, OutputRows<scalar_t, acc_t> output)
      : dims_(d), num_splits_(num_splits), output_(output) {
    if (num_splits_ > 1) {
      const int64_t rows = d.batch * d.heads_q * num_splits_ * d.len_q;
      const auto options = at::TensorOptions().dtype(c10::CppTypeToScalarType<acc_t>::value);
      max_ = at::empty({rows}, options);
      sum_ = at::empty({rows}, options);
      out_ = at::empty({rows, d.value_dim}, options);
    }
  }

  int64_t count() const { return num_splits_; }

  // The keys of chunk `split` that rows seeing [first_key, key_end) need. first_key is the
  // first key of a key block, as is every chunk's.
  std::pair<int64_t, int64_t> key_range(int64_t split, int64_t first_key, int64_t key_end) const {
    const int64_t chunk =
        ceil_div(ceil_div(dims_.len_k, num_splits_), kChunkAlignment) * kChunkAlignment;
    return {std::max(first_key, split * chunk), std::min(key_end, (split + 1) * chunk)};
  }

  // Row r of `state` is query row q_row of head bh: finished into the output when keys are not
  // split, else kept for merge().
  void emit(const RowState<acc_t>& state, int64_t r, int64_t bh, int64_t q_row, int64_t split) {
    const acc_t* acc = state.out.data() + r * dims_.value_dim;
    if (num_splits_ == 1) {
      output_.finish(bh, q_row, state.max[r], state.row_sum(r), acc);
      return;
    }
    const int64_t at_row = (bh * num_splits_ + split) * dims_.len_q + q_row;
    max_.data_ptr<acc_t>()[at_row] = state.max[r];
    sum_.data_ptr<acc_t>()[at_row] = state.row_sum(r);
    std::copy_n(acc, dims_.value_dim, out_.data_ptr<acc_t>() + at_row * dims_.value_dim);
  }

  // Combines the chunks of every query row, in chunk order.
  void merge() const {
    if (num_splits_ == 1) {
      return;
    }
    const int64_t len_q = dims_.len_q;
    at::parallel_for(0, dims_.batch * dims_.heads_q * len_q, 1, [&](int64_t begin, int64_t end) {
      std::vector<acc_t> acc(dims_.value_dim);
      for (int64_t item = begin; item < end; ++item) {
        const int64_t bh = item / len_q, r = item % len_q;
        if (r < dims_.rows_q(bh / dims_.heads_q)) {
          merge_row(bh, r, acc.data());
        }
      }
    });
  }

 private:
  void merge_row(int64_t bh, int64_t r, acc_t* acc) const {
    const acc_t* split_max = max_.data_ptr<acc_t>();
    const acc_t* split_sum = sum_.data_ptr<acc_t>();
    const acc_t* split_out = out_.data_ptr<acc_t>();
    const auto at_row = [&](int64_t s) { return (bh * num_splits_ + s) * dims_.len_q + r; };
    acc_t max = -std::numeric_limits<acc_t>::infinity();
    for (int64_t s = 0; s < num_splits_; ++s) {
      const acc_t m = split_max[at_row(s)];
      max = std::isnan(m) || std::isnan(max) ? std::numeric_limits<acc_t>::quiet_NaN()
                                             : std::max(max, m);
    }
    acc_t sum = 0;
    std::fill_n(acc, dims_.value_dim, acc_t(0));
    if (!std::isnan(max) && max != -std::numeric_limits<acc_t>::infinity()) {
      for (int64_t s = 0; s < num_splits_; ++s) {
        const acc_t weight = std::exp(split_max[at_row(s)] - max);
        sum += split_sum[at_row(s)] * weight;
        add_scaled_row(acc, split_out + at_row(s) * dims_.value_dim, dims_.value_dim, weight);
      }
    }
    output_.finish(bh, r, max, sum, acc);
  }

  const AttentionDims dims_;
  const int64_t num_splits_;
  const OutputRows<scalar_t, acc_t> output_;
  at::Tensor max_, sum_, out_;
};

}  // namespace causal_attention::cpu::CPU_CAPABILITY
