// CPU forward of attention_forward: K/V rows read from the call's tensors (forward_kernel.h).
#include "dtype_dispatch.h"
#include "forward_kernel.h"
#include "kernel_api.h"

namespace causal_attention::cpu::CPU_CAPABILITY {
namespace {

template <typename scalar_t, typename gemm_t>
using TensorForwardKernel = ForwardKernel<scalar_t, gemm_t, ForwardTensors>;

void forward_kernel_impl(const ForwardTensors& tensors) {
  run_for_dtype<TensorForwardKernel>(tensors);
}

}  // namespace

CAUSAL_ATTENTION_REGISTER_KERNEL(forward_kernel, forward_kernel_impl);

}  // namespace causal_attention::cpu::CPU_CAPABILITY
