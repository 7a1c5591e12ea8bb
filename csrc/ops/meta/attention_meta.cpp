// Meta kernels: shapes and dtypes only, written with SymInts so that FakeTensor, torch.compile
// (dynamic shapes included) and torch.export trace the ops without running them. The values of
// cu_seqlens are data, checked by the CPU kernels only. attention and varlen_attention reach
// these through their one kernel (ops/attention.cpp).
#include "../checks.h"
#include "../shapes.h"

#include <ATen/ops/empty.h>
#include <torch/library.h>

namespace causal_attention {
namespace {

// Gradients have the shapes and dtypes of the inputs they belong to.
std::tuple<at::Tensor, at::Tensor, at::Tensor> empty_gradients(const at::Tensor& q,
                                                               const at::Tensor& k,
                                                               const at::Tensor& v) {
  return {at::empty_symint(q.sym_sizes(), q.options()),
          at::empty_symint(k.sym_sizes(), k.options()),
          at::empty_symint(v.sym_sizes(), v.options())};
}

std::tuple<at::Tensor, at::Tensor> attention_forward_meta(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale,
    const std::optional<at::Tensor>& key_mask) {
  detail::check_forward_call(q, k, v, scale, key_mask);
  return {at::empty_symint(detail::output_sym_sizes(q, v), q.options()),
          at::empty_symint(detail::lse_sym_sizes(q), detail::lse_options(q))};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_backward_meta(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& lse, double scale,
    const std::optional<at::Tensor>& key_mask) {
  detail::check_backward_inputs(grad_out, q, k, v, out, lse, scale, key_mask);
  return empty_gradients(q, k, v);
}

std::tuple<at::Tensor, at::Tensor> varlen_attention_forward_meta(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cu_seqlens_q,
    const at::Tensor& cu_seqlens_k, c10::SymInt max_seqlen_q, c10::SymInt max_seqlen_k,
    double scale) {
  detail::check_varlen_forward_call(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                    scale);
  return {at::empty_symint(detail::varlen_output_sym_sizes(q, v), q.options()),
          at::empty_symint(detail::varlen_lse_sym_sizes(q), detail::lse_options(q))};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> varlen_attention_backward_meta(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& lse, const at::Tensor& cu_seqlens_q,
    const at::Tensor& cu_seqlens_k, c10::SymInt max_seqlen_q, c10::SymInt max_seqlen_k,
    double scale) {
  detail::check_varlen_backward_inputs(grad_out, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k,
                                       max_seqlen_q, max_seqlen_k, scale);
  return empty_gradients(q, k, v);
}

}  // namespace

TORCH_LIBRARY_IMPL(causal_attention, Meta, m) {
  m.impl("attention_forward", attention_forward_meta);
  m.impl("attention_backward", attention_backward_meta);
  m.impl("varlen_attention_forward", varlen_attention_forward_meta);
  m.impl("varlen_attention_backward", varlen_attention_backward_meta);
}

}  // namespace causal_attention
