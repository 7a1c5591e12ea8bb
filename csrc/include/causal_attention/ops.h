// Public C++ API of causal_attention: exact causal scaled-dot-product attention.
//
// Shapes: q (..., Hq, Lq, D), k (..., Hkv, Lk, D), v (..., Hkv, Lk, Dv); a 2-D (L, D) call is one
// head. Hq % Hkv == 0: query head h reads K/V head h / (Hq / Hkv). Query row i may attend key j iff
// j <= i + (Lk - Lq) (bottom-right alignment). A row with no visible key returns zeros, lse = -inf
// and zero gradient. Accumulation is float32 for half/bfloat16/float32 and float64 for float64.
//
// Every function goes through the dispatcher (cached operator handles), so C++ callers get the
// same autograd, Meta and device dispatch as Python callers. Bad input raises c10::ValueError
// (shapes, devices, scale) or c10::TypeError (dtypes), naming the argument.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <tuple>

namespace causal_attention {

// The public, differentiable op: returns out (..., Hq, Lq, Dv). `scale` defaults to 1/sqrt(D).
// key_mask: bool (*batch, Lk), True where a key may be attended (q's leading dims; (Lk,) for a
// call without them), broadcast over heads and query rows and combined with causality. A row
// left with no visible key returns zeros; a hidden key gets zero gradient.
at::Tensor attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                     std::optional<double> scale = std::nullopt,
                     const std::optional<at::Tensor>& key_mask = std::nullopt);

// Kernel entry: returns (out, lse); lse (..., Hq, Lq) is float32 (float64 for float64 inputs).
std::tuple<at::Tensor, at::Tensor> attention_forward(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale,
    const std::optional<at::Tensor>& key_mask = std::nullopt);

// The attention probabilities (..., Hq, Lq, Lk) that `attention` applies to v, materialized for
// inspection: O(Lq * Lk) memory, unlike `attention`. Zero above the causal boundary, at hidden
// keys and in rows with no visible key. Differentiable in q and k. `scale` defaults to
// 1/sqrt(D).
at::Tensor attention_weights(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                             std::optional<double> scale = std::nullopt,
                             const std::optional<at::Tensor>& key_mask = std::nullopt);

// Gradients of `attention` given the forward's out and lse: returns (dq, dk, dv).
std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_backward(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& lse, double scale,
    const std::optional<at::Tensor>& key_mask = std::nullopt);

// Packed sequences (FlashAttention's varlen layout): q (total_q, Hq, D), k (total_k, Hkv, D),
// v (total_k, Hkv, Dv); sequence i is rows [cu_seqlens_q[i], cu_seqlens_q[i + 1]) of q and
// [cu_seqlens_k[i], cu_seqlens_k[i + 1]) of k and v (int32, (N + 1,), from 0), at most
// max_seqlen_q / max_seqlen_k long. Causal and bottom-right aligned inside each sequence.
// Returns out (total_q, Hq, Dv); differentiable.
at::Tensor varlen_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k,
                            c10::SymInt max_seqlen_q, c10::SymInt max_seqlen_k,
                            std::optional<double> scale = std::nullopt);

// Its kernel entry: (out, lse), lse (Hq, total_q) in the accumulation dtype.
std::tuple<at::Tensor, at::Tensor> varlen_attention_forward(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cu_seqlens_q,
    const at::Tensor& cu_seqlens_k, c10::SymInt max_seqlen_q, c10::SymInt max_seqlen_k,
    double scale);

// Its gradients: (dq, dk, dv).
std::tuple<at::Tensor, at::Tensor, at::Tensor> varlen_attention_backward(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& lse, const at::Tensor& cu_seqlens_q,
    const at::Tensor& cu_seqlens_k, c10::SymInt max_seqlen_q, c10::SymInt max_seqlen_k,
    double scale);

}  // namespace causal_attention
