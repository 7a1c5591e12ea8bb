// The CPU dispatch key: validates, views the inputs as (batch, heads, rows, dim), allocates the
// outputs and hands them to the kernels built for this CPU's instruction set. attention and
// varlen_attention reach these through their one kernel (ops/attention.cpp).
#include "../checks.h"
#include "../shapes.h"
#include "kernels/kernel_api.h"

#include <ATen/Version.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
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

// The key mask as the kernels read it: contiguous bool (batch, Lk), and the running count of the
// keys it keeps, (batch, Lk + 1) from 0, which says in O(1) whether a key block is hidden
// entirely (skipped), partly (masked entries) or not at all.
template <typename Tensors>
void set_key_mask(Tensors& t, const std::optional<at::Tensor>& key_mask) {
  // A mask that hides nothing is no mask: the call then runs exactly as without one.
  if (!key_mask.has_value() || key_mask->numel() == 0 || key_mask->all().item<bool>()) {
    return;
  }
  const int64_t len_k = t.k.size(2);
  t.key_mask = key_mask->reshape({t.q.size(0), len_k}).contiguous();
  t.kept_keys_before = at::zeros({t.q.size(0), len_k + 1}, t.key_mask.options().dtype(at::kInt));
  t.kept_keys_before.narrow(1, 1, len_k).copy_(t.key_mask.cumsum(1, at::kInt));
}

std::tuple<at::Tensor, at::Tensor> attention_forward_cpu(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale,
    const std::optional<at::Tensor>& key_mask) {
  detail::check_forward_call(q, k, v, scale, key_mask);
  ForwardTensors t{as_batch_heads_rows(q),
                   as_batch_heads_rows(k),
                   as_batch_heads_rows(v),
                   {},
                   {},
                   scale,
                   {},
                   {},
                   {}};
  set_key_mask(t, key_mask);
  t.out = at::empty({t.q.size(0), t.q.size(1), t.q.size(2), t.v.size(3)}, q.options());
  t.lse = at::empty({t.q.size(0), t.q.size(1), t.q.size(2)}, detail::lse_options(q));
  if (t.lse.numel() > 0) {
    run_kernel(t, AVX512::forward_kernel, AVX2::forward_kernel, DEFAULT::forward_kernel);
  }
  return {t.out.view_symint(detail::output_sym_sizes(q, v)),
          t.lse.view_symint(detail::lse_sym_sizes(q))};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_backward_cpu(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& lse, double scale,
    const std::optional<at::Tensor>& key_mask) {
  detail::check_backward_inputs(grad_out, q, k, v, out, lse, scale, key_mask);
  BackwardTensors t{as_batch_heads_rows(grad_out),
                    as_batch_heads_rows(q),
                    as_batch_heads_rows(k),
                    as_batch_heads_rows(v),
                    as_batch_heads_rows(out),
                    {},
                    {},
                    {},
                    {},
                    scale,
                    {},
                    {},
                    {}};
  set_key_mask(t, key_mask);
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

// Packed sequences: a (total, heads, dim) tensor as the kernels' (1, heads, total, dim).
at::Tensor packed_as_batch_heads_rows(const at::Tensor& t) {
  return as_batch_heads_rows(t.transpose(0, 1).unsqueeze(0));
}

PackedSequences packed_sequences(const char* op, const at::Tensor& q, const at::Tensor& k,
                                 const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k,
                                 int64_t max_seqlen_q, int64_t max_seqlen_k) {
  PackedSequences sequences{cu_seqlens_q.contiguous(), cu_seqlens_k.contiguous()};
  sequences.max_len_q = detail::check_cumulative_lengths(op, "cu_seqlens_q", sequences.cu_q,
                                                         q.size(0), "max_seqlen_q", max_seqlen_q);
  sequences.max_len_k = detail::check_cumulative_lengths(op, "cu_seqlens_k", sequences.cu_k,
                                                         k.size(0), "max_seqlen_k", max_seqlen_k);
  return sequences;
}

std::tuple<at::Tensor, at::Tensor> varlen_attention_forward_cpu(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cu_seqlens_q,
    const at::Tensor& cu_seqlens_k, c10::SymInt max_seqlen_q, c10::SymInt max_seqlen_k,
    double scale) {
  detail::check_varlen_forward_call(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                    scale);
  at::Tensor out = at::empty_symint(detail::varlen_output_sym_sizes(q, v), q.options());
  at::Tensor lse = at::empty_symint(detail::varlen_lse_sym_sizes(q), detail::lse_options(q));
  ForwardTensors t{packed_as_batch_heads_rows(q),
                   packed_as_batch_heads_rows(k),
                   packed_as_batch_heads_rows(v),
                   packed_as_batch_heads_rows(out),
                   lse.unsqueeze(0),
                   scale,
                   {},
                   {},
                   {}};
  t.sequences =
      packed_sequences("causal_attention.varlen_attention_forward", q, k, cu_seqlens_q,
                       cu_seqlens_k, max_seqlen_q.expect_int(), max_seqlen_k.expect_int());
  if (out.numel() > 0 && t.sequences.cu_q.numel() > 1) {
    run_kernel(t, AVX512::forward_kernel, AVX2::forward_kernel, DEFAULT::forward_kernel);
  }
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> varlen_attention_backward_cpu(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& lse, const at::Tensor& cu_seqlens_q,
    const at::Tensor& cu_seqlens_k, c10::SymInt max_seqlen_q, c10::SymInt max_seqlen_k,
    double scale) {
  detail::check_varlen_backward_inputs(grad_out, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k,
                                       max_seqlen_q, max_seqlen_k, scale);
  at::Tensor dq = at::empty(q.sizes(), q.options());
  at::Tensor dk = at::empty(k.sizes(), k.options());
  at::Tensor dv = at::empty(v.sizes(), v.options());
  BackwardTensors t{packed_as_batch_heads_rows(grad_out),
                    packed_as_batch_heads_rows(q),
                    packed_as_batch_heads_rows(k),
                    packed_as_batch_heads_rows(v),
                    packed_as_batch_heads_rows(out),
                    lse.contiguous().unsqueeze(0),
                    packed_as_batch_heads_rows(dq),
                    packed_as_batch_heads_rows(dk),
                    packed_as_batch_heads_rows(dv),
                    scale,
                    {},
                    {},
                    {}};
  t.sequences =
      packed_sequences("causal_attention.varlen_attention_backward", q, k, cu_seqlens_q,
                       cu_seqlens_k, max_seqlen_q.expect_int(), max_seqlen_k.expect_int());
  if ((dq.numel() > 0 || dk.numel() > 0 || dv.numel() > 0) && t.sequences.cu_q.numel() > 1) {
    run_kernel(t, AVX512::backward_kernel, AVX2::backward_kernel, DEFAULT::backward_kernel);
  }
  return {dq, dk, dv};
}

}  // namespace
}  // namespace causal_attention::cpu

TORCH_LIBRARY_IMPL(causal_attention, CPU, m) {
  m.impl("attention_forward", causal_attention::cpu::attention_forward_cpu);
  m.impl("attention_backward", causal_attention::cpu::attention_backward_cpu);
  m.impl("varlen_attention_forward", causal_attention::cpu::varlen_attention_forward_cpu);
  m.impl("varlen_attention_backward", causal_attention::cpu::varlen_attention_backward_cpu);
}
