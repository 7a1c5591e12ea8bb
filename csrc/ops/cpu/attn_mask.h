// attn_mask at the CPU op boundary: a mask -> the kernels' view of it and its tile summary
// (KernelAttentionMask, kernels/kernel_api.h), summarized once per call; and the kernel's dS over
// the scores -> the mask's gradient, reduced to the mask's shape.
#pragma once

#include "kernels/kernel_api.h"

#include <ATen/core/Tensor.h>

namespace causal_attention::cpu {

// attn_mask as the kernels read it (kernel_api.h), for q, k in the kernels' layout: floating
// masks in the accumulation dtype, unit stride along keys, expanded to the scores as a view.
KernelAttentionMask kernel_attn_mask(const at::Tensor& mask, const at::Tensor& q,
                                     const ForwardTensors& t);

// attn_mask's gradient from the kernel's dS over the scores (batch, Hq, Lq, Lk): summed over the
// dims the mask is broadcast along, one slice after the other (the same sums at any thread
// count), in the mask's shape and dtype.
at::Tensor attn_mask_gradient(const at::Tensor& scores_grad, const at::Tensor& q,
                              const at::Tensor& k, const at::Tensor& mask);

}  // namespace causal_attention::cpu
