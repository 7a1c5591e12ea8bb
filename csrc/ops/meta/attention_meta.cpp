// Meta kernels: shapes and dtypes only, written with SymInts so that FakeTensor, torch.compile
// (dynamic shapes included) and torch.export trace the ops without running them. The values of
// cu_seqlens are data, checked by the CPU kernels only. attention and varlen_attention reach
// these through their one kernel (ops/attention.cpp).
#include "../checks.h"
#include "../paged_checks.h"
#include "../schema_adapters.h"
#include "../shapes.h"

#include <ATen/ops/empty.h>
#include <torch/library.h>

namespace causal_attention {
namespace {

std::tuple<at::Tensor, at::Tensor> attention_forward_meta(const detail::ForwardCall& call) {
  detail::check_forward_call(call);
  const at::Tensor& q = call.q;
  const bool packed = call.packed.any();
  return {at::empty_symint(packed ? detail::varlen_output_sym_sizes(q, call.v)
                                  : detail::output_sym_sizes(q, call.v),
                           q.options()),
          at::empty_symint(packed ? detail::varlen_lse_sym_sizes(q) : detail::lse_sym_sizes(q),
                           detail::lse_options(q))};
}

// Gradients have the shapes and dtypes of the inputs they belong to (the accumulation dtype with
// delta); dsinks is (0,) without sinks, dattn_mask without attn_mask_grad.
detail::Gradients gradients_meta(const char* op, const detail::BackwardCall& call) {
  detail::check_backward_call(call, op);
  const auto like = [&](const std::optional<at::Tensor>& t, bool wanted) {
    return wanted ? at::empty_symint(t->sym_sizes(), t->options())
                  : at::empty({0}, call.q.options());
  };
  const at::TensorOptions gradients = detail::gradient_options(call.q, call.delta.has_value());
  return {at::empty_symint(call.q.sym_sizes(), gradients),
          at::empty_symint(call.k.sym_sizes(), gradients),
          at::empty_symint(call.v.sym_sizes(), gradients),
          like(call.options.sinks, call.options.sinks.has_value()),
          like(call.attn_mask, call.attn_mask_grad)};
}

detail::Gradients attention_gradients_meta(const detail::BackwardCall& call) {
  return gradients_meta("causal_attention.attention_gradients", call);
}
detail::Gradients attention_backward_meta(const detail::BackwardCall& call) {
  return gradients_meta("causal_attention.attention_backward", call);
}

at::Tensor dropout_keep_mask_meta(const at::Tensor& dropout_seed, c10::SymIntArrayRef shape,
                                  double dropout_p) {
  detail::check_dropout_keep_mask_call(dropout_seed, shape, dropout_p);
  return at::empty_symint(shape, dropout_seed.options().dtype(at::kBool));
}

// paged_attention: out like q with Dv, lse (B, Hq, Lq) dense or (Hq, total_q) packed.
std::tuple<at::Tensor, at::Tensor> paged_attention_meta(const detail::PagedCall& call) {
  detail::check_paged_call(call);
  const at::Tensor& q = call.q;
  std::vector<c10::SymInt> out(q.sym_sizes().begin(), q.sym_sizes().end());
  out.back() = call.v_cache.sym_size(3);
  const std::vector<c10::SymInt> lse =
      call.packed() ? std::vector<c10::SymInt>{q.sym_size(1), q.sym_size(0)}
                    : std::vector<c10::SymInt>{q.sym_size(0), q.sym_size(2), q.sym_size(1)};
  return {at::empty_symint(out, q.options()), at::empty_symint(lse, detail::lse_options(q))};
}

}  // namespace

TORCH_LIBRARY_IMPL(causal_attention, Meta, m) {
  m.impl("attention_forward", detail::forward_from_schema<attention_forward_meta>);
  m.impl("attention_gradients", detail::gradients_from_schema<attention_gradients_meta>);
  m.impl("attention_backward", detail::backward_from_schema<attention_backward_meta>);
  m.impl("dropout_keep_mask", dropout_keep_mask_meta);
  m.impl("paged_attention", detail::paged_from_schema<paged_attention_meta>);
}

}  // namespace causal_attention
