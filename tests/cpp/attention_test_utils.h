// Helpers shared by the GoogleTest files: input construction, the SDPA / naive references and
// error-message assertions.
#pragma once

#include "causal_attention/ops.h"

#include <gtest/gtest.h>
#include <torch/autograd.h>
#include <torch/types.h>
#include <torch/utils.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace causal_attention::tests {

// Query row i may attend key j iff j <= i + (Lk - Lq): true = attend.
inline at::Tensor bottom_right_mask(int64_t len_q, int64_t len_k) {
  return torch::ones({len_q, len_k}, torch::kBool).tril(len_k - len_q);
}

inline double default_scale(const at::Tensor& q) {
  return 1.0 / std::sqrt(static_cast<double>(q.size(-1)));
}

// max |a - b| in float64; 0 for empty tensors.
inline double max_abs_diff(const at::Tensor& a, const at::Tensor& b) {
  EXPECT_EQ(a.sizes(), b.sizes());
  if (a.numel() == 0) {
    return 0.0;
  }
  return (a.to(at::kDouble) - b.to(at::kDouble)).abs().max().item<double>();
}

inline double max_abs(const at::Tensor& a) {
  return a.numel() == 0 ? 0.0 : a.to(at::kDouble).abs().max().item<double>();
}

// A tensor of `shape` whose values come from a float64 normal draw (so the same values can be
// had in every dtype). With `transposed`, it is a (..., L, H, D) tensor viewed as (..., H, L, D):
// non-contiguous, unit stride along D.
inline at::Tensor make_input(const std::vector<int64_t>& shape, bool transposed) {
  if (!transposed || shape.size() < 3) {
    return torch::randn(shape, torch::kDouble);
  }
  std::vector<int64_t> base_shape = shape;
  std::swap(base_shape[base_shape.size() - 3], base_shape[base_shape.size() - 2]);
  return torch::randn(base_shape, torch::kDouble).transpose(-3, -2);
}

// Casts to `dtype` keeping the layout (a transposed view stays a transposed view).
inline at::Tensor cast_keep_layout(const at::Tensor& t, at::ScalarType dtype) {
  if (t.dim() >= 3 && !t.is_contiguous() && t.transpose(-3, -2).is_contiguous()) {
    return t.transpose(-3, -2).to(dtype).transpose(-3, -2);
  }
  return t.to(dtype);
}

struct ForwardBackward {
  at::Tensor out, dq, dk, dv;
};

// Runs `fn(q, k, v)` and differentiates it with C++ autograd against grad_out. q, k, v may be
// views: the gradients are taken w.r.t. the views themselves, which sit on the autograd graph.
template <typename Fn>
ForwardBackward run_with_grad(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                              const at::Tensor& grad_out, Fn fn) {
  // Leaves with the given layout; the op sees exactly these tensors' strides.
  at::Tensor ql = q.detach().requires_grad_(true);
  at::Tensor kl = k.detach().requires_grad_(true);
  at::Tensor vl = v.detach().requires_grad_(true);
  at::Tensor out = fn(ql, kl, vl);
  auto grads = torch::autograd::grad({out}, {ql, kl, vl}, {grad_out});
  return {out.detach(), grads[0], grads[1], grads[2]};
}

inline ForwardBackward ours(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const at::Tensor& grad_out, std::optional<double> scale) {
  return run_with_grad(
      q, k, v, grad_out, [&](const at::Tensor& a, const at::Tensor& b, const at::Tensor& c) {
        return causal_attention::attention(a, b, c, AttentionOptions().scale(scale));
      });
}

// at::scaled_dot_product_attention with bottom-right causal alignment and GQA.
inline at::Tensor sdpa(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                       std::optional<double> scale) {
  const int64_t len_q = q.size(-2), len_k = k.size(-2);
  const bool gqa = q.dim() >= 3 && q.size(-3) != k.size(-3);
  if (len_q == len_k) {
    return at::scaled_dot_product_attention(q, k, v, /*attn_mask=*/{}, /*dropout_p=*/0.0,
                                            /*is_causal=*/true, scale, gqa);
  }
  return at::scaled_dot_product_attention(q, k, v, bottom_right_mask(len_q, len_k), 0.0,
                                          /*is_causal=*/false, scale, gqa);
}

inline ForwardBackward reference(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                 const at::Tensor& grad_out, std::optional<double> scale) {
  return run_with_grad(q, k, v, grad_out,
                       [&](const at::Tensor& a, const at::Tensor& b, const at::Tensor& c) {
                         return sdpa(a, b, c, scale);
                       });
}

// K/V heads repeated so that query head h reads kv head h / (Hq / Hkv).
inline at::Tensor expand_kv_heads(const at::Tensor& kv, int64_t heads_q) {
  if (kv.dim() < 3 || kv.size(-3) == heads_q) {
    return kv;
  }
  return kv.repeat_interleave(heads_q / kv.size(-3), kv.dim() - 3);
}

// logsumexp over visible keys of scale * q k^T, computed naively in float64: max + log of the
// sum of exp(x - max), row by row with std::exp and std::log. Not at::logsumexp: torch's
// elementwise exp goes through MKL's vector math, whose first call in a process, started on two
// threads at once (a pool our op had warmed), was off by ~1e-9 in a few % of processes (torch
// 2.13, Intel Xeon with AMX; torch alone shows it: tests/python/conftest.py).
inline at::Tensor naive_lse(const at::Tensor& q, const at::Tensor& k, double scale) {
  const at::Tensor q64 = q.to(at::kDouble);
  const at::Tensor k64 = expand_kv_heads(k.to(at::kDouble), q.dim() >= 3 ? q.size(-3) : 1);
  at::Tensor scores = at::matmul(q64, k64.transpose(-2, -1)) * scale;
  scores = scores
               .masked_fill(bottom_right_mask(q.size(-2), k.size(-2)).logical_not(),
                            -std::numeric_limits<double>::infinity())
               .contiguous();
  const int64_t cols = scores.size(-1);
  at::Tensor lse = at::empty(scores.sizes().slice(0, scores.dim() - 1), scores.options());
  const double* row = scores.data_ptr<double>();
  double* out = lse.data_ptr<double>();
  for (int64_t r = 0; r < lse.numel(); ++r, row += cols) {
    const double max = *std::max_element(row, row + cols);
    double sum = 0;
    for (int64_t c = 0; c < cols && max != -std::numeric_limits<double>::infinity(); ++c) {
      sum += std::exp(row[c] - max);
    }
    out[r] = max + std::log(sum);  // -inf for a row that sees no key
  }
  return lse;
}

// Asserts that fn() throws exactly E (checked with EXPECT_THROW) and that the message contains
// every needle.
template <typename E, typename Fn>
void expect_error(Fn&& fn, const std::vector<const char*>& needles) {
  EXPECT_THROW(fn(), E);
  try {
    fn();
  } catch (const E& e) {
    const std::string message = e.what();
    for (const char* needle : needles) {
      EXPECT_NE(message.find(needle), std::string::npos)
          << "message lacks \"" << needle << "\": " << message;
    }
  } catch (...) {
    // Reported by EXPECT_THROW above.
  }
}

// Restores the intra-op thread count on scope exit.
class NumThreadsGuard {
 public:
  NumThreadsGuard() : saved_(at::get_num_threads()) {}
  ~NumThreadsGuard() { at::set_num_threads(saved_); }
  NumThreadsGuard(const NumThreadsGuard&) = delete;
  NumThreadsGuard& operator=(const NumThreadsGuard&) = delete;

 private:
  int saved_;
};

}  // namespace causal_attention::tests
