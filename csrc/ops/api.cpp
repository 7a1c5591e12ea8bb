// The public C++ API (causal_attention/ops.h) and the dispatcher calls of schema_adapters.h. The
// API calls through cached dispatcher handles rather than the kernels, so C++ callers get
// autograd, autocast, Meta and device dispatch exactly as Python callers do.
#include "causal_attention/ops.h"

#include "schema_adapters.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/Exception.h>

#include <optional>
#include <tuple>
#include <utility>

namespace causal_attention {
namespace detail {
namespace {

template <typename Signature>
c10::TypedOperatorHandle<Signature> operator_handle(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

}  // namespace

at::Tensor call_attention(const AttentionCall& c) {
  const ScoreOptions& o = c.options;
  if (c.packed.any()) {
    static auto op =
        operator_handle<VarlenAttentionSignature>("causal_attention::varlen_attention");
    const PackedLengths& p = c.packed;
    return op.call(c.q, c.k, c.v, p.cu_seqlens_q.value_or(at::Tensor()),
                   p.cu_seqlens_k.value_or(at::Tensor()), p.max_seqlen_q.value_or(0),
                   p.max_seqlen_k.value_or(0), c.scale, o.window, o.softcap, o.alibi_slopes,
                   o.sinks, o.dropout_p, c.generator);
  }
  static auto op = operator_handle<AttentionSignature>("causal_attention::attention");
  return op.call(c.q, c.k, c.v, c.scale, c.key_mask, c.attn_mask, o.window, o.softcap,
                 o.alibi_slopes, o.sinks, o.dropout_p, c.generator);
}

at::Tensor call_attention_weights(const AttentionCall& c) {
  static auto op = operator_handle<AttentionSignature>("causal_attention::attention_weights");
  const ScoreOptions& o = c.options;
  return op.call(c.q, c.k, c.v, c.scale, c.key_mask, c.attn_mask, o.window, o.softcap,
                 o.alibi_slopes, o.sinks, o.dropout_p, c.generator);
}

std::tuple<at::Tensor, at::Tensor> call_attention_forward(const ForwardCall& c) {
  static auto op = operator_handle<ForwardSignature>("causal_attention::attention_forward");
  const ScoreOptions& o = c.options;
  const PackedLengths& p = c.packed;
  return op.call(c.q, c.k, c.v, c.scale, c.key_mask, o.window, o.softcap, o.alibi_slopes, o.sinks,
                 o.dropout_p, o.dropout_seed, p.cu_seqlens_q, p.cu_seqlens_k, p.max_seqlen_q,
                 p.max_seqlen_k, c.attn_mask, c.query_offset);
}

std::tuple<at::Tensor, at::Tensor> call_paged_attention(const PagedCall& c) {
  static auto op = operator_handle<PagedSignature>("causal_attention::paged_attention");
  const ScoreOptions& o = c.options;
  return op.call(c.q, c.k_cache, c.v_cache, c.block_table, c.cache_seqlens, c.cu_seqlens_q,
                 c.max_seqlen_q, c.scale, o.window, o.softcap, o.alibi_slopes, o.sinks, c.k_scale,
                 c.v_scale, c.spec_mask);
}

namespace {

// attention_gradients and attention_backward through their handle: the call's flat arguments,
// then the ones the op has beyond attention_backward's.
template <typename Op, typename... Extra>
auto call_backward_op(const Op& op, const BackwardCall& c, Extra... extra) {
  const ScoreOptions& o = c.options;
  const PackedLengths& p = c.packed;
  return op.call(c.grad_out, c.q, c.k, c.v, c.out, c.lse, c.scale, c.key_mask, o.window, o.softcap,
                 o.alibi_slopes, o.sinks, o.dropout_p, o.dropout_seed, p.cu_seqlens_q,
                 p.cu_seqlens_k, p.max_seqlen_q, p.max_seqlen_k, c.attn_mask, extra...);
}

}  // namespace

Gradients call_attention_gradients(const BackwardCall& c) {
  static auto op = operator_handle<GradientsSignature>("causal_attention::attention_gradients");
  return call_backward_op(op, c, c.attn_mask_grad, c.query_offset, c.delta);
}

BackwardGradients call_attention_backward(const BackwardCall& c) {
  static auto op = operator_handle<BackwardSignature>("causal_attention::attention_backward");
  return call_backward_op(op, c, c.query_offset, c.delta);
}

}  // namespace detail

namespace {

// The score options of a C++ API call (the kernel ops' seed aside).
detail::ScoreOptions score_options(const AttentionOptions& options) {
  detail::ScoreOptions score;
  score.window.assign(options.window().begin(), options.window().end());
  score.softcap = options.softcap();
  score.alibi_slopes = options.alibi_slopes();
  score.sinks = options.sinks();
  score.dropout_p = options.dropout_p();
  return score;
}

// A C++ API call of a differentiable op as the struct the ops take.
detail::AttentionCall attention_call(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                     const AttentionOptions& options) {
  detail::AttentionCall call{q, k, v};
  call.scale = options.scale();
  call.key_mask = options.key_mask();
  call.attn_mask = options.attn_mask();
  call.options = score_options(options);
  call.generator = options.generator();
  return call;
}

// The kernel ops take the scale as an argument and the seed given: the options' scale and
// generator have no place there.
detail::ForwardCall forward_call(const char* op, const at::Tensor& q, const at::Tensor& k,
                                 const at::Tensor& v, double scale, const AttentionOptions& options,
                                 const std::optional<at::Tensor>& dropout_seed) {
  TORCH_CHECK_VALUE(!options.scale().has_value() && !options.generator().has_value(), op,
                    ": the kernel ops take the scale as an argument and dropout_seed for dropout; "
                    "AttentionOptions::scale and ::generator are for attention, "
                    "attention_weights and varlen_attention");
  detail::ForwardCall forward{q, k, v};
  forward.scale = scale;
  forward.key_mask = options.key_mask();
  forward.attn_mask = options.attn_mask();
  forward.options = score_options(options);
  forward.options.dropout_seed = dropout_seed;
  return forward;
}

detail::BackwardCall backward_call(const char* op, const at::Tensor& grad_out, const at::Tensor& q,
                                   const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
                                   const at::Tensor& lse, double scale,
                                   const AttentionOptions& options,
                                   const std::optional<at::Tensor>& dropout_seed) {
  detail::BackwardCall call(forward_call(op, q, k, v, scale, options, dropout_seed));
  call.grad_out = grad_out;
  call.out = out;
  call.lse = lse;
  return call;
}

}  // namespace

at::Tensor attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                     const AttentionOptions& options) {
  return detail::call_attention(attention_call(q, k, v, options));
}

at::Tensor attention_weights(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                             const AttentionOptions& options) {
  return detail::call_attention_weights(attention_call(q, k, v, options));
}

at::Tensor varlen_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k,
                            c10::SymInt max_seqlen_q, c10::SymInt max_seqlen_k,
                            const AttentionOptions& options) {
  TORCH_CHECK_VALUE(!options.key_mask().has_value() && !options.attn_mask().has_value(),
                    "causal_attention.varlen_attention: key_mask and attn_mask are for dense "
                    "calls; packed sequences (cu_seqlens) hold no padding, and each sequence sees "
                    "only its own keys");
  detail::AttentionCall call = attention_call(q, k, v, options);
  call.packed = {cu_seqlens_q, cu_seqlens_k, std::move(max_seqlen_q), std::move(max_seqlen_k)};
  return detail::call_attention(call);
}

std::tuple<at::Tensor, at::Tensor> attention_forward(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale,
    const AttentionOptions& options, const std::optional<at::Tensor>& dropout_seed) {
  return detail::call_attention_forward(
      forward_call("causal_attention.attention_forward", q, k, v, scale, options, dropout_seed));
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> attention_gradients(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& lse, double scale, const AttentionOptions& options,
    const std::optional<at::Tensor>& dropout_seed, bool attn_mask_grad) {
  detail::BackwardCall call = backward_call("causal_attention.attention_gradients", grad_out, q, k,
                                            v, out, lse, scale, options, dropout_seed);
  call.attn_mask_grad = attn_mask_grad;
  return detail::call_attention_gradients(call);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> attention_backward(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& lse, double scale, const AttentionOptions& options,
    const std::optional<at::Tensor>& dropout_seed) {
  return detail::call_attention_backward(backward_call("causal_attention.attention_backward",
                                                       grad_out, q, k, v, out, lse, scale, options,
                                                       dropout_seed));
}

std::tuple<at::Tensor, at::Tensor> paged_attention(
    const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
    const at::Tensor& block_table, const at::Tensor& cache_seqlens, const AttentionOptions& options,
    const std::optional<at::Tensor>& cu_seqlens_q, std::optional<c10::SymInt> max_seqlen_q,
    const std::optional<at::Tensor>& k_scale, const std::optional<at::Tensor>& v_scale,
    const std::optional<at::Tensor>& spec_mask) {
  TORCH_CHECK_VALUE(!options.key_mask().has_value() && !options.attn_mask().has_value() &&
                        options.dropout_p() == 0 && !options.generator().has_value(),
                    "causal_attention.paged_attention: key_mask, attn_mask and dropout are not "
                    "options of the paged op (an inference op over whole sequences: their "
                    "lengths are cache_seqlens); got key_mask=",
                    options.key_mask().has_value(), ", attn_mask=", options.attn_mask().has_value(),
                    ", dropout_p=", options.dropout_p());
  detail::PagedCall call{q, k_cache, v_cache, block_table, cache_seqlens};
  call.cu_seqlens_q = cu_seqlens_q;
  call.max_seqlen_q = std::move(max_seqlen_q);
  call.scale = options.scale();
  call.options = score_options(options);
  call.k_scale = k_scale;
  call.v_scale = v_scale;
  call.spec_mask = spec_mask;
  return detail::call_paged_attention(call);
}

at::Tensor dropout_keep_mask(const at::Tensor& dropout_seed, c10::SymIntArrayRef shape,
                             double dropout_p) {
  static auto op =
      detail::operator_handle<decltype(dropout_keep_mask)>("causal_attention::dropout_keep_mask");
  return op.call(dropout_seed, shape, dropout_p);
}

}  // namespace causal_attention
