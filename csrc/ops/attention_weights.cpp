// attention_weights: the probabilities that `attention` applies to v, materialized as
// (..., Hq, Lq, Lk) for inspection. It is O(Lq * Lk) by design, so it is written with ATen ops as
// a CompositeImplicitAutograd kernel: autograd, Meta, torch.compile and torch.export all come from
// the decomposition, and no hand-written backward can drift from the forward.
#include "checks.h"
#include "shapes.h"

#include <ATen/ops/arange.h>
#include <ATen/ops/matmul.h>
#include <ATen/ops/softmax.h>
#include <torch/library.h>

#include <limits>

namespace causal_attention {
namespace {

// Scaled scores q k^T (..., Hq, Lq, Lk) in the accumulation dtype. Query heads are viewed as
// (..., Hkv, Hq / Hkv, Lq, D) so that each K/V head is broadcast over its group, never copied.
at::Tensor grouped_scores(const at::Tensor& q, const at::Tensor& k, double scale) {
  const at::ScalarType accumulation = detail::accumulation_dtype(q.scalar_type());
  const at::Tensor q_acc = q.to(accumulation);
  const at::Tensor k_t = k.to(accumulation).transpose(-2, -1);
  if (q.dim() == 2 || q.sym_size(-3) == k.sym_size(-3)) {
    return at::matmul(q_acc, k_t).mul(scale);
  }
  const c10::SymInt heads_kv = k.sym_size(-3);
  std::vector<c10::SymInt> grouped(q.sym_sizes().begin(), q.sym_sizes().end());
  grouped.insert(grouped.end() - 2, q.sym_size(-3) / heads_kv);
  grouped[grouped.size() - 4] = heads_kv;
  const at::Tensor scores = at::matmul(q_acc.reshape_symint(grouped), k_t.unsqueeze(-3)).mul(scale);
  std::vector<c10::SymInt> flat(q.sym_sizes().begin(), q.sym_sizes().end());
  flat.back() = k.sym_size(-2);
  return scores.reshape_symint(flat);
}

at::Tensor attention_weights_composite(const at::Tensor& q, const at::Tensor& k,
                                       const at::Tensor& v, std::optional<double> scale,
                                       const std::optional<at::Tensor>& key_mask) {
  constexpr const char* op = "causal_attention.attention_weights";
  detail::check_attention_inputs(op, q, k, v);
  detail::check_key_mask(op, q, k, key_mask);
  const double resolved = detail::resolve_scale(op, q, scale);
  const at::Tensor scores = grouped_scores(q, k, resolved);

  const c10::SymInt len_q = q.sym_size(-2);
  const c10::SymInt len_k = k.sym_size(-2);
  const auto index_options = q.options().dtype(at::kLong);
  const at::Tensor rows = at::arange(len_q, index_options).unsqueeze(-1);
  const at::Tensor cols = at::arange(len_k, index_options);
  // (Lq, Lk): key j is hidden from query row i iff j > i + (Lk - Lq), bottom-right aligned, or
  // the key mask hides it.
  at::Tensor hidden = cols.gt(rows.add(c10::Scalar(len_k - len_q)));
  if (key_mask.has_value()) {
    hidden = hidden.logical_or(detail::key_mask_over_scores(q, *key_mask).logical_not());
  }

  // A row with no visible key would be a softmax over nothing but -inf, which is NaN in value
  // and gradient. Such rows keep their finite scores through the softmax and are zeroed after
  // it, which gives zeros and a zero gradient.
  const at::Tensor row_sees_a_key = hidden.logical_not().any(-1, /*keepdim=*/true);
  const at::Tensor probabilities =
      at::softmax(scores.masked_fill(hidden.logical_and(row_sees_a_key),
                                     -std::numeric_limits<double>::infinity()),
                  -1);
  return probabilities.masked_fill(hidden, 0).to(q.scalar_type());
}

}  // namespace

TORCH_LIBRARY_IMPL(causal_attention, CompositeImplicitAutograd, m) {
  m.impl("attention_weights", attention_weights_composite);
}

}  // namespace causal_attention
