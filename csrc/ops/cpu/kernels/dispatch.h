// The dtype dispatch of the kernels, and the operand type their block products use.
#pragma once

#include "../block_gemm.h"

#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>

#include <type_traits>

namespace causal_attention::cpu::CPU_CAPABILITY {

// Runs Kernel<scalar_t, gemm_t>(tensors).run() for the inputs' dtype, with the operand type the
// micro-kernel multiplies best in this build: bfloat16 itself where the bfloat16 micro-kernel
// runs (the AVX-512 build, on a CPU and a oneDNN that have it), else the accumulation type.
// Decided once per call: the whole call uses one micro-kernel.
template <template <typename, typename> class Kernel, typename Tensors>
void run_for_dtype(const Tensors& tensors) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, tensors.q.scalar_type(),
                                  "causal_attention_cpu", [&] {
                                    using acc_t = at::opmath_type<scalar_t>;
#if defined(CPU_CAPABILITY_AVX512)
                                    if constexpr (std::is_same_v<scalar_t, at::BFloat16>) {
                                      if (bf16_block_gemm_available()) {
                                        Kernel<scalar_t, at::BFloat16>(tensors).run();
                                        return;
                                      }
                                    }
#endif
                                    Kernel<scalar_t, acc_t>(tensors).run();
                                  });
}

}  // namespace causal_attention::cpu::CPU_CAPABILITY
