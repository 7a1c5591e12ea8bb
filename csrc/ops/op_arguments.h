// The ops' arguments as one value each, the way every layer below the schema takes them
// (flash-attn's Flash_fwd_params, ATen's sdp_params): the schemas stay flat, because the
// dispatcher needs that, and schema_adapters.h turns the flat arguments into these structs on
// the first line of every kernel. The checks (checks.h), autograd's save and load, autocast and
// the kernel setup then take the struct, so a new option changes the schema, ScoreOptions, the
// kernels and one line in each of those.
#pragma once

#include <ATen/core/Generator.h>
#include <ATen/core/Tensor.h>
#include <c10/core/SymInt.h>

#include <optional>
#include <utility>
#include <vector>

namespace causal_attention::detail {

// What the scores go through besides the scale (ops.h): window -> softcap -> ALiBi ->
// visibility -> softmax with sinks -> dropout. dropout_seed is the kernel ops' (seed, offset);
// the differentiable ops draw it from their generator (draw_dropout_seed).
struct ScoreOptions {
  std::vector<int64_t> window{-1, 0};
  std::optional<double> softcap;
  std::optional<at::Tensor> alibi_slopes, sinks;
  double dropout_p = 0.0;
  std::optional<at::Tensor> dropout_seed;
};

// attn_mask as SDPA takes it, broadcastable to the scores (*batch, Hq, Lq, Lk) and never expanded
// in memory: bool (true where a query row may attend a key), or floating (float32 or q's dtype,
// added to the scores after softcap and ALiBi; -inf hides the key). Dense calls only.
using AttentionMask = std::optional<at::Tensor>;

// Packed sequences (varlen): all four given, or none for a dense call.
struct PackedLengths {
  std::optional<at::Tensor> cu_seqlens_q, cu_seqlens_k;
  std::optional<c10::SymInt> max_seqlen_q, max_seqlen_k;

  bool any() const {
    return cu_seqlens_q.has_value() || cu_seqlens_k.has_value() || max_seqlen_q.has_value() ||
           max_seqlen_k.has_value();
  }
};

// A call of a differentiable op: attention, attention_weights (dense) or varlen_attention
// (packed, no key mask). scale is resolved by the checks (check_attention_call).
struct AttentionCall {
  AttentionCall(at::Tensor q_, at::Tensor k_, at::Tensor v_)
      : q(std::move(q_)), k(std::move(k_)), v(std::move(v_)) {}

  at::Tensor q, k, v;
  std::optional<double> scale;
  std::optional<at::Tensor> key_mask;
  AttentionMask attn_mask;
  ScoreOptions options;
  PackedLengths packed;
  std::optional<at::Generator> generator;
};

// A call of attention_forward: dense, or packed where `packed` is given.
struct ForwardCall {
  ForwardCall() = default;
  ForwardCall(at::Tensor q_, at::Tensor k_, at::Tensor v_)
      : q(std::move(q_)), k(std::move(k_)), v(std::move(v_)) {}

  at::Tensor q, k, v;
  double scale = 0.0;
  std::optional<at::Tensor> key_mask;
  AttentionMask attn_mask;
  ScoreOptions options;
  PackedLengths packed;
  // The key position of query row 0 (dense calls): row i sits at key position i + query_offset
  // for the window and ALiBi. None: Lk - Lq, bottom-right. A ring step (distributed/ring.py) gives
  // its shards' global offset, so that the caller's window and ALiBi apply unchanged.
  std::optional<c10::SymInt> query_offset;
};

// A call of attention_gradients (attention_backward is it without the mask's gradient): the
// forward's call, its out and lse, and out's gradient; attn_mask_grad asks for a floating
// attn_mask's gradient. delta, when given (lse's shape and dtype), is rowsum(dO o O) of each query
// row over all the keys it sees, of which the call holds only some (a ring step): the backward
// then takes lse and delta as they are instead of recomputing row statistics from its own keys,
// and returns dq, dk and dv in the accumulation dtype: shares its caller sums, unrounded.
struct BackwardCall : ForwardCall {
  BackwardCall() = default;
  explicit BackwardCall(ForwardCall forward) : ForwardCall(std::move(forward)) {}

  at::Tensor grad_out, out, lse;
  bool attn_mask_grad = false;
  std::optional<at::Tensor> delta;
};

// A call of paged_attention (inference only): the cache's pages k_cache (num_pages, page_size,
// Hkv, D) and v_cache (num_pages, page_size, Hkv, Dv), flash-attn's paged layout; block_table int32
// (B, max_pages) lists sequence b's pages in order and cache_seqlens int32 (B,) counts its keys,
// the first rows of those pages. q is dense (B, Lq, Hq, D), or packed (total_q, Hq, D) with
// cu_seqlens_q (B + 1,) and max_seqlen_q; sequence b's queries are the last of its keys
// (bottom-right: with more queries than keys, the first ones see none), so decode rows (one
// query) and prefill chunks share one call. The options are
// the score options but dropout (an inference op draws none). The caches may instead be 8-bit
// (float8_e4m3fn, float8_e5m2 or int8, both of one dtype, beside a float32, bfloat16 or float16
// q), with k_scale and v_scale their dequantization scales (stored value x scale = key or value):
// one per tensor (a one-element floating tensor) or one per token and KV head (float32
// (num_pages, page_size, Hkv)); 1 where not given.
struct PagedCall {
  at::Tensor q, k_cache, v_cache, block_table, cache_seqlens;
  std::optional<at::Tensor> cu_seqlens_q;
  std::optional<c10::SymInt> max_seqlen_q;
  std::optional<double> scale;
  ScoreOptions options;
  std::optional<at::Tensor> k_scale, v_scale;
  // Which of its sequence's new tokens each query row sees (speculative trees): bool
  // (total_q, max_seqlen_q) packed, (B, Lq, Lq) dense; every cached key before them stays visible.
  std::optional<at::Tensor> spec_mask;

  bool packed() const { return cu_seqlens_q.has_value(); }
};

}  // namespace causal_attention::detail
