// Autograd for the ops, in C++ so that a C++-only program (GoogleTest, a TorchScript model run
// with torch::jit::load) can run backward, and torch.compile traces the forward and backward ops
// as units. Each Function redispatches below autograd; the backward ops' own Functions refuse a
// second derivative, loudly. Key masks and cumulative lengths are not differentiable: they get
// no gradient.
#include "causal_attention/ops.h"

#include "../checks.h"

#include <torch/autograd.h>
#include <torch/library.h>

namespace causal_attention {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

[[noreturn]] void refuse_double_backward(const char* op) {
  TORCH_CHECK(false, op, ": double backward (a gradient of the gradient) is not supported");
}

class AttentionBackwardFunction : public torch::autograd::Function<AttentionBackwardFunction> {
 public:
  static variable_list forward(AutogradContext* /*ctx*/, const at::Tensor& grad_out,
                               const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                               const at::Tensor& out, const at::Tensor& lse, double scale,
                               const std::optional<at::Tensor>& key_mask) {
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [dq, dk, dv] = attention_backward(grad_out, q, k, v, out, lse, scale, key_mask);
    return {dq, dk, dv};
  }

  static variable_list backward(AutogradContext* /*ctx*/, const variable_list& /*grads*/) {
    refuse_double_backward("causal_attention.attention");
  }
};

// Differentiable in out; lse is returned for callers that need it but is not differentiable.
class AttentionForwardFunction : public torch::autograd::Function<AttentionForwardFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k,
                               const at::Tensor& v, double scale,
                               const std::optional<at::Tensor>& key_mask) {
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [out, lse] = attention_forward(q, k, v, scale, key_mask);
    ctx->save_for_backward({q, k, v, out, lse});
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["key_mask"] = key_mask;
    ctx->mark_non_differentiable({lse});
    return {out, lse};
  }

  static variable_list backward(AutogradContext* ctx, const variable_list& grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& grad_out = grads[0];
    if (!grad_out.defined()) {
      return {at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
    }
    auto dq_dk_dv = AttentionBackwardFunction::apply(
        grad_out, saved[0], saved[1], saved[2], saved[3], saved[4],
        ctx->saved_data["scale"].toDouble(), ctx->saved_data["key_mask"].toOptional<at::Tensor>());
    return {dq_dk_dv[0], dq_dk_dv[1], dq_dk_dv[2], at::Tensor(), at::Tensor()};
  }
};

at::Tensor attention_autograd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                              std::optional<double> scale,
                              const std::optional<at::Tensor>& key_mask) {
  const double resolved = detail::check_attention_call(q, k, v, scale, key_mask);
  return AttentionForwardFunction::apply(q, k, v, resolved, key_mask)[0];
}

std::tuple<at::Tensor, at::Tensor> attention_forward_autograd(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale,
    const std::optional<at::Tensor>& key_mask) {
  // Checked before Function::apply, which cannot handle an undefined input gracefully.
  detail::check_forward_call(q, k, v, scale, key_mask);
  auto out_lse = AttentionForwardFunction::apply(q, k, v, scale, key_mask);
  return {out_lse[0], out_lse[1]};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_backward_autograd(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& lse, double scale,
    const std::optional<at::Tensor>& key_mask) {
  detail::check_backward_inputs(grad_out, q, k, v, out, lse, scale, key_mask);
  auto grads = AttentionBackwardFunction::apply(grad_out, q, k, v, out, lse, scale, key_mask);
  return {grads[0], grads[1], grads[2]};
}

// The packed-sequence ops, the same way.
class VarlenBackwardFunction : public torch::autograd::Function<VarlenBackwardFunction> {
 public:
  static variable_list forward(AutogradContext* /*ctx*/, const at::Tensor& grad_out,
                               const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                               const at::Tensor& out, const at::Tensor& lse,
                               const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k,
                               c10::SymInt max_seqlen_q, c10::SymInt max_seqlen_k, double scale) {
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [dq, dk, dv] = varlen_attention_backward(grad_out, q, k, v, out, lse, cu_seqlens_q,
                                                  cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale);
    return {dq, dk, dv};
  }

  static variable_list backward(AutogradContext* /*ctx*/, const variable_list& /*grads*/) {
    refuse_double_backward("causal_attention.varlen_attention");
  }
};

class VarlenForwardFunction : public torch::autograd::Function<VarlenForwardFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k,
                               const at::Tensor& v, const at::Tensor& cu_seqlens_q,
                               const at::Tensor& cu_seqlens_k, c10::SymInt max_seqlen_q,
                               c10::SymInt max_seqlen_k, double scale) {
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [out, lse] = varlen_attention_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                               max_seqlen_k, scale);
    ctx->save_for_backward({q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k});
    ctx->saved_data["max_seqlen_q"] = max_seqlen_q;
    ctx->saved_data["max_seqlen_k"] = max_seqlen_k;
    ctx->saved_data["scale"] = scale;
    ctx->mark_non_differentiable({lse});
    return {out, lse};
  }

  static variable_list backward(AutogradContext* ctx, const variable_list& grads) {
    const auto saved = ctx->get_saved_variables();
    if (!grads[0].defined()) {
      return variable_list(8);
    }
    auto dq_dk_dv = VarlenBackwardFunction::apply(
        grads[0], saved[0], saved[1], saved[2], saved[3], saved[4], saved[5], saved[6],
        ctx->saved_data["max_seqlen_q"].toSymInt(), ctx->saved_data["max_seqlen_k"].toSymInt(),
        ctx->saved_data["scale"].toDouble());
    variable_list grads_in(8);
    grads_in[0] = dq_dk_dv[0];
    grads_in[1] = dq_dk_dv[1];
    grads_in[2] = dq_dk_dv[2];
    return grads_in;
  }
};

at::Tensor varlen_attention_autograd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                     const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k,
                                     c10::SymInt max_seqlen_q, c10::SymInt max_seqlen_k,
                                     std::optional<double> scale) {
  const double resolved = detail::check_varlen_attention_call(q, k, v, cu_seqlens_q, cu_seqlens_k,
                                                              max_seqlen_q, max_seqlen_k, scale);
  return VarlenForwardFunction::apply(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                      max_seqlen_k, resolved)[0];
}

std::tuple<at::Tensor, at::Tensor> varlen_attention_forward_autograd(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cu_seqlens_q,
    const at::Tensor& cu_seqlens_k, c10::SymInt max_seqlen_q, c10::SymInt max_seqlen_k,
    double scale) {
  detail::check_varlen_forward_call(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                    scale);
  auto out_lse = VarlenForwardFunction::apply(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                              max_seqlen_k, scale);
  return {out_lse[0], out_lse[1]};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> varlen_attention_backward_autograd(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& lse, const at::Tensor& cu_seqlens_q,
    const at::Tensor& cu_seqlens_k, c10::SymInt max_seqlen_q, c10::SymInt max_seqlen_k,
    double scale) {
  detail::check_varlen_backward_inputs(grad_out, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k,
                                       max_seqlen_q, max_seqlen_k, scale);
  auto grads = VarlenBackwardFunction::apply(grad_out, q, k, v, out, lse, cu_seqlens_q,
                                             cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale);
  return {grads[0], grads[1], grads[2]};
}

}  // namespace

TORCH_LIBRARY_IMPL(causal_attention, Autograd, m) {
  m.impl("attention", attention_autograd);
  m.impl("attention_forward", attention_forward_autograd);
  m.impl("attention_backward", attention_backward_autograd);
  m.impl("varlen_attention", varlen_attention_autograd);
  m.impl("varlen_attention_forward", varlen_attention_forward_autograd);
  m.impl("varlen_attention_backward", varlen_attention_backward_autograd);
}

}  // namespace causal_attention
