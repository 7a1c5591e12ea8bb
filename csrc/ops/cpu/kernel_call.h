// What every CPU entry does to hand a call to the kernels (kernels/kernel_api.h): view its
// tensors in the kernels' layout, resolve its score options, and run the kernel's build for this
// CPU with the call's block products decided once. Shared by attention_cpu.cpp (dense and packed
// calls) and paged_attention_cpu.cpp.
#pragma once

#include "../op_arguments.h"
#include "../shapes.h"
#include "block_gemm.h"
#include "kernels/kernel_api.h"

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace causal_attention::cpu {

// (..., H, L, D) or (L, D) as a 4-D (batch, H, L, D) tensor with unit stride along D: a view
// whenever the leading dims can be merged (the transposed (B, L, H, D) layout included).
inline at::Tensor as_batch_heads_rows(const at::Tensor& t) {
  at::Tensor t4;
  if (t.dim() == 2) {
    t4 = t.unsqueeze(0).unsqueeze(0);
  } else if (t.dim() == 3) {
    t4 = t.unsqueeze(0);
  } else {
    int64_t batch = 1;
    for (int64_t d = 0; d + 3 < t.dim(); ++d) {
      batch *= t.size(d);
    }
    t4 = t.reshape({batch, t.size(-3), t.size(-2), t.size(-1)});
  }
  if (t4.stride(3) != 1 && t4.size(3) > 1) {
    t4 = t4.contiguous();
  }
  return t4;
}

// Calls a kernel's build for this CPU (kernel_api.h), with the block products of
// bfloat16/float16 decided once for the call (block_gemm.h): torch.backends.mkldnn is read here
// only, so that a flag flipped by another thread meanwhile changes no product of this call.
template <typename Tensors>
void run_kernel(const KernelStub<Tensors>& kernel, Tensors tensors) {
  tensors.native_products = native_products_now(tensors.q.scalar_type());
  kernel(tensors);
}

// The score options as the kernels read them (kernel_api.h), for tensors already in the kernels'
// layout with their sequences set.
inline KernelScoreOptions kernel_options(const ForwardTensors& t,
                                         const detail::ScoreOptions& options) {
  KernelScoreOptions resolved;
  resolved.window_left = options.window[0];
  resolved.window_right = options.window[1];
  resolved.softcap = options.softcap.value_or(0.0);
  const int64_t batch = t.sequences.packed() ? t.sequences.cu_q.numel() - 1 : t.q.size(0);
  const int64_t heads_q = t.q.size(1);
  if (options.alibi_slopes.has_value()) {
    const at::Tensor& slopes = *options.alibi_slopes;
    resolved.alibi_slopes =
        (slopes.dim() == 1 ? slopes.expand({batch, heads_q}) : slopes.reshape({batch, heads_q}))
            .contiguous();
  }
  if (options.sinks.has_value()) {
    resolved.sinks = options.sinks->to(detail::accumulation_dtype(t.q.scalar_type())).contiguous();
  }
  resolved.dropout_p = options.dropout_p;
  if (options.dropout_p > 0) {
    const at::Tensor seed = options.dropout_seed->contiguous();
    resolved.dropout_seed = uint64_t(seed.data_ptr<int64_t>()[0]);
    resolved.dropout_offset = uint64_t(seed.data_ptr<int64_t>()[1]);
  }
  return resolved;
}

}  // namespace causal_attention::cpu
