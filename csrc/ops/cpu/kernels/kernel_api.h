// The entry points of the CPU kernels, compiled once per instruction set (DEFAULT, AVX2, AVX512:
// see CMakeLists.txt) into namespaces of those names, as ATen does with CPU_CAPABILITY.
// attention_cpu.cpp picks one at run time, so the library runs on any x86-64 CPU and uses
// AVX-512 where there is one.
#pragma once

#include <ATen/core/Tensor.h>

namespace causal_attention::cpu {

// q, k, v, out: (batch, heads, rows, dim) with unit stride along dim; lse: contiguous
// (batch, heads_q, len_q) in the accumulation dtype.
struct ForwardTensors {
  at::Tensor q, k, v, out, lse;
  double scale;
};

// As ForwardTensors, plus grad_out shaped like out and dq, dk, dv shaped like q, k, v.
struct BackwardTensors {
  at::Tensor grad_out, q, k, v, out, lse, dq, dk, dv;
  double scale;
};

#define CAUSAL_ATTENTION_DECLARE_KERNELS(capability)    \
  namespace capability {                                \
  void forward_kernel(const ForwardTensors& tensors);   \
  void backward_kernel(const BackwardTensors& tensors); \
  }
CAUSAL_ATTENTION_DECLARE_KERNELS(DEFAULT)
CAUSAL_ATTENTION_DECLARE_KERNELS(AVX2)
CAUSAL_ATTENTION_DECLARE_KERNELS(AVX512)
#undef CAUSAL_ATTENTION_DECLARE_KERNELS

}  // namespace causal_attention::cpu
