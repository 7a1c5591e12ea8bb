// Meta kernels: shapes and dtypes only, written with SymInts so that FakeTensor, torch.compile
// (dynamic shapes included) and torch.export trace the ops without running them.
#include "../checks.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

namespace causal_attention {
namespace {

std::tuple<at::Tensor, at::Tensor> attention_forward_meta(const at::Tensor& q, const at::Tensor& k,
                                                          const at::Tensor& v, double scale) {
  detail::check_forward_call(q, k, v, scale);
  at::Tensor out = at::empty_symint(detail::output_sym_sizes(q, v), q.options());
  at::Tensor lse = at::empty_symint(detail::lse_sym_sizes(q),
                                    q.options().dtype(detail::accumulation_dtype(q.scalar_type())));
  return {out, lse};
}

at::Tensor attention_meta(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                          std::optional<double> scale) {
  const double resolved = detail::check_attention_call(q, k, v, scale);
  return std::get<0>(attention_forward_meta(q, k, v, resolved));
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_backward_meta(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& lse, double scale) {
  detail::check_backward_inputs(grad_out, q, k, v, out, lse, scale);
  return {at::empty_symint(q.sym_sizes(), q.options()),
          at::empty_symint(k.sym_sizes(), k.options()),
          at::empty_symint(v.sym_sizes(), v.options())};
}

}  // namespace

TORCH_LIBRARY_IMPL(causal_attention, Meta, m) {
  m.impl("attention", attention_meta);
  m.impl("attention_forward", attention_forward_meta);
  m.impl("attention_backward", attention_backward_meta);
}

}  // namespace causal_attention
