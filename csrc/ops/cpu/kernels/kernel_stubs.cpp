// The kernels' stubs (kernel_api.h), compiled once: every kernel source registers its builds in
// them, and they call the one for this CPU's instruction set.
#include "kernel_api.h"

#include <ATen/Version.h>

#include <string>

namespace causal_attention::cpu {
namespace {

enum class InstructionSet { kDefault, kAvx2, kAvx512 };

// The same choice ATen makes for its own kernels (ATEN_CPU_CAPABILITY can lower it).
InstructionSet instruction_set() {
  static const InstructionSet chosen = [] {
    const std::string capability = at::get_cpu_capability();
    if (capability == "AVX512") return InstructionSet::kAvx512;
    if (capability == "AVX2") return InstructionSet::kAvx2;
    return InstructionSet::kDefault;
  }();
  return chosen;
}

}  // namespace

template <typename Tensors>
void KernelStub<Tensors>::operator()(const Tensors& tensors) const {
  const InstructionSet chosen = instruction_set();
  if (chosen == InstructionSet::kAvx512 && avx512 != nullptr) {
    return avx512(tensors);
  }
  if (chosen != InstructionSet::kDefault && avx2 != nullptr) {
    return avx2(tensors);
  }
  TORCH_CHECK(baseline != nullptr,
              "causal_attention: this library was built without the CPU kernels "
              "for capability ",
              at::get_cpu_capability(), " (CAUSAL_ATTENTION_ONLY_CAPABILITY)");
  baseline(tensors);
}

// Constant-initialized (no constructor runs), so they are in place before any kernel source's
// registration runs, whatever the order of static initialization.
KernelStub<ForwardTensors> forward_kernel;
KernelStub<BackwardTensors> backward_kernel;
KernelStub<KeepMaskTensors> dropout_keep_mask_kernel;
KernelStub<PagedForwardTensors> paged_forward_kernel;

template struct KernelStub<ForwardTensors>;
template struct KernelStub<BackwardTensors>;
template struct KernelStub<KeepMaskTensors>;
template struct KernelStub<PagedForwardTensors>;

}  // namespace causal_attention::cpu
