// Argument validation shared by every kernel of the ops (CPU, Meta, Autograd), so that a bad call
// fails the same way whichever dispatch key it reaches, with a typed error naming the op and the
// argument: c10::ValueError (shapes, devices, values), c10::TypeError (dtypes, missing tensors),
// c10::NotImplementedError (nested, sparse). Each check takes the call's struct
// (op_arguments.h). Written against sym_sizes() so that the Meta kernels run it under symbolic
// shapes (torch.compile, torch.export). What a valid call's outputs look like is shapes.h.
// The checks of the dense and packed calls' ops, built on tensor_checks.h and option_checks.h;
// paged_attention's are paged_checks.h.
#pragma once

#include "op_arguments.h"

#include <ATen/core/Generator.h>
#include <ATen/core/Tensor.h>

#include <optional>

namespace causal_attention::detail {

// Everything a differentiable op checks (`op` names it: attention, attention_weights,
// varlen_attention); returns the scale it runs at: `call.scale` (finite in q's accumulation
// dtype) or 1/sqrt(D).
//
// Dense: q (..., Hq, Lq, D), k (..., Hkv, Lk, D), v (..., Hkv, Lk, Dv), equal leading dims,
// Hq % Hkv == 0, key_mask bool (*batch, Lk). Packed (call.packed given): q (total_q, Hq, D),
// k (total_k, Hkv, D), v (total_k, Hkv, Dv), cu_seqlens_q/k int32 (N + 1,) and max_seqlen_q/k,
// no key mask. The score options: window two entries >= -1; softcap > 0 and finite in the
// accumulation dtype; alibi_slopes float32 (Hq,) or (*batch, Hq) ((N, Hq) packed); sinks (Hq,)
// in q's dtype or float32; dropout_p in [0, 1).
double check_attention_call(const char* op, const AttentionCall& call);

// The forward call a differentiable op (attention, varlen_attention) runs: checked under the op's
// name, at the resolved scale, with dropout's seed drawn from call.generator.
ForwardCall resolve_attention_call(const AttentionCall& call);

// Everything attention_forward checks: the above at the given scale, the dropout seed: int64 (2,)
// (seed, offset) on the CPU (or the Meta device for a Meta call), when dropout_p > 0, and
// query_offset only for a dense call.
void check_forward_call(const ForwardCall& call);

// Everything attention_gradients (or, under `op`, attention_backward) checks: the forward's call,
// plus grad_out and out shaped like the forward's out in q's dtype, lse like its lse in the
// accumulation dtype, delta (when given) like lse, and with attn_mask_grad a floating attn_mask.
void check_backward_call(const BackwardCall& call,
                         const char* op = "causal_attention.attention_gradients");

// dropout_keep_mask: the seed as the kernel ops', always read; dropout_p in [0, 1); shape
// (..., Lq, Lk).
void check_dropout_keep_mask_call(const at::Tensor& dropout_seed, c10::SymIntArrayRef shape,
                                  double dropout_p);

// The seed a differentiable op hands its kernel op: drawn from `generator` (the default CPU
// generator when none) as at::empty({2}, at::kLong).random_(generator) when dropout_p > 0, else
// none.
std::optional<at::Tensor> draw_dropout_seed(double dropout_p,
                                            const std::optional<at::Generator>& generator);

}  // namespace causal_attention::detail
