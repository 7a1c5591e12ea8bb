// The op schemas, defined once, and the public C++ API. The API calls through cached
// dispatcher handles rather than the kernels, so C++ callers get autograd, Meta and device
// dispatch exactly as Python callers do.
#include "causal_attention/ops.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

namespace causal_attention {
namespace {

// The cached dispatcher handle of op `name`, typed by the C++ signature of its schema.
template <typename Signature>
c10::TypedOperatorHandle<Signature> handle(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

using AttentionSignature = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                      std::optional<double>, const std::optional<at::Tensor>&);
using AttentionForwardSignature =
    std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                       double, const std::optional<at::Tensor>&);
using AttentionBackwardSignature = std::tuple<at::Tensor, at::Tensor, at::Tensor>(
    const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
    const at::Tensor&, double, const std::optional<at::Tensor>&);
using VarlenAttentionSignature = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                            const at::Tensor&, const at::Tensor&, c10::SymInt,
                                            c10::SymInt, std::optional<double>);
using VarlenForwardSignature = std::tuple<at::Tensor, at::Tensor>(
    const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
    c10::SymInt, c10::SymInt, double);
using VarlenBackwardSignature = std::tuple<at::Tensor, at::Tensor, at::Tensor>(
    const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
    const at::Tensor&, const at::Tensor&, const at::Tensor&, c10::SymInt, c10::SymInt, double);

}  // namespace

at::Tensor attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                     std::optional<double> scale, const std::optional<at::Tensor>& key_mask) {
  static const auto op = handle<AttentionSignature>("causal_attention::attention");
  return op.call(q, k, v, scale, key_mask);
}

std::tuple<at::Tensor, at::Tensor> attention_forward(const at::Tensor& q, const at::Tensor& k,
                                                     const at::Tensor& v, double scale,
                                                     const std::optional<at::Tensor>& key_mask) {
  static const auto op = handle<AttentionForwardSignature>("causal_attention::attention_forward");
  return op.call(q, k, v, scale, key_mask);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_backward(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& lse, double scale,
    const std::optional<at::Tensor>& key_mask) {
  static const auto op = handle<AttentionBackwardSignature>("causal_attention::attention_backward");
  return op.call(grad_out, q, k, v, out, lse, scale, key_mask);
}

at::Tensor attention_weights(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                             std::optional<double> scale,
                             const std::optional<at::Tensor>& key_mask) {
  static const auto op = handle<AttentionSignature>("causal_attention::attention_weights");
  return op.call(q, k, v, scale, key_mask);
}

at::Tensor varlen_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k,
                            c10::SymInt max_seqlen_q, c10::SymInt max_seqlen_k,
                            std::optional<double> scale) {
  static const auto op = handle<VarlenAttentionSignature>("causal_attention::varlen_attention");
  return op.call(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale);
}

std::tuple<at::Tensor, at::Tensor> varlen_attention_forward(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cu_seqlens_q,
    const at::Tensor& cu_seqlens_k, c10::SymInt max_seqlen_q, c10::SymInt max_seqlen_k,
    double scale) {
  static const auto op =
      handle<VarlenForwardSignature>("causal_attention::varlen_attention_forward");
  return op.call(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> varlen_attention_backward(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& lse, const at::Tensor& cu_seqlens_q,
    const at::Tensor& cu_seqlens_k, c10::SymInt max_seqlen_q, c10::SymInt max_seqlen_k,
    double scale) {
  static const auto op =
      handle<VarlenBackwardSignature>("causal_attention::varlen_attention_backward");
  return op.call(grad_out, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                 max_seqlen_k, scale);
}

TORCH_LIBRARY(causal_attention, m) {
  m.def(
      "attention(Tensor q, Tensor k, Tensor v, *, float? scale=None, Tensor? key_mask=None) -> "
      "Tensor");
  m.def(
      "attention_forward(Tensor q, Tensor k, Tensor v, float scale, Tensor? key_mask=None) -> "
      "(Tensor out, Tensor lse)");
  m.def(
      "attention_backward(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
      "float scale, Tensor? key_mask=None) -> (Tensor dq, Tensor dk, Tensor dv)");
  m.def(
      "attention_weights(Tensor q, Tensor k, Tensor v, *, float? scale=None, "
      "Tensor? key_mask=None) -> Tensor");
  m.def(
      "varlen_attention(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, "
      "SymInt max_seqlen_q, SymInt max_seqlen_k, *, float? scale=None) -> Tensor");
  m.def(
      "varlen_attention_forward(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, "
      "Tensor cu_seqlens_k, SymInt max_seqlen_q, SymInt max_seqlen_k, float scale) -> "
      "(Tensor out, Tensor lse)");
  m.def(
      "varlen_attention_backward(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor out, "
      "Tensor lse, Tensor cu_seqlens_q, Tensor cu_seqlens_k, SymInt max_seqlen_q, "
      "SymInt max_seqlen_k, float scale) -> (Tensor dq, Tensor dk, Tensor dv)");
}

}  // namespace causal_attention
