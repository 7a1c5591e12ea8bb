// The dtype dispatch of the kernels, and the operand type their block products use.
#pragma once

#include "../block_gemm.h"

#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>

#include <type_traits>

namespace causal_attention::cpu::CPU_CAPABILITY {

// Runs Kernel<scalar_t, gemm_t>(tensors).run() for the inputs' dtype. gemm_t is the type the
// products of two inputs (S = Q K^T, dP = dO V^T) multiply: for bfloat16/float16 the dtype
// itself where the call uses native products (tensors.native_products; only the AVX-512 build
// has them), else the inputs widened to float32 tiles (block_gemm.h). The numerics are the same
// either way, up to the order of float32 sums.
template <template <typename, typename> class Kernel, typename Tensors>
void run_for_dtype(const Tensors& tensors) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, tensors.q.scalar_type(),
                                  "causal_attention_cpu", [&] {
                                    using acc_t = at::opmath_type<scalar_t>;
#if defined(CPU_CAPABILITY_AVX512)
                                    if constexpr (!std::is_same_v<scalar_t, acc_t>) {
                                      if (tensors.native_products) {
                                        Kernel<scalar_t, scalar_t>(tensors).run();
                                        return;
                                      }
                                    }
#endif
                                    Kernel<scalar_t, acc_t>(tensors).run();
                                  });
}

}  // namespace causal_attention::cpu::CPU_CAPABILITY
