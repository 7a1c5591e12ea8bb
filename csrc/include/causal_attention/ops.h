// Public C++ API of causal_attention: exact causal scaled-dot-product attention.
//
// Shapes: q (..., Hq, Lq, D), k (..., Hkv, Lk, D), v (..., Hkv, Lk, Dv); a 2-D (L, D) call is one
// head. Hq % Hkv == 0: query head h reads K/V head h / (Hq / Hkv). Query row i may attend key j iff
// i + off - left <= j <= i + off + right, off = Lk - Lq (bottom-right alignment), for the window
// (left, right), -1 unbounded; the default (-1, 0) is causal attention. A row with no visible key
// returns zeros, lse = -inf (the sink with sinks) and zero gradient. Accumulation is float32 for
// half/bfloat16/float32 and float64 for float64.
//
// The score options, set by name in AttentionOptions (options.h), applied in FlashAttention's
// order: S = scale q k^T -> softcap -> ALiBi -> visibility -> softmax with sinks -> dropout.
//   window:       (left, right) as above; (-1, -1) is full attention, (W - 1, 0) a sliding
//                 window of W keys. Key blocks outside every row's window are never touched.
//   softcap:      S -> softcap * tanh(S / softcap), softcap > 0 (Gemma 2).
//   alibi_slopes: float32 (Hq,) or (*batch, Hq); adds -slope * |i + off - j|. No gradient.
//   sinks:        (Hq,) logits in q's dtype or float32 that join each row's softmax denominator
//                 (gpt-oss); differentiable. lse includes them.
//   dropout_p:    drops each probability with probability p in [0, 1) and scales the kept ones
//                 by 1 / (1 - p), with a counter-based mask keyed by (seed, offset, batch, head,
//                 row, key), regenerated in the backward. The differentiable ops draw
//                 (seed, offset) as at::empty({2}, at::kLong).random_(generator) (the default CPU
//                 generator when none is given); the kernel ops take them as dropout_seed.
//
// Every function goes through the dispatcher (cached operator handles), so C++ callers get the
// same autograd, Meta and device dispatch as Python callers. Bad input raises c10::ValueError
// (shapes, devices, scale) or c10::TypeError (dtypes), naming the argument.
#pragma once

#include "causal_attention/options.h"

#include <ATen/core/Generator.h>
#include <ATen/core/Tensor.h>

#include <optional>
#include <tuple>

namespace causal_attention {

// The public, differentiable op: returns out (..., Hq, Lq, Dv). options.scale defaults to
// 1/sqrt(D). options.key_mask: bool (*batch, Lk), True where a key may be attended (q's leading
// dims; (Lk,) for a call without them), broadcast over heads and query rows and combined with the
// window. options.attn_mask: SDPA's attn_mask, broadcastable to (*batch, Hq, Lq, Lk) (never
// expanded in memory): bool (True where row i may attend key j) or floating (float32 or q's
// dtype), added to the scores after softcap and ALiBi, -inf hiding the key; it narrows the
// window and key mask, so window (-1, -1) with it is SDPA's masked attention. Key blocks it hides
// entirely are skipped. A floating mask that requires grad gets its gradient (summed over the
// dims it is broadcast along). A row left with no visible key returns zeros; a hidden key gets
// zero gradient.
at::Tensor attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                     const AttentionOptions& options = {});

// The attention probabilities (..., Hq, Lq, Lk) that `attention` applies to v, materialized for
// inspection: O(Lq * Lk) memory, unlike `attention`. Zero outside the window, at hidden keys and
// in rows with no visible key; with dropout, the dropped and rescaled probabilities (the same
// generator state gives the mask `attention` uses). Differentiable in q, k and sinks.
at::Tensor attention_weights(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                             const AttentionOptions& options = {});

// Packed sequences (FlashAttention's varlen layout): q (total_q, Hq, D), k (total_k, Hkv, D),
// v (total_k, Hkv, Dv); sequence i is rows [cu_seqlens_q[i], cu_seqlens_q[i + 1]) of q and
// [cu_seqlens_k[i], cu_seqlens_k[i + 1]) of k and v (int32, (N + 1,), from 0), at most
// max_seqlen_q / max_seqlen_k long. The window is bottom-right aligned inside each sequence, and
// the options are those of `attention` but the key mask (alibi_slopes (Hq,) or (N, Hq);
// dropout's batch index is the sequence's). Returns out (total_q, Hq, Dv); differentiable.
at::Tensor varlen_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k,
                            c10::SymInt max_seqlen_q, c10::SymInt max_seqlen_k,
                            const AttentionOptions& options = {});

// Attention against a paged KV cache, read in place through the block table (inference: no
// autograd). k_cache (num_pages, page_size, Hkv, D) and v_cache (num_pages, page_size, Hkv, Dv)
// are flash-attn's (and vLLM's flash) paged layout, any page size; block_table int32 (B,
// max_pages) lists sequence b's pages in order and cache_seqlens int32 (B,) counts its keys, the
// first rows of those pages. q is (B, Lq, Hq, D), or packed (total_q, Hq, D) with cu_seqlens_q
// int32 (B + 1,) and max_seqlen_q: sequence b's queries are the last of its keys (bottom-right),
// so decode rows and prefill chunks go in one call. Returns (out, lse): out (B, Lq, Hq, Dv) or
// (total_q, Hq, Dv), lse float32 (B, Hq, Lq) or (Hq, total_q). The options are attention's
// scale, window, softcap, alibi_slopes ((Hq,) or (B, Hq)) and sinks; key_mask, attn_mask,
// dropout_p and generator raise ValueError. No copy of the cache is made. The caches may be 8-bit
// (float8_e4m3fn, float8_e5m2 or int8, both of one dtype, beside a float32, bfloat16 or float16
// q): k_scale and v_scale dequantize them (stored value x scale), one per tensor (a one-element
// tensor) or float32 (num_pages, page_size, Hkv), one per token and KV head; 1 where not given.
// spec_mask (bool (total_q, max_seqlen_q) packed, (B, Lq, Lq) dense; at most 64 new tokens a
// sequence) says which of its sequence's new tokens each query row sees, True where it does, as
// a step that verifies a tree of draft tokens needs; every key before them stays visible, and a
// row must see itself.
std::tuple<at::Tensor, at::Tensor> paged_attention(
    const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
    const at::Tensor& block_table, const at::Tensor& cache_seqlens,
    const AttentionOptions& options = {},
    const std::optional<at::Tensor>& cu_seqlens_q = std::nullopt,
    std::optional<c10::SymInt> max_seqlen_q = std::nullopt,
    const std::optional<at::Tensor>& k_scale = std::nullopt,
    const std::optional<at::Tensor>& v_scale = std::nullopt,
    const std::optional<at::Tensor>& spec_mask = std::nullopt);

// The kernel entry: returns (out, lse); lse (..., Hq, Lq) is float32 (float64 for float64
// inputs). The scale is an argument, not an option; dropout_seed: int64 (2,) (seed, offset),
// required when options.dropout_p > 0 (options.generator stays unset). The op itself also takes
// packed sequences (cu_seqlens_q/k, max_seqlen_q/k, as flash-attn's fwd does), through the
// dispatcher: varlen_attention is its public form.
std::tuple<at::Tensor, at::Tensor> attention_forward(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale,
    const AttentionOptions& options = {},
    const std::optional<at::Tensor>& dropout_seed = std::nullopt);

// Gradients of `attention` given the forward's out and lse: returns (dq, dk, dv, dsinks), dsinks
// (Hq,) in sinks' dtype, empty (0,) without sinks.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> attention_backward(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& lse, double scale,
    const AttentionOptions& options = {},
    const std::optional<at::Tensor>& dropout_seed = std::nullopt);

// attention_backward's gradients and, with attn_mask_grad, the floating attn_mask's: returns
// (dq, dk, dv, dsinks, dattn_mask), dattn_mask shaped and typed like options.attn_mask, empty
// (0,) without attn_mask_grad.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> attention_gradients(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& lse, double scale,
    const AttentionOptions& options = {},
    const std::optional<at::Tensor>& dropout_seed = std::nullopt, bool attn_mask_grad = false);

// The dropout keep mask of `attention` for scores of `shape` (..., Hq, Lq, Lk), as bool: what
// attention_weights multiplies by. dropout_seed as attention_forward's.
at::Tensor dropout_keep_mask(const at::Tensor& dropout_seed, c10::SymIntArrayRef shape,
                             double dropout_p);

}  // namespace causal_attention
