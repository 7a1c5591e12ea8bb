// The checks of the ops' tensor arguments, whatever the call: the lowest layer of the checks
// (option_checks.h builds on it; checks.h and paged_checks.h put both together per call). Each
// throws c10::ValueError, c10::TypeError or c10::NotImplementedError naming `op` and the
// argument. Written against sym_sizes(), so that the Meta kernels run them under symbolic shapes.
#pragma once

#include "op_arguments.h"

#include <ATen/core/Tensor.h>

#include <optional>

namespace causal_attention::detail {

// Runs before anything asks a tensor for its sizes: defined, not nested, strided.
void check_dense_tensor(const char* op, const char* name, const at::Tensor& t);

// At least 2 dims (..., L, D).
void check_rank(const char* op, const char* name, const at::Tensor& t);

// Dense q (..., Hq, Lq, D), k (..., Hkv, Lk, D), v (..., Hkv, Lk, Dv): dense tensors, ranks,
// dtypes, devices, leading dims, head dims, Hq % Hkv.
void check_dense_inputs(const char* op, const at::Tensor& q, const at::Tensor& k,
                        const at::Tensor& v);

// Packed q (total_q, Hq, D), k (total_k, Hkv, D), v (total_k, Hkv, Dv) with all four of
// `packed` given and no key mask: cu_seqlens_q/k int32 1-D of one length N + 1 on q's device,
// max_seqlen_q/k non-negative. Shapes only; the values of cu_seqlens are
// check_cumulative_lengths' (below).
void check_packed_inputs(const char* op, const at::Tensor& q, const at::Tensor& k,
                         const at::Tensor& v, const std::optional<at::Tensor>& key_mask,
                         const PackedLengths& packed);

// key_mask, where given: bool, on q's device, shaped (*batch, Lk).
void check_key_mask(const char* op, const at::Tensor& q, const at::Tensor& k,
                    const std::optional<at::Tensor>& key_mask);

// attn_mask, where given: bool, float32 or q's dtype (TypeError otherwise, as SDPA), on q's
// device, broadcastable to the scores (*batch, Hq, Lq, Lk).
void check_attn_mask(const char* op, const at::Tensor& q, const at::Tensor& k,
                     const AttentionMask& attn_mask);

// A backward's grad_out and out in q's dtype, lse in the accumulation dtype, all on q's device.
void check_saved_forward(const char* op, const at::Tensor& q, const at::Tensor& grad_out,
                         const at::Tensor& out, const at::Tensor& lse);

// The values of one cumulative-lengths tensor (contiguous int32 on the CPU): starts at 0, never
// decreases, ends at `total` rows, no length above `max_seqlen`. Returns the longest length.
// The CPU kernels run it where they read the tensor (packed and paged calls).
int64_t check_cumulative_lengths(const char* op, const char* name, const at::Tensor& cu_seqlens,
                                 int64_t total, const char* max_name, int64_t max_seqlen);

}  // namespace causal_attention::detail
