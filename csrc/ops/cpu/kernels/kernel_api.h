// The entry points of the CPU kernels, compiled once per instruction set (DEFAULT, AVX2, AVX512:
// see CMakeLists.txt) into namespaces of those names, as ATen does with CPU_CAPABILITY.
// attention_cpu.cpp picks one at run time, so the library runs on any x86-64 CPU and uses
// AVX-512 where there is one.
#pragma once

#include <ATen/core/Tensor.h>

namespace causal_attention::cpu {

// Packed sequences (varlen): int32 cumulative lengths (sequences + 1) of the query rows and
// keys, and the longest of each. Undefined for a dense batch.
struct PackedSequences {
  at::Tensor cu_q, cu_k;
  int64_t max_len_q = 0, max_len_k = 0;
  bool packed() const { return cu_q.defined(); }
};

// What the kernels do to the scores besides causal visibility (issue 14's options, applied in
// FlashAttention's order: scale -> softcap -> ALiBi -> visibility -> softmax with sinks ->
// dropout). Query row i sees key j iff i + off - window_left <= j <= i + off + window_right
// (off = len_k - len_q of its sequence), -1 meaning unbounded on that side. softcap 0 is off.
// alibi_slopes: contiguous float32 (batch, heads_q), sinks: contiguous (heads_q,) in the
// accumulation dtype, each undefined when not used. dropout_p 0 is off; else the counter-based
// mask of dropout_hash.h keyed by (dropout_seed, dropout_offset, batch, head, row, key).
struct ScoreOptions {
  int64_t window_left = -1, window_right = 0;
  double softcap = 0;
  at::Tensor alibi_slopes, sinks;
  double dropout_p = 0;
  uint64_t dropout_seed = 0, dropout_offset = 0;
};

// q, k, v, out: (batch, heads, rows, dim) with unit stride along dim; lse: (batch, heads_q,
// len_q) with unit stride along rows, in the accumulation dtype. Packed sequences: batch 1, the
// rows of every sequence one after the other, lse (1, heads_q, total rows). key_mask: contiguous
// bool (batch, len_k), kept_keys_before its int32 running count (batch, len_k + 1) from 0;
// both undefined without a mask.
struct ForwardTensors {
  at::Tensor q, k, v, out, lse;
  double scale;
  at::Tensor key_mask, kept_keys_before;
  PackedSequences sequences;
  ScoreOptions options;
  // bfloat16/float16: whether the block products are native (block_gemm.h), decided once per
  // call at the op boundary so that every product of the call agrees.
  bool native_products = false;
};

// As ForwardTensors, plus grad_out shaped like out and dq, dk, dv shaped like q, k, v, and with
// sinks dsinks (heads_q,) in the accumulation dtype.
struct BackwardTensors {
  at::Tensor grad_out, q, k, v, out, lse, dq, dk, dv;
  double scale;
  at::Tensor key_mask, kept_keys_before;
  PackedSequences sequences;
  ScoreOptions options;
  at::Tensor dsinks;
  bool native_products = false;  // as ForwardTensors
};

#define CAUSAL_ATTENTION_DECLARE_KERNELS(capability)    \
  namespace capability {                                \
  void forward_kernel(const ForwardTensors& tensors);   \
  void backward_kernel(const BackwardTensors& tensors); \
  }
CAUSAL_ATTENTION_DECLARE_KERNELS(DEFAULT)
#if defined(CAUSAL_ATTENTION_BASELINE_KERNELS_ONLY)
// Not x86-64: CMakeLists.txt builds the baseline only, and at::get_cpu_capability() never selects
// the others, whose names it takes.
namespace AVX2 = DEFAULT;
namespace AVX512 = DEFAULT;
#else
CAUSAL_ATTENTION_DECLARE_KERNELS(AVX2)
CAUSAL_ATTENTION_DECLARE_KERNELS(AVX512)
#endif
#undef CAUSAL_ATTENTION_DECLARE_KERNELS

}  // namespace causal_attention::cpu
