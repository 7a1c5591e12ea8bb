// Between the flat schemas (attention.cpp) and the structs of op_arguments.h, in both directions:
// - `*_from_schema<kernel>` has an op's flat signature, as the dispatcher calls a kernel, and calls
//   `kernel` with the call's struct: every kernel of every dispatch key (CPU, Meta, Autograd,
//   Autocast, the composites) is written against the struct and registered through these;
// - `call_*` calls an op through the dispatcher with a struct's arguments (cached handles), for
//   the public C++ API (ops.h) and the kernels that redispatch.
#pragma once

#include "op_arguments.h"

#include <ATen/core/Generator.h>
#include <ATen/core/Tensor.h>
#include <c10/core/SymInt.h>

#include <optional>
#include <tuple>
#include <utility>

namespace causal_attention::detail {

// attention_gradients' results: dq, dk, dv, dsinks and dattn_mask.
using Gradients = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

// The score options from their flat arguments, in schema order.
inline ScoreOptions score_options(at::IntArrayRef window, std::optional<double> softcap,
                                  const std::optional<at::Tensor>& alibi_slopes,
                                  const std::optional<at::Tensor>& sinks, double dropout_p,
                                  const std::optional<at::Tensor>& dropout_seed) {
  return {window.vec(), softcap, alibi_slopes, sinks, dropout_p, dropout_seed};
}

template <at::Tensor (*kernel)(const AttentionCall&)>
at::Tensor attention_from_schema(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                 std::optional<double> scale,
                                 const std::optional<at::Tensor>& key_mask,
                                 const AttentionMask& attn_mask, at::IntArrayRef window,
                                 std::optional<double> softcap,
                                 const std::optional<at::Tensor>& alibi_slopes,
                                 const std::optional<at::Tensor>& sinks, double dropout_p,
                                 std::optional<at::Generator> generator) {
  AttentionCall call{q, k, v};
  call.scale = scale;
  call.key_mask = key_mask;
  call.attn_mask = attn_mask;
  call.options = score_options(window, softcap, alibi_slopes, sinks, dropout_p, std::nullopt);
  call.generator = std::move(generator);
  return kernel(call);
}

template <at::Tensor (*kernel)(const AttentionCall&)>
at::Tensor varlen_attention_from_schema(const at::Tensor& q, const at::Tensor& k,
                                        const at::Tensor& v, const at::Tensor& cu_seqlens_q,
                                        const at::Tensor& cu_seqlens_k, c10::SymInt max_seqlen_q,
                                        c10::SymInt max_seqlen_k, std::optional<double> scale,
                                        at::IntArrayRef window, std::optional<double> softcap,
                                        const std::optional<at::Tensor>& alibi_slopes,
                                        const std::optional<at::Tensor>& sinks, double dropout_p,
                                        std::optional<at::Generator> generator) {
  AttentionCall call{q, k, v};
  call.scale = scale;
  call.options = score_options(window, softcap, alibi_slopes, sinks, dropout_p, std::nullopt);
  call.packed = {cu_seqlens_q, cu_seqlens_k, std::move(max_seqlen_q), std::move(max_seqlen_k)};
  call.generator = std::move(generator);
  return kernel(call);
}

template <std::tuple<at::Tensor, at::Tensor> (*kernel)(const ForwardCall&)>
std::tuple<at::Tensor, at::Tensor> forward_from_schema(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale,
    const std::optional<at::Tensor>& key_mask, at::IntArrayRef window,
    std::optional<double> softcap, const std::optional<at::Tensor>& alibi_slopes,
    const std::optional<at::Tensor>& sinks, double dropout_p,
    const std::optional<at::Tensor>& dropout_seed, const std::optional<at::Tensor>& cu_seqlens_q,
    const std::optional<at::Tensor>& cu_seqlens_k, std::optional<c10::SymInt> max_seqlen_q,
    std::optional<c10::SymInt> max_seqlen_k, const AttentionMask& attn_mask,
    std::optional<c10::SymInt> query_offset) {
  ForwardCall call{q, k, v};
  call.scale = scale;
  call.key_mask = key_mask;
  call.attn_mask = attn_mask;
  call.options = score_options(window, softcap, alibi_slopes, sinks, dropout_p, dropout_seed);
  call.packed = {cu_seqlens_q, cu_seqlens_k, std::move(max_seqlen_q), std::move(max_seqlen_k)};
  call.query_offset = std::move(query_offset);
  return kernel(call);
}

template <Gradients (*kernel)(const BackwardCall&)>
Gradients gradients_from_schema(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& lse, double scale,
    const std::optional<at::Tensor>& key_mask, at::IntArrayRef window,
    std::optional<double> softcap, const std::optional<at::Tensor>& alibi_slopes,
    const std::optional<at::Tensor>& sinks, double dropout_p,
    const std::optional<at::Tensor>& dropout_seed, const std::optional<at::Tensor>& cu_seqlens_q,
    const std::optional<at::Tensor>& cu_seqlens_k, std::optional<c10::SymInt> max_seqlen_q,
    std::optional<c10::SymInt> max_seqlen_k, const AttentionMask& attn_mask, bool attn_mask_grad,
    std::optional<c10::SymInt> query_offset, const std::optional<at::Tensor>& delta) {
  BackwardCall call(ForwardCall{q, k, v});
  call.scale = scale;
  call.key_mask = key_mask;
  call.attn_mask = attn_mask;
  call.attn_mask_grad = attn_mask_grad;
  call.options = score_options(window, softcap, alibi_slopes, sinks, dropout_p, dropout_seed);
  call.packed = {cu_seqlens_q, cu_seqlens_k, std::move(max_seqlen_q), std::move(max_seqlen_k)};
  call.grad_out = grad_out;
  call.out = out;
  call.lse = lse;
  call.query_offset = std::move(query_offset);
  call.delta = delta;
  return kernel(call);
}

// attention_backward: attention_gradients' flat arguments but attn_mask_grad (false, and so
// attn_mask_grad's place), and its results but dattn_mask.
using BackwardGradients = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>;
template <Gradients (*kernel)(const BackwardCall&)>
BackwardGradients backward_from_schema(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& lse, double scale,
    const std::optional<at::Tensor>& key_mask, at::IntArrayRef window,
    std::optional<double> softcap, const std::optional<at::Tensor>& alibi_slopes,
    const std::optional<at::Tensor>& sinks, double dropout_p,
    const std::optional<at::Tensor>& dropout_seed, const std::optional<at::Tensor>& cu_seqlens_q,
    const std::optional<at::Tensor>& cu_seqlens_k, std::optional<c10::SymInt> max_seqlen_q,
    std::optional<c10::SymInt> max_seqlen_k, const AttentionMask& attn_mask,
    std::optional<c10::SymInt> query_offset, const std::optional<at::Tensor>& delta) {
  auto [dq, dk, dv, dsinks, dattn_mask] = gradients_from_schema<kernel>(
      grad_out, q, k, v, out, lse, scale, key_mask, window, softcap, alibi_slopes, sinks, dropout_p,
      dropout_seed, cu_seqlens_q, cu_seqlens_k, std::move(max_seqlen_q), std::move(max_seqlen_k),
      attn_mask, /*attn_mask_grad=*/false, std::move(query_offset), delta);
  return {dq, dk, dv, dsinks};
}

// The C++ signatures of the schemas, argument for argument: the adapters' (which no kernel
// instantiates here).
using AttentionSignature = decltype(attention_from_schema<nullptr>);
using VarlenAttentionSignature = decltype(varlen_attention_from_schema<nullptr>);
template <std::tuple<at::Tensor, at::Tensor> (*kernel)(const PagedCall&)>
std::tuple<at::Tensor, at::Tensor> paged_from_schema(
    const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
    const at::Tensor& block_table, const at::Tensor& cache_seqlens,
    const std::optional<at::Tensor>& cu_seqlens_q, std::optional<c10::SymInt> max_seqlen_q,
    std::optional<double> scale, at::IntArrayRef window, std::optional<double> softcap,
    const std::optional<at::Tensor>& alibi_slopes, const std::optional<at::Tensor>& sinks,
    const std::optional<at::Tensor>& k_scale, const std::optional<at::Tensor>& v_scale,
    const std::optional<at::Tensor>& spec_mask) {
  PagedCall call{q,
                 k_cache,
                 v_cache,
                 block_table,
                 cache_seqlens,
                 cu_seqlens_q,
                 std::move(max_seqlen_q),
                 scale,
                 score_options(window, softcap, alibi_slopes, sinks, 0.0, std::nullopt),
                 k_scale,
                 v_scale,
                 spec_mask};
  return kernel(call);
}

using PagedSignature = decltype(paged_from_schema<nullptr>);
using ForwardSignature = decltype(forward_from_schema<nullptr>);
using GradientsSignature = decltype(gradients_from_schema<nullptr>);
using BackwardSignature = decltype(backward_from_schema<nullptr>);

// Through the dispatcher (api.cpp). call_attention serves attention and varlen_attention
// (packed where call.packed is given), call_attention_weights attention_weights,
// call_paged_attention paged_attention.
at::Tensor call_attention(const AttentionCall& call);
at::Tensor call_attention_weights(const AttentionCall& call);
std::tuple<at::Tensor, at::Tensor> call_attention_forward(const ForwardCall& call);
Gradients call_attention_gradients(const BackwardCall& call);
BackwardGradients call_attention_backward(const BackwardCall& call);
std::tuple<at::Tensor, at::Tensor> call_paged_attention(const PagedCall& call);

}  // namespace causal_attention::detail
