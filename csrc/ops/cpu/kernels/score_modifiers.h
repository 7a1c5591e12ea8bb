// The score modifiers: what happens to a row of raw scores S = q.k of one block before its
// softmax (scale, softcap, ALiBi, attn_mask, the masks' -inf) and to its probabilities after
// (dropout), and the sinks that join each row's denominator. Each is a step inside the online
// softmax's pass over the row (online_softmax.h), forward and backward, never a pass of its own
// over Lq x Lk. In FlashAttention's order:
//   x = scale S;  x = softcap tanh(x / softcap);  x -= slope |i + off - j|;  x += attn_mask;
//   hidden keys -inf;
//   P = exp(x - lse), lse including exp(sink);  P *= keep / (1 - p).
#pragma once

#include "attn_mask_view.h"
#include "dropout_hash.h"
#include "geometry.h"
#include "kernel_api.h"

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>

namespace causal_attention::cpu::CPU_CAPABILITY {

// tanh for the softcap. float32: where every lane of the vector lies below |x| = 0.25 (typical
// logits under a typical cap, Gemma 2's 50), its Taylor series, at a third of Sleef's cost;
// elsewhere at::vec's (Sleef's, within 1 ulp). (1 - e) / (1 + e) from exp_u20 there, within 3e-7,
// cost float32 backwards twice torch's error at logits near the cap (flash-attn's softcap tests,
// which scale q by softcap / 4). float64 keeps at::vec's.
template <typename acc_t>
inline at::vec::Vectorized<acc_t> softcap_tanh(const at::vec::Vectorized<acc_t>& x) {
  using Vec = at::vec::Vectorized<acc_t>;
  if constexpr (std::is_same_v<acc_t, float>) {
    if ((x.abs() < Vec(0.25f)).zero_mask() != 0) {
      return x.tanh();
    }
    const Vec x2 = x * x;
    Vec series = Vec(62.f / 2835.f);
    series = at::vec::fmadd(series, x2, Vec(-17.f / 315.f));
    series = at::vec::fmadd(series, x2, Vec(2.f / 15.f));
    series = at::vec::fmadd(series, x2, Vec(-1.f / 3.f));
    series = at::vec::fmadd(series, x2, Vec(1.f));
    return x * series;
  } else {
    return x.tanh();
  }
}

// The modifiers of one query row against one key block, made by ScoreModifiers::row.
template <typename acc_t>
struct RowScoring {
  acc_t scale;
  acc_t softcap;  // 0: off
  acc_t slope;    // ALiBi; 0: off
  // The block's column at distance 0 from the row (row + off - k0), for ALiBi.
  int64_t diagonal;
  const bool* kept;     // the block's key mask where it hides some keys, else null
  MaskRow<acc_t> mask;  // the row's attn_mask where the block's must be read, else inactive
  // Dropout: the row's key, the block's first key, the generator (null: off) and 1 / (1 - p).
  const DropoutHash* dropout;
  uint32_t dropout_row;
  int64_t k0;
  acc_t keep_scale;

  // Only the scale: the fused fast path.
  bool plain() const {
    return softcap == acc_t(0) && slope == acc_t(0) && kept == nullptr && !mask.active();
  }
  // Whether a mask may hide keys of the row's window range, and whether it leaves key c visible.
  bool masks_keys() const { return kept != nullptr || mask.active(); }
  bool sees(int64_t c) const { return (!kept || kept[c]) && (!mask.active() || !mask.hides(c)); }

  // x = modified row[c] for c in [begin, end), in place; returns their max (NaN if one is NaN,
  // -inf if none). With softcap, softcap_grad[c] = dx/d(scale S) / scale = 1 - tanh^2 where not
  // null (the backward's chain rule).
  acc_t apply(acc_t* row, int64_t begin, int64_t end, acc_t* softcap_grad = nullptr) const {
    const bool capped = softcap != acc_t(0), biased = slope != acc_t(0);
    acc_t max;
    if (capped && biased) {
      max = modify<true, true>(row, begin, end, softcap_grad);
    } else if (capped) {
      max = modify<true, false>(row, begin, end, softcap_grad);
    } else if (biased) {
      max = modify<false, true>(row, begin, end, nullptr);
    } else {
      max = modify<false, false>(row, begin, end, nullptr);
    }
    if (!masks_keys()) {
      return max;
    }
    if (mask.active()) {
      add_mask(row, begin, end);
    }
    // A hidden key's score is -inf whatever it was (NaN included): zero probability.
    if (kept) {
      for (int64_t i = begin; i < end; ++i) {
        row[i] = kept[i] ? row[i] : -std::numeric_limits<acc_t>::infinity();
      }
    }
    return row_max(row, begin, end);
  }

  // x += attn_mask (floating; -inf where it is -inf, whatever x was) or x = -inf where it is
  // false (bool).
  void add_mask(acc_t* row, int64_t begin, int64_t end) const {
    using Vec = at::vec::Vectorized<acc_t>;
    constexpr acc_t lowest = -std::numeric_limits<acc_t>::infinity();
    if (mask.values && mask.stride == 1) {
      at::vec::map2<acc_t>([](Vec x, Vec m) { return Vec::blendv(x + m, m, m == Vec(lowest)); },
                           row + begin, row + begin, mask.values + begin, end - begin);
      return;
    }
    if (mask.bools && mask.stride == 1) {
      for (int64_t c = begin; c < end; ++c) {
        row[c] = mask.bools[c] ? row[c] : lowest;
      }
      return;
    }
    for (int64_t c = begin; c < end; ++c) {
      row[c] =
          mask.hides(c) ? lowest : (mask.values ? row[c] + mask.values[c * mask.stride] : row[c]);
    }
  }

  // apply's pass for one combination of modifiers, compiled without a branch inside the loop;
  // returns the max of the modified scores (before the key mask's -inf).
  template <bool kCapped, bool kBiased>
  acc_t modify(acc_t* row, int64_t begin, int64_t end, acc_t* softcap_grad) const {
    using Vec = at::vec::Vectorized<acc_t>;
    constexpr int64_t N = Vec::size();
    const Vec scale_vec(scale), cap(softcap);
    // scale S / softcap in one product.
    const Vec scale_over_cap(kCapped ? scale / softcap : acc_t(0));
    const Vec minus_slope{-slope}, one{acc_t(1)}, step{acc_t(N)};
    const Vec lowest(-std::numeric_limits<acc_t>::infinity());
    // diagonal - c of the vector's first column onwards: the distance of each key from the row.
    Vec to_diagonal = Vec(acc_t(diagonal)) - Vec::arange(acc_t(begin), acc_t(1));
    Vec max_vec = lowest;
    for (int64_t c = begin; c < end; c += N) {
      const int64_t n = std::min<int64_t>(N, end - c);
      const Vec s = n == N ? Vec::loadu(row + c) : Vec::loadu(row + c, n);
      Vec x;
      if constexpr (kCapped) {
        const Vec t = softcap_tanh(s * scale_over_cap);
        x = cap * t;
        if (softcap_grad) {
          const Vec grad = one - t * t;
          n == N ? grad.store(softcap_grad + c) : grad.store(softcap_grad + c, n);
        }
      } else {
        x = s * scale_vec;
      }
      if constexpr (kBiased) {
        x = at::vec::fmadd(minus_slope, to_diagonal.abs(), x);
        to_diagonal = to_diagonal - step;
      }
      if (n == N) {
        x.store(row + c);
        max_vec = at::vec::maximum(max_vec, x);
      } else {
        x.store(row + c, n);
        max_vec = at::vec::maximum(max_vec, Vec::set(lowest, x, n));
      }
    }
    return at::vec::vec_reduce_all<acc_t>([](Vec& a, Vec& b) { return at::vec::maximum(a, b); },
                                          max_vec);
  }

  // max of row[begin, end), NaN if one is NaN, -inf if the range is empty.
  static acc_t row_max(const acc_t* row, int64_t begin, int64_t end) {
    using Vec = at::vec::Vectorized<acc_t>;
    constexpr int64_t N = Vec::size();
    const Vec lowest(-std::numeric_limits<acc_t>::infinity());
    Vec max_vec = lowest;
    int64_t c = begin;
    for (; c + N <= end; c += N) {
      max_vec = at::vec::maximum(max_vec, Vec::loadu(row + c));
    }
    if (c < end) {
      max_vec = at::vec::maximum(max_vec, Vec::set(lowest, Vec::loadu(row + c, end - c), end - c));
    }
    return at::vec::vec_reduce_all<acc_t>([](Vec& a, Vec& b) { return at::vec::maximum(a, b); },
                                          max_vec);
  }

  // row[c] = kept ? row[c] * factor : 0 for c in [begin, end) under the dropout mask.
  void drop(acc_t* row, int64_t begin, int64_t end, acc_t factor) const {
    dropout->apply(row, begin, end, dropout_row, k0, factor);
  }
  // factors[c] = kept ? factor : 0 for c in [begin, end): the mask, to apply more than once.
  void keep_factors(acc_t* factors, int64_t begin, int64_t end, acc_t factor) const {
    dropout->keep_factors(factors, begin, end, dropout_row, k0, factor);
  }
};

// The modifiers of a call, from its KernelScoreOptions.
template <typename acc_t>
class ScoreModifiers {
 public:
  template <typename Tensors>
  explicit ScoreModifiers(const Tensors& t)
      : scale_(static_cast<acc_t>(t.scale)),
        softcap_(static_cast<acc_t>(t.options.softcap)),
        slopes_(t.options.alibi_slopes.defined() ? t.options.alibi_slopes.template data_ptr<float>()
                                                 : nullptr),
        sinks_(t.options.sinks.defined() ? t.options.sinks.template data_ptr<acc_t>() : nullptr),
        heads_q_(t.q.size(1)),
        dropout_(t.options.dropout_p, t.options.dropout_seed, t.options.dropout_offset),
        keep_scale_(acc_t(1) / acc_t(1 - t.options.dropout_p)) {}

  // Query row `row` of batch item b, query head h, against the keys from k0 of a block pair with
  // these masks.
  RowScoring<acc_t> row(const AttentionDims& d, int64_t b, int64_t h, int64_t row, int64_t k0,
                        const BlockMasks& masks) const {
    return {scale_,
            softcap_,
            slopes_ ? acc_t(slopes_[b * heads_q_ + h]) : acc_t(0),
            row + d.off(b) - k0,
            masks.kept,
            masks.attn_mask ? d.attn_mask.row<acc_t>(b, h, row, k0) : MaskRow<acc_t>{},
            dropout_.active() ? &dropout_ : nullptr,
            dropout_.active() ? dropout_.row_key(b, h, row) : 0u,
            k0,
            keep_scale_};
  }

  // The sink logit of query head h, -inf without sinks (exp(-inf) joins no denominator).
  acc_t sink(int64_t h) const {
    return sinks_ ? sinks_[h] : -std::numeric_limits<acc_t>::infinity();
  }
  bool has_sinks() const { return sinks_ != nullptr; }
  bool has_softcap() const { return softcap_ != acc_t(0); }
  // 1 / (1 - p): the factor of the kept probabilities.
  acc_t keep_scale() const { return keep_scale_; }

 private:
  acc_t scale_, softcap_;
  const float* slopes_;
  const acc_t* sinks_;
  int64_t heads_q_;
  DropoutHash dropout_;
  acc_t keep_scale_;
};

}  // namespace causal_attention::cpu::CPU_CAPABILITY
