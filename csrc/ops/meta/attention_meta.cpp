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

// Gradients have the shapes and dtypes of the inputs they belong to; dsinks is (0,) without
// sinks.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> empty_gradients(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const std::optional<at::Tensor>& sinks) {
  return {at::empty_symint(q.sym_sizes(), q.options()),
          at::empty_symint(k.sym_sizes(), k.options()),
          at::empty_symint(v.sym_sizes(), v.options()),
          sinks.has_value() ? at::empty_symint(sinks->sym_sizes(), sinks->options())
                            : at::empty({0}, q.options())};
}

std::tuple<at::Tensor, at::Tensor> attention_forward_meta(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale,
    const std::optional<at::Tensor>& key_mask, at::IntArrayRef window,
    std::optional<double> softcap, const std::optional<at::Tensor>& alibi_slopes,
    const std::optional<at::Tensor>& sinks, double dropout_p,
    const std::optional<at::Tensor>& dropout_seed) {
  detail::check_forward_call(q, k, v, scale, key_mask, window, softcap, alibi_slopes, sinks,
                             dropout_p, dropout_seed);
  return {at::empty_symint(detail::output_sym_sizes(q, v), q.options()),
          at::empty_symint(detail::lse_sym_sizes(q), detail::lse_options(q))};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> attention_backward_meta(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& lse, double scale,
    const std::optional<at::Tensor>& key_mask, at::IntArrayRef window,
    std::optional<double> softcap, const std::optional<at::Tensor>& alibi_slopes,
    const std::optional<at::Tensor>& sinks, double dropout_p,
    const std::optional<at::Tensor>& dropout_seed) {
  detail::check_backward_inputs(grad_out, q, k, v, out, lse, scale, key_mask, window, softcap,
                                alibi_slopes, sinks, dropout_p, dropout_seed);
  return empty_gradients(q, k, v, sinks);
}

std::tuple<at::Tensor, at::Tensor> varlen_attention_forward_meta(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cu_seqlens_q,
    const at::Tensor& cu_seqlens_k, c10::SymInt max_seqlen_q, c10::SymInt max_seqlen_k,
    double scale, at::IntArrayRef window, std::optional<double> softcap,
    const std::optional<at::Tensor>& alibi_slopes, const std::optional<at::Tensor>& sinks,
    double dropout_p, const std::optional<at::Tensor>& dropout_seed) {
  detail::check_varlen_forward_call(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                    scale, window, softcap, alibi_slopes, sinks, dropout_p,
                                    dropout_seed);
  return {at::empty_symint(detail::varlen_output_sym_sizes(q, v), q.options()),
          at::empty_symint(detail::varlen_lse_sym_sizes(q), detail::lse_options(q))};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> varlen_attention_backward_meta(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& lse, const at::Tensor& cu_seqlens_q,
    const at::Tensor& cu_seqlens_k, c10::SymInt max_seqlen_q, c10::SymInt max_seqlen_k,
    double scale, at::IntArrayRef window, std::optional<double> softcap,
    const std::optional<at::Tensor>& alibi_slopes, const std::optional<at::Tensor>& sinks,
    double dropout_p, const std::optional<at::Tensor>& dropout_seed) {
  detail::check_varlen_backward_inputs(grad_out, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k,
                                       max_seqlen_q, max_seqlen_k, scale, window, softcap,
                                       alibi_slopes, sinks, dropout_p, dropout_seed);
  return empty_gradients(q, k, v, sinks);
}

at::Tensor dropout_keep_mask_meta(const at::Tensor& dropout_seed, c10::SymIntArrayRef shape,
                                  double dropout_p) {
  detail::check_dropout_seed("causal_attention.dropout_keep_mask", dropout_p, dropout_seed);
  return at::empty_symint(shape, dropout_seed.options().dtype(at::kBool));
}

}  // namespace

TORCH_LIBRARY_IMPL(causal_attention, Meta, m) {
  m.impl("attention_forward", attention_forward_meta);
  m.impl("attention_backward", attention_backward_meta);
  m.impl("varlen_attention_forward", varlen_attention_forward_meta);
  m.impl("varlen_attention_backward", varlen_attention_backward_meta);
  m.impl("dropout_keep_mask", dropout_keep_mask_meta);
}

}  // namespace causal_attention
