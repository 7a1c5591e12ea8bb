// attention_weights: the probabilities that `attention` applies to v, materialized as
// (..., Hq, Lq, Lk) for inspection, with every score option (ops.h) applied by its definition,
// in the same order, and the dropout mask of the kernels (dropout_keep_mask). It is O(Lq * Lk) by
// design, so it is written with ATen ops as a CompositeImplicitAutograd kernel: autograd, Meta,
// torch.compile and torch.export all come from the decomposition, and no hand-written backward can
// drift from the forward.
#include "causal_attention/ops.h"
#include "checks.h"
#include "schema_adapters.h"
#include "shapes.h"

#include <ATen/ops/arange.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/matmul.h>
#include <ATen/ops/softmax.h>
#include <ATen/ops/zeros_like.h>
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

// A per-head tensor (Hq,) or (*batch, Hq) (slopes, sinks) as (*batch, Hq, 1, 1), to broadcast
// against scores (..., Hq, Lq, Lk); (1, 1) for a 2-D call, which has no heads dim.
at::Tensor per_head(const at::Tensor& q, const at::Tensor& t) {
  return q.dim() == 2 ? t.reshape({1, 1}) : t.unsqueeze(-1).unsqueeze(-1);
}

at::Tensor attention_weights_composite(const detail::AttentionCall& call) {
  const double resolved = detail::check_attention_call("causal_attention.attention_weights", call);
  const at::Tensor &q = call.q, &k = call.k;
  const detail::ScoreOptions& options = call.options;
  const std::vector<int64_t>& window = options.window;
  const std::optional<double>& softcap = options.softcap;
  at::Tensor scores = grouped_scores(q, k, resolved);
  if (softcap.has_value()) {
    scores = scores.div(*softcap).tanh().mul(*softcap);
  }

  const c10::SymInt len_q = q.sym_size(-2);
  const c10::SymInt len_k = k.sym_size(-2);
  const auto index_options = q.options().dtype(at::kLong);
  const at::Tensor cols = at::arange(len_k, index_options);
  // (Lq, Lk): i + off - j for query row i and key j, off = Lk - Lq (bottom-right alignment).
  const at::Tensor distance =
      at::arange(len_q, index_options).add(c10::Scalar(len_k - len_q)).unsqueeze(-1).sub(cols);
  if (options.alibi_slopes.has_value()) {
    scores = scores.sub(per_head(q, *options.alibi_slopes)
                            .to(scores.scalar_type())
                            .mul(distance.abs().to(scores.scalar_type())));
  }
  // Key j is hidden from row i outside the window i + off - left <= j <= i + off + right, where
  // the key mask hides it, or where attn_mask does (False, or -inf added to the score).
  at::Tensor hidden = at::zeros_like(distance, distance.options().dtype(at::kBool));
  if (call.attn_mask.has_value()) {
    const at::Tensor& mask = *call.attn_mask;
    if (mask.scalar_type() == at::kBool) {
      hidden = hidden.logical_or(mask.logical_not());
    } else {
      // Its -inf entries hide their keys and add nothing: a row they hide whole keeps finite
      // scores (zeroed below with a zero gradient, not a softmax of -inf's NaN), and those
      // entries' gradient is zero, as attention's.
      const at::Tensor mask_hides = mask.eq(-std::numeric_limits<double>::infinity());
      scores = scores.add(mask.masked_fill(mask_hides, 0).to(scores.scalar_type()));
      hidden = hidden.logical_or(mask_hides);
    }
  }
  if (window[0] >= 0) {
    hidden = hidden.logical_or(distance.gt(window[0]));
  }
  if (window[1] >= 0) {
    hidden = hidden.logical_or(distance.lt(-window[1]));
  }
  if (call.key_mask.has_value()) {
    hidden = hidden.logical_or(detail::key_mask_over_scores(q, *call.key_mask).logical_not());
  }

  at::Tensor probabilities;
  if (options.sinks.has_value()) {
    // The sink is one more column of the softmax, dropped after it: it only joins the
    // denominator, and keeps a row that sees no key finite (all its weight on the sink).
    const at::Tensor masked = scores.masked_fill(hidden, -std::numeric_limits<double>::infinity());
    std::vector<c10::SymInt> sink_sizes(masked.sym_sizes().begin(), masked.sym_sizes().end());
    sink_sizes.back() = 1;
    const at::Tensor sink_column =
        per_head(q, *options.sinks).to(scores.scalar_type()).expand_symint(sink_sizes);
    probabilities = at::softmax(at::cat({masked, sink_column}, -1), -1).narrow_symint(-1, 0, len_k);
  } else {
    // A row with no visible key would be a softmax over nothing but -inf, which is NaN in
    // value and gradient. Such rows keep their finite scores through the softmax and are zeroed
    // after it, which gives zeros and a zero gradient.
    const at::Tensor row_sees_a_key = hidden.logical_not().any(-1, /*keepdim=*/true);
    probabilities = at::softmax(scores.masked_fill(hidden.logical_and(row_sees_a_key),
                                                   -std::numeric_limits<double>::infinity()),
                                -1);
  }
  probabilities = probabilities.masked_fill(hidden, 0);
  if (const double dropout_p = options.dropout_p; dropout_p > 0) {
    const at::Tensor keep = dropout_keep_mask(*detail::draw_dropout_seed(dropout_p, call.generator),
                                              probabilities.sym_sizes(), dropout_p);
    probabilities = probabilities.mul(keep).div(1 - dropout_p);
  }
  return probabilities.to(q.scalar_type());
}

}  // namespace

TORCH_LIBRARY_IMPL(causal_attention, CompositeImplicitAutograd, m) {
  m.impl("attention_weights", detail::attention_from_schema<attention_weights_composite>);
}

}  // namespace causal_attention
