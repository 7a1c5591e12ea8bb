// The CPU dispatch key: validates, views the inputs as (batch, heads, rows, dim), allocates the
// outputs and hands them to the kernels built for this CPU's instruction set.
#include "../checks.h"
#include "kernels/kernel_api.h"

#include <ATen/Version.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <string>

namespace causal_attention::cpu {
namespace {

// (..., H, L, D) or (L, D) as a 4-D (batch, H, L, D) tensor with unit stride along D: a view
// whenever the leading dims can be merged (the transposed (B, L, H, D) layout included).
at::Tensor as_batch_heads_rows(const at::Tensor& t) {
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

// Calls the build of a kernel for this CPU's instruction set.
template <typename Tensors>
void run_kernel(const Tensors& tensors, void (*avx512)(const Tensors&),
                void (*avx2)(const Tensors&), void (*baseline)(const Tensors&)) {
  switch (instruction_set()) {
    case InstructionSet::kAvx512:
      return avx512(tensors);
    case InstructionSet::kAvx2:
      return avx2(tensors);
    case InstructionSet::kDefault:
      return baseline(tensors);
  }
}

std::tuple<at::Tensor, at::Tensor> attention_forward_cpu(const at::Tensor& q, const at::Tensor& k,
                                                         const at::Tensor& v, double scale) {
  detail::check_forward_call(q, k, v, scale);
  ForwardTensors t{
      as_batch_heads_rows(q), as_batch_heads_rows(k), as_batch_heads_rows(v), {}, {}, scale};
  t.out = at::empty({t.q.size(0), t.q.size(1), t.q.size(2), t.v.size(3)}, q.options());
  t.lse = at::empty({t.q.size(0), t.q.size(1), t.q.size(2)},
                    q.options().dtype(detail::accumulation_dtype(q.scalar_type())));
  if (t.lse.numel() > 0) {
    run_kernel(t, AVX512::forward_kernel, AVX2::forward_kernel, DEFAULT::forward_kernel);
  }
  return {t.out.view_symint(detail::output_sym_sizes(q, v)),
          t.lse.view_symint(detail::lse_sym_sizes(q))};
}

at::Tensor attention_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                         std::optional<double> scale) {
  const double resolved = detail::check_attention_call(q, k, v, scale);
  return std::get<0>(attention_forward_cpu(q, k, v, resolved));
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_backward_cpu(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& lse, double scale) {
  detail::check_backward_inputs(grad_out, q, k, v, out, lse, scale);
  BackwardTensors t{as_batch_heads_rows(grad_out),
                    as_batch_heads_rows(q),
                    as_batch_heads_rows(k),
                    as_batch_heads_rows(v),
                    as_batch_heads_rows(out),
                    {},
                    {},
                    {},
                    {},
                    scale};
  t.lse = lse.reshape({t.q.size(0), t.q.size(1), t.q.size(2)}).contiguous();
  t.dq = at::empty(t.q.sizes(), q.options());
  t.dk = at::empty(t.k.sizes(), k.options());
  t.dv = at::empty(t.v.sizes(), v.options());
  if (t.dq.numel() > 0 || t.dk.numel() > 0 || t.dv.numel() > 0) {
    run_kernel(t, AVX512::backward_kernel, AVX2::backward_kernel, DEFAULT::backward_kernel);
  }
  return {t.dq.view_symint(q.sym_sizes()), t.dk.view_symint(k.sym_sizes()),
          t.dv.view_symint(v.sym_sizes())};
}

}  // namespace
}  // namespace causal_attention::cpu

TORCH_LIBRARY_IMPL(causal_attention, CPU, m) {
  m.impl("attention", causal_attention::cpu::attention_cpu);
  m.impl("attention_forward", causal_attention::cpu::attention_forward_cpu);
  m.impl("attention_backward", causal_attention::cpu::attention_backward_cpu);
}
