// Autograd for the ops, in C++ so that a C++-only program (GoogleTest, a TorchScript model run
// with torch::jit::load) can run backward, and torch.compile traces the forward and backward ops
// as units. One Function pair serves dense and packed calls: each redispatches below autograd,
// and the backward op's Function refuses a second derivative, loudly. Key masks, cumulative
// lengths, ALiBi slopes and dropout seeds are not differentiable: they get no gradient; sinks and
// a floating attn_mask get theirs from the backward op (attention_gradients).
#include "../checks.h"
#include "../schema_adapters.h"

#include <c10/util/TypeTraits.h>
#include <torch/autograd.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/library.h>

namespace causal_attention {
namespace {

using detail::BackwardCall;
using detail::ForwardCall;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// The call of the forward as its Function keeps it for the backward: the tensors autograd must
// see as saved (inputs and outputs) through save_for_backward, the rest in saved_data.
void save_call(AutogradContext* ctx, const ForwardCall& call, const at::Tensor& out,
               const at::Tensor& lse) {
  ctx->save_for_backward({call.q, call.k, call.v, out, lse});
  auto& d = ctx->saved_data;
  d["scale"] = call.scale;
  d["key_mask"] = call.key_mask;
  d["attn_mask"] = call.attn_mask;
  d["window"] = call.options.window;
  d["softcap"] = call.options.softcap;
  d["alibi_slopes"] = call.options.alibi_slopes;
  d["sinks"] = call.options.sinks;
  d["dropout_p"] = call.options.dropout_p;
  d["dropout_seed"] = call.options.dropout_seed;
  d["cu_seqlens_q"] = call.packed.cu_seqlens_q;
  d["cu_seqlens_k"] = call.packed.cu_seqlens_k;
  d["max_seqlen_q"] = call.packed.max_seqlen_q;
  d["max_seqlen_k"] = call.packed.max_seqlen_k;
  d["query_offset"] = call.query_offset;
}

BackwardCall load_call(AutogradContext* ctx, const at::Tensor& grad_out) {
  const variable_list saved = ctx->get_saved_variables();
  auto& d = ctx->saved_data;
  BackwardCall call;
  call.q = saved[0];
  call.k = saved[1];
  call.v = saved[2];
  call.out = saved[3];
  call.lse = saved[4];
  call.grad_out = grad_out;
  call.scale = d["scale"].toDouble();
  call.key_mask = d["key_mask"].toOptional<at::Tensor>();
  call.attn_mask = d["attn_mask"].toOptional<at::Tensor>();
  call.options.window = d["window"].toIntVector();
  call.options.softcap = d["softcap"].toOptional<double>();
  call.options.alibi_slopes = d["alibi_slopes"].toOptional<at::Tensor>();
  call.options.sinks = d["sinks"].toOptional<at::Tensor>();
  call.options.dropout_p = d["dropout_p"].toDouble();
  call.options.dropout_seed = d["dropout_seed"].toOptional<at::Tensor>();
  call.packed.cu_seqlens_q = d["cu_seqlens_q"].toOptional<at::Tensor>();
  call.packed.cu_seqlens_k = d["cu_seqlens_k"].toOptional<at::Tensor>();
  call.packed.max_seqlen_q = d["max_seqlen_q"].toOptional<c10::SymInt>();
  call.packed.max_seqlen_k = d["max_seqlen_k"].toOptional<c10::SymInt>();
  call.query_offset = d["query_offset"].toOptional<c10::SymInt>();
  return call;
}

// The arguments of each Function's forward after the context, in order: the tensors autograd
// differentiates (so that it tracks them), then the call, which holds them too. backward returns
// one gradient per argument, at these slots.
enum ForwardArgument : size_t { kQ, kK, kV, kSinks, kAttnMask, kForwardCall, kForwardArguments };
enum BackwardArgument : size_t {
  kGradOut,
  kBackwardQ,
  kBackwardK,
  kBackwardV,
  kOut,
  kBackwardSinks,
  kBackwardAttnMask,
  kBackwardCall,
  kBackwardArguments
};

template <typename Function>
constexpr size_t arguments_after_context() {
  return c10::guts::infer_function_traits_t<decltype(&Function::forward)>::number_of_parameters - 1;
}

class AttentionBackwardFunction : public torch::autograd::Function<AttentionBackwardFunction> {
 public:
  static variable_list forward(AutogradContext* /*ctx*/, const at::Tensor& /*grad_out*/,
                               const at::Tensor& /*q*/, const at::Tensor& /*k*/,
                               const at::Tensor& /*v*/, const at::Tensor& /*out*/,
                               const std::optional<at::Tensor>& /*sinks*/,
                               const std::optional<at::Tensor>& /*attn_mask*/,
                               const BackwardCall& call) {
    at::AutoDispatchBelowADInplaceOrView guard;
    // attention_backward unless the mask's gradient is asked for, so that graphs (compile,
    // export) and errors name the op they always did.
    if (call.attn_mask_grad) {
      auto [dq, dk, dv, dsinks, dattn_mask] = detail::call_attention_gradients(call);
      return {dq, dk, dv, dsinks, dattn_mask};
    }
    auto [dq, dk, dv, dsinks] = detail::call_attention_backward(call);
    return {dq, dk, dv, dsinks, at::empty({0}, call.q.options())};
  }

  static variable_list backward(AutogradContext* /*ctx*/, const variable_list& /*grads*/) {
    TORCH_CHECK(false,
                "causal_attention.attention: double backward (a gradient of the gradient) is not "
                "supported");
  }

  static variable_list apply_to(const BackwardCall& call) {
    return apply(call.grad_out, call.q, call.k, call.v, call.out, call.options.sinks,
                 call.attn_mask, call);
  }
};
static_assert(arguments_after_context<AttentionBackwardFunction>() == kBackwardArguments);

// Differentiable in out; lse is returned for callers that need it but is not differentiable.
class AttentionForwardFunction : public torch::autograd::Function<AttentionForwardFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& /*q*/,
                               const at::Tensor& /*k*/, const at::Tensor& /*v*/,
                               const std::optional<at::Tensor>& /*sinks*/,
                               const std::optional<at::Tensor>& /*attn_mask*/,
                               const ForwardCall& call) {
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [out, lse] = detail::call_attention_forward(call);
    save_call(ctx, call, out, lse);
    ctx->mark_non_differentiable({lse});
    return {out, lse};
  }

  static variable_list backward(AutogradContext* ctx, const variable_list& grads) {
    variable_list grads_in(kForwardArguments);
    const at::Tensor& grad_out = grads[0];
    if (!grad_out.defined()) {
      return grads_in;
    }
    BackwardCall call = load_call(ctx, grad_out);
    // A floating attn_mask gets its gradient where autograd asks for it (a bool one cannot). Its
    // edge follows q, k, v and the sinks where given: autograd numbers only the tensors present.
    const size_t attn_mask_edge = kAttnMask - (call.options.sinks.has_value() ? 0 : 1);
    call.attn_mask_grad = call.attn_mask.has_value() &&
                          at::isFloatingType(call.attn_mask->scalar_type()) &&
                          ctx->needs_input_grad(attn_mask_edge);
    const variable_list g = AttentionBackwardFunction::apply_to(call);
    grads_in[kQ] = g[0];
    grads_in[kK] = g[1];
    grads_in[kV] = g[2];
    if (call.options.sinks.has_value()) {
      grads_in[kSinks] = g[3];
    }
    if (call.attn_mask_grad) {
      grads_in[kAttnMask] = g[4];
    }
    return grads_in;
  }

  static variable_list apply_to(const ForwardCall& call) {
    return apply(call.q, call.k, call.v, call.options.sinks, call.attn_mask, call);
  }
};
static_assert(arguments_after_context<AttentionForwardFunction>() == kForwardArguments);

// Whether the forward goes through its Function: a gradient may be asked of one of the inputs
// it differentiates, or one carries a forward-mode tangent (which the Function refuses, saying
// so). Else (inference, no_grad) the forward runs below autograd at once, as the Function's own
// forward would, without the context it fills for a backward that will not come (the saved call,
// its node and its outputs' wrapping: a quarter of a one-row call's time, 9.6 us to 7.6 on an AMX
// Xeon, benchmarks.call_overhead).
bool takes_function(const ForwardCall& call) {
  return torch::autograd::compute_requires_grad(call.q, call.k, call.v, call.options.sinks,
                                                call.attn_mask) ||
         torch::autograd::isFwGradDefined(call.q) || torch::autograd::isFwGradDefined(call.k) ||
         torch::autograd::isFwGradDefined(call.v) ||
         torch::autograd::isFwGradDefined(call.options.sinks) ||
         torch::autograd::isFwGradDefined(call.attn_mask);
}

std::tuple<at::Tensor, at::Tensor> forward_autograd(const ForwardCall& call) {
  if (!takes_function(call)) {
    at::AutoDispatchBelowADInplaceOrView guard;
    return detail::call_attention_forward(call);
  }
  const variable_list out_lse = AttentionForwardFunction::apply_to(call);
  return {out_lse[0], out_lse[1]};
}

// attention and varlen_attention: checked and resolved before Function::apply, which cannot
// handle an undefined input gracefully.
at::Tensor attention_autograd(const detail::AttentionCall& call) {
  return std::get<0>(forward_autograd(detail::resolve_attention_call(call)));
}

std::tuple<at::Tensor, at::Tensor> attention_forward_autograd(const ForwardCall& call) {
  detail::check_forward_call(call);
  return forward_autograd(call);
}

// attention_gradients, and attention_backward (its results but the mask's), checked under `op`.
detail::Gradients gradients_autograd(const char* op, const BackwardCall& call) {
  detail::check_backward_call(call, op);
  const variable_list g = AttentionBackwardFunction::apply_to(call);
  return {g[0], g[1], g[2], g[3], g[4]};
}
detail::Gradients attention_gradients_autograd(const BackwardCall& call) {
  return gradients_autograd("causal_attention.attention_gradients", call);
}
detail::Gradients attention_backward_autograd(const BackwardCall& call) {
  return gradients_autograd("causal_attention.attention_backward", call);
}

}  // namespace

TORCH_LIBRARY_IMPL(causal_attention, Autograd, m) {
  m.impl("attention", detail::attention_from_schema<attention_autograd>);
  m.impl("varlen_attention", detail::varlen_attention_from_schema<attention_autograd>);
  m.impl("attention_forward", detail::forward_from_schema<attention_forward_autograd>);
  m.impl("attention_gradients", detail::gradients_from_schema<attention_gradients_autograd>);
  m.impl("attention_backward", detail::backward_from_schema<attention_backward_autograd>);
}

}  // namespace causal_attention
