// Autograd for the ops, in C++ so that a C++-only program (GoogleTest, a TorchScript model run
// with torch::jit::load) can run backward, and torch.compile traces the forward and backward ops
// as units. Each Function redispatches below autograd; the backward op's own Function refuses a
// second derivative, loudly.
#include "causal_attention/ops.h"

#include "../checks.h"

#include <torch/autograd.h>
#include <torch/library.h>

namespace causal_attention {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

class AttentionBackwardFunction : public torch::autograd::Function<AttentionBackwardFunction> {
 public:
  static variable_list forward(AutogradContext* /*ctx*/, const at::Tensor& grad_out,
                               const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                               const at::Tensor& out, const at::Tensor& lse, double scale) {
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [dq, dk, dv] = attention_backward(grad_out, q, k, v, out, lse, scale);
    return {dq, dk, dv};
  }

  static variable_list backward(AutogradContext* /*ctx*/, const variable_list& /*grads*/) {
    TORCH_CHECK(false,
                "causal_attention.attention: double backward (a gradient of the gradient) is not "
                "supported");
  }
};

// Differentiable in out; lse is returned for callers that need it but is not differentiable.
class AttentionForwardFunction : public torch::autograd::Function<AttentionForwardFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k,
                               const at::Tensor& v, double scale) {
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [out, lse] = attention_forward(q, k, v, scale);
    ctx->save_for_backward({q, k, v, out, lse});
    ctx->saved_data["scale"] = scale;
    ctx->mark_non_differentiable({lse});
    return {out, lse};
  }

  static variable_list backward(AutogradContext* ctx, const variable_list& grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& grad_out = grads[0];
    if (!grad_out.defined()) {
      return {at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
    }
    auto dq_dk_dv =
        AttentionBackwardFunction::apply(grad_out, saved[0], saved[1], saved[2], saved[3], saved[4],
                                         ctx->saved_data["scale"].toDouble());
    return {dq_dk_dv[0], dq_dk_dv[1], dq_dk_dv[2], at::Tensor()};
  }
};

at::Tensor attention_autograd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                              std::optional<double> scale) {
  const double resolved = detail::check_attention_call(q, k, v, scale);
  return AttentionForwardFunction::apply(q, k, v, resolved)[0];
}

std::tuple<at::Tensor, at::Tensor> attention_forward_autograd(const at::Tensor& q,
                                                              const at::Tensor& k,
                                                              const at::Tensor& v, double scale) {
  // Checked before Function::apply, which cannot handle an undefined input gracefully.
  detail::check_forward_call(q, k, v, scale);
  auto out_lse = AttentionForwardFunction::apply(q, k, v, scale);
  return {out_lse[0], out_lse[1]};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_backward_autograd(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& lse, double scale) {
  detail::check_backward_inputs(grad_out, q, k, v, out, lse, scale);
  auto grads = AttentionBackwardFunction::apply(grad_out, q, k, v, out, lse, scale);
  return {grads[0], grads[1], grads[2]};
}

}  // namespace

TORCH_LIBRARY_IMPL(causal_attention, Autograd, m) {
  m.impl("attention", attention_autograd);
  m.impl("attention_forward", attention_forward_autograd);
  m.impl("attention_backward", attention_backward_autograd);
}

}  // namespace causal_attention
