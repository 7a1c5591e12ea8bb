// The op schemas, defined once, and the public C++ API. The API calls through cached
// dispatcher handles rather than the kernels, so C++ callers get autograd, Meta and device
// dispatch exactly as Python callers do.
#include "causal_attention/ops.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

namespace causal_attention {
namespace {

c10::TypedOperatorHandle<decltype(attention)> attention_handle() {
  static const auto handle = c10::Dispatcher::singleton()
                                 .findSchemaOrThrow("causal_attention::attention", "")
                                 .typed<decltype(attention)>();
  return handle;
}

c10::TypedOperatorHandle<decltype(attention_forward)> attention_forward_handle() {
  static const auto handle = c10::Dispatcher::singleton()
                                 .findSchemaOrThrow("causal_attention::attention_forward", "")
                                 .typed<decltype(attention_forward)>();
  return handle;
}

c10::TypedOperatorHandle<decltype(attention_backward)> attention_backward_handle() {
  static const auto handle = c10::Dispatcher::singleton()
                                 .findSchemaOrThrow("causal_attention::attention_backward", "")
                                 .typed<decltype(attention_backward)>();
  return handle;
}

c10::TypedOperatorHandle<decltype(attention_weights)> attention_weights_handle() {
  static const auto handle = c10::Dispatcher::singleton()
                                 .findSchemaOrThrow("causal_attention::attention_weights", "")
                                 .typed<decltype(attention_weights)>();
  return handle;
}

}  // namespace

at::Tensor attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                     std::optional<double> scale) {
  return attention_handle().call(q, k, v, scale);
}

std::tuple<at::Tensor, at::Tensor> attention_forward(const at::Tensor& q, const at::Tensor& k,
                                                     const at::Tensor& v, double scale) {
  return attention_forward_handle().call(q, k, v, scale);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_backward(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& lse, double scale) {
  return attention_backward_handle().call(grad_out, q, k, v, out, lse, scale);
}

at::Tensor attention_weights(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                             std::optional<double> scale) {
  return attention_weights_handle().call(q, k, v, scale);
}

TORCH_LIBRARY(causal_attention, m) {
  m.def("attention(Tensor q, Tensor k, Tensor v, *, float? scale=None) -> Tensor");
  m.def("attention_forward(Tensor q, Tensor k, Tensor v, float scale) -> (Tensor out, Tensor lse)");
  m.def(
      "attention_backward(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
      "float scale) -> (Tensor dq, Tensor dk, Tensor dv)");
  m.def("attention_weights(Tensor q, Tensor k, Tensor v, *, float? scale=None) -> Tensor");
}

}  // namespace causal_attention
