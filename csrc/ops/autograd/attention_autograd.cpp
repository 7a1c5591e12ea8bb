// Autograd for the ops, in C++ so that a C++-only program (GoogleTest, a TorchScript model run
// with torch::jit::load) can run backward, and torch.compile traces the forward and backward ops
// as units. Each Function redispatches below autograd; the backward ops' own Functions refuse a
// second derivative, loudly. Key masks, cumulative lengths, ALiBi slopes and dropout seeds are
// not differentiable: they get no gradient; sinks get theirs from the backward ops.
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

// The score options (ops.h) as a Function keeps them for its backward.
struct SavedScoreOptions {
  std::vector<int64_t> window;
  std::optional<double> softcap;
  std::optional<at::Tensor> alibi_slopes, sinks;
  double dropout_p;
  std::optional<at::Tensor> dropout_seed;

  void save(AutogradContext* ctx) const {
    ctx->saved_data["window"] = window;
    ctx->saved_data["softcap"] = softcap;
    ctx->saved_data["alibi_slopes"] = alibi_slopes;
    ctx->saved_data["sinks"] = sinks;
    ctx->saved_data["dropout_p"] = dropout_p;
    ctx->saved_data["dropout_seed"] = dropout_seed;
  }
  static SavedScoreOptions load(AutogradContext* ctx) {
    auto& d = ctx->saved_data;
    return {d["window"].toIntVector(),
            d["softcap"].toOptional<double>(),
            d["alibi_slopes"].toOptional<at::Tensor>(),
            d["sinks"].toOptional<at::Tensor>(),
            d["dropout_p"].toDouble(),
            d["dropout_seed"].toOptional<at::Tensor>()};
  }
};

class AttentionBackwardFunction : public torch::autograd::Function<AttentionBackwardFunction> {
 public:
  static variable_list forward(AutogradContext* /*ctx*/, const at::Tensor& grad_out,
                               const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                               const at::Tensor& out, const at::Tensor& lse, double scale,
                               const std::optional<at::Tensor>& key_mask, at::IntArrayRef window,
                               std::optional<double> softcap,
                               const std::optional<at::Tensor>& alibi_slopes,
                               const std::optional<at::Tensor>& sinks, double dropout_p,
                               const std::optional<at::Tensor>& dropout_seed) {
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [dq, dk, dv, dsinks] =
        attention_backward(grad_out, q, k, v, out, lse, scale, key_mask, window, softcap,
                           alibi_slopes, sinks, dropout_p, dropout_seed);
    return {dq, dk, dv, dsinks};
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
                               const std::optional<at::Tensor>& key_mask, at::IntArrayRef window,
                               std::optional<double> softcap,
                               const std::optional<at::Tensor>& alibi_slopes,
                               const std::optional<at::Tensor>& sinks, double dropout_p,
                               const std::optional<at::Tensor>& dropout_seed) {
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [out, lse] = attention_forward(q, k, v, scale, key_mask, window, softcap, alibi_slopes,
                                        sinks, dropout_p, dropout_seed);
    ctx->save_for_backward({q, k, v, out, lse});
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["key_mask"] = key_mask;
    SavedScoreOptions{window.vec(), softcap, alibi_slopes, sinks, dropout_p, dropout_seed}.save(
        ctx);
    ctx->mark_non_differentiable({lse});
    return {out, lse};
  }

  static variable_list backward(AutogradContext* ctx, const variable_list& grads) {
    // One gradient per argument of forward: q, k, v, scale, key_mask, window, softcap,
    // alibi_slopes, sinks, dropout_p, dropout_seed.
    variable_list grads_in(11);
    const at::Tensor& grad_out = grads[0];
    if (!grad_out.defined()) {
      return grads_in;
    }
    const auto saved = ctx->get_saved_variables();
    const SavedScoreOptions o = SavedScoreOptions::load(ctx);
    auto g = AttentionBackwardFunction::apply(
        grad_out, saved[0], saved[1], saved[2], saved[3], saved[4],
        ctx->saved_data["scale"].toDouble(), ctx->saved_data["key_mask"].toOptional<at::Tensor>(),
        o.window, o.softcap, o.alibi_slopes, o.sinks, o.dropout_p, o.dropout_seed);
    grads_in[0] = g[0];
    grads_in[1] = g[1];
    grads_in[2] = g[2];
    if (o.sinks.has_value()) {
      grads_in[8] = g[3];
    }
    return grads_in;
  }
};

at::Tensor attention_autograd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                              std::optional<double> scale,
                              const std::optional<at::Tensor>& key_mask, at::IntArrayRef window,
                              std::optional<double> softcap,
                              const std::optional<at::Tensor>& alibi_slopes,
                              const std::optional<at::Tensor>& sinks, double dropout_p,
                              std::optional<at::Generator> generator) {
  const double resolved = detail::check_attention_call(q, k, v, scale, key_mask, window, softcap,
                                                       alibi_slopes, sinks, dropout_p);
  return AttentionForwardFunction::apply(q, k, v, resolved, key_mask, window, softcap, alibi_slopes,
                                         sinks, dropout_p,
                                         detail::draw_dropout_seed(dropout_p, generator))[0];
}

std::tuple<at::Tensor, at::Tensor> attention_forward_autograd(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale,
    const std::optional<at::Tensor>& key_mask, at::IntArrayRef window,
    std::optional<double> softcap, const std::optional<at::Tensor>& alibi_slopes,
    const std::optional<at::Tensor>& sinks, double dropout_p,
    const std::optional<at::Tensor>& dropout_seed) {
  // Checked before Function::apply, which cannot handle an undefined input gracefully.
  detail::check_forward_call(q, k, v, scale, key_mask, window, softcap, alibi_slopes, sinks,
                             dropout_p, dropout_seed);
  auto out_lse = AttentionForwardFunction::apply(q, k, v, scale, key_mask, window, softcap,
                                                 alibi_slopes, sinks, dropout_p, dropout_seed);
  return {out_lse[0], out_lse[1]};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> attention_backward_autograd(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& lse, double scale,
    const std::optional<at::Tensor>& key_mask, at::IntArrayRef window,
    std::optional<double> softcap, const std::optional<at::Tensor>& alibi_slopes,
    const std::optional<at::Tensor>& sinks, double dropout_p,
    const std::optional<at::Tensor>& dropout_seed) {
  detail::check_backward_inputs(grad_out, q, k, v, out, lse, scale, key_mask, window, softcap,
                                alibi_slopes, sinks, dropout_p, dropout_seed);
  auto grads =
      AttentionBackwardFunction::apply(grad_out, q, k, v, out, lse, scale, key_mask, window,
                                       softcap, alibi_slopes, sinks, dropout_p, dropout_seed);
  return {grads[0], grads[1], grads[2], grads[3]};
}

// The packed-sequence ops, the same way.
class VarlenBackwardFunction : public torch::autograd::Function<VarlenBackwardFunction> {
 public:
  static variable_list forward(AutogradContext* /*ctx*/, const at::Tensor& grad_out,
                               const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                               const at::Tensor& out, const at::Tensor& lse,
                               const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k,
                               c10::SymInt max_seqlen_q, c10::SymInt max_seqlen_k, double scale,
                               at::IntArrayRef window, std::optional<double> softcap,
                               const std::optional<at::Tensor>& alibi_slopes,
                               const std::optional<at::Tensor>& sinks, double dropout_p,
                               const std::optional<at::Tensor>& dropout_seed) {
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [dq, dk, dv, dsinks] =
        varlen_attention_backward(grad_out, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k,
                                  std::move(max_seqlen_q), std::move(max_seqlen_k), scale, window,
                                  softcap, alibi_slopes, sinks, dropout_p, dropout_seed);
    return {dq, dk, dv, dsinks};
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
                               c10::SymInt max_seqlen_k, double scale, at::IntArrayRef window,
                               std::optional<double> softcap,
                               const std::optional<at::Tensor>& alibi_slopes,
                               const std::optional<at::Tensor>& sinks, double dropout_p,
                               const std::optional<at::Tensor>& dropout_seed) {
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [out, lse] = varlen_attention_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                               max_seqlen_k, scale, window, softcap, alibi_slopes,
                                               sinks, dropout_p, dropout_seed);
    ctx->save_for_backward({q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k});
    ctx->saved_data["max_seqlen_q"] = max_seqlen_q;
    ctx->saved_data["max_seqlen_k"] = max_seqlen_k;
    ctx->saved_data["scale"] = scale;
    SavedScoreOptions{window.vec(), softcap, alibi_slopes, sinks, dropout_p, dropout_seed}.save(
        ctx);
    ctx->mark_non_differentiable({lse});
    return {out, lse};
  }

  static variable_list backward(AutogradContext* ctx, const variable_list& grads) {
    // One gradient per argument of forward: q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
    // max_seqlen_k, scale, window, softcap, alibi_slopes, sinks, dropout_p, dropout_seed.
    variable_list grads_in(14);
    if (!grads[0].defined()) {
      return grads_in;
    }
    const auto saved = ctx->get_saved_variables();
    const SavedScoreOptions o = SavedScoreOptions::load(ctx);
    auto g = VarlenBackwardFunction::apply(
        grads[0], saved[0], saved[1], saved[2], saved[3], saved[4], saved[5], saved[6],
        ctx->saved_data["max_seqlen_q"].toSymInt(), ctx->saved_data["max_seqlen_k"].toSymInt(),
        ctx->saved_data["scale"].toDouble(), o.window, o.softcap, o.alibi_slopes, o.sinks,
        o.dropout_p, o.dropout_seed);
    grads_in[0] = g[0];
    grads_in[1] = g[1];
    grads_in[2] = g[2];
    if (o.sinks.has_value()) {
      grads_in[11] = g[3];
    }
    return grads_in;
  }
};

at::Tensor varlen_attention_autograd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                     const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k,
                                     c10::SymInt max_seqlen_q, c10::SymInt max_seqlen_k,
                                     std::optional<double> scale, at::IntArrayRef window,
                                     std::optional<double> softcap,
                                     const std::optional<at::Tensor>& alibi_slopes,
                                     const std::optional<at::Tensor>& sinks, double dropout_p,
                                     std::optional<at::Generator> generator) {
  const double resolved = detail::check_varlen_attention_call(
      q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, window, softcap,
      alibi_slopes, sinks, dropout_p);
  return VarlenForwardFunction::apply(
      q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, resolved, window, softcap,
      alibi_slopes, sinks, dropout_p, detail::draw_dropout_seed(dropout_p, generator))[0];
}

std::tuple<at::Tensor, at::Tensor> varlen_attention_forward_autograd(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cu_seqlens_q,
    const at::Tensor& cu_seqlens_k, c10::SymInt max_seqlen_q, c10::SymInt max_seqlen_k,
    double scale, at::IntArrayRef window, std::optional<double> softcap,
    const std::optional<at::Tensor>& alibi_slopes, const std::optional<at::Tensor>& sinks,
    double dropout_p, const std::optional<at::Tensor>& dropout_seed) {
  detail::check_varlen_forward_call(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                    scale, window, softcap, alibi_slopes, sinks, dropout_p,
                                    dropout_seed);
  auto out_lse = VarlenForwardFunction::apply(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                              max_seqlen_k, scale, window, softcap, alibi_slopes,
                                              sinks, dropout_p, dropout_seed);
  return {out_lse[0], out_lse[1]};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> varlen_attention_backward_autograd(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& lse, const at::Tensor& cu_seqlens_q,
    const at::Tensor& cu_seqlens_k, c10::SymInt max_seqlen_q, c10::SymInt max_seqlen_k,
    double scale, at::IntArrayRef window, std::optional<double> softcap,
    const std::optional<at::Tensor>& alibi_slopes, const std::optional<at::Tensor>& sinks,
    double dropout_p, const std::optional<at::Tensor>& dropout_seed) {
  detail::check_varlen_backward_inputs(grad_out, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k,
                                       max_seqlen_q, max_seqlen_k, scale, window, softcap,
                                       alibi_slopes, sinks, dropout_p, dropout_seed);
  auto grads = VarlenBackwardFunction::apply(
      grad_out, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale,
      window, softcap, alibi_slopes, sinks, dropout_p, dropout_seed);
  return {grads[0], grads[1], grads[2], grads[3]};
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
