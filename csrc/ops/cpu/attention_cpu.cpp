// The CPU dispatch key: validates, views the inputs as (batch, heads, rows, dim), allocates the
// outputs and hands them to the kernels built for this CPU's instruction set. attention and
// varlen_attention reach these through their one kernel (ops/attention.cpp).
#include "../checks.h"
#include "../dropout_hash.h"
#include "../shapes.h"
#include "block_gemm.h"
#include "kernels/kernel_api.h"

#include <ATen/Parallel.h>
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

// Calls the build of a kernel for this CPU's instruction set, with the block products of
// bfloat16/float16 decided once for the call (block_gemm.h): torch.backends.mkldnn is read here
// only, so that a flag flipped by another thread meanwhile changes no product of this call.
template <typename Tensors>
void run_kernel(Tensors tensors, void (*avx512)(const Tensors&), void (*avx2)(const Tensors&),
                void (*baseline)(const Tensors&)) {
  tensors.native_products = native_products_now(tensors.q.scalar_type());
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

// The score options as the kernels read them (kernel_api.h), for tensors already viewed as
// (batch, heads, rows, dim) and, for packed sequences, with their sequences set.
template <typename Tensors>
void set_score_options(Tensors& t, at::IntArrayRef window, std::optional<double> softcap,
                       const std::optional<at::Tensor>& alibi_slopes,
                       const std::optional<at::Tensor>& sinks, double dropout_p,
                       const std::optional<at::Tensor>& dropout_seed) {
  ScoreOptions& options = t.options;
  options.window_left = window[0];
  options.window_right = window[1];
  options.softcap = softcap.value_or(0.0);
  const int64_t batch = t.sequences.packed() ? t.sequences.cu_q.numel() - 1 : t.q.size(0);
  const int64_t heads_q = t.q.size(1);
  if (alibi_slopes.has_value()) {
    const at::Tensor& slopes = *alibi_slopes;
    options.alibi_slopes =
        (slopes.dim() == 1 ? slopes.expand({batch, heads_q}) : slopes.reshape({batch, heads_q}))
            .contiguous();
  }
  if (sinks.has_value()) {
    options.sinks = sinks->to(detail::accumulation_dtype(t.q.scalar_type())).contiguous();
  }
  options.dropout_p = dropout_p;
  if (dropout_p > 0) {
    const at::Tensor seed = dropout_seed->contiguous();
    options.dropout_seed = uint64_t(seed.data_ptr<int64_t>()[0]);
    options.dropout_offset = uint64_t(seed.data_ptr<int64_t>()[1]);
  }
}

// The sinks' gradient in the backward: accumulated by the kernel in the accumulation dtype, and
// returned in the sinks' dtype; (0,) without sinks.
template <typename Tensors>
void allocate_sink_gradient(Tensors& t, const std::optional<at::Tensor>& sinks) {
  if (sinks.has_value()) {
    t.dsinks = at::zeros({sinks->size(0)},
                         sinks->options().dtype(detail::accumulation_dtype(t.q.scalar_type())));
  }
}

at::Tensor sink_gradient(const at::Tensor& dsinks, const at::Tensor& q,
                         const std::optional<at::Tensor>& sinks) {
  return sinks.has_value() ? dsinks.to(sinks->scalar_type()) : at::empty({0}, q.options());
}

std::tuple<at::Tensor, at::Tensor> attention_forward_cpu(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale,
    const std::optional<at::Tensor>& key_mask, at::IntArrayRef window,
    std::optional<double> softcap, const std::optional<at::Tensor>& alibi_slopes,
    const std::optional<at::Tensor>& sinks, double dropout_p,
    const std::optional<at::Tensor>& dropout_seed) {
  detail::check_forward_call(q, k, v, scale, key_mask, window, softcap, alibi_slopes, sinks,
                             dropout_p, dropout_seed);
  ForwardTensors t{as_batch_heads_rows(q),
                   as_batch_heads_rows(k),
                   as_batch_heads_rows(v),
                   {},
                   {},
                   scale,
                   {},
                   {},
                   {},
                   {}};
  set_key_mask(t, key_mask);
  set_score_options(t, window, softcap, alibi_slopes, sinks, dropout_p, dropout_seed);
  t.out = at::empty({t.q.size(0), t.q.size(1), t.q.size(2), t.v.size(3)}, q.options());
  t.lse = at::empty({t.q.size(0), t.q.size(1), t.q.size(2)}, detail::lse_options(q));
  if (t.lse.numel() > 0) {
    run_kernel(t, AVX512::forward_kernel, AVX2::forward_kernel, DEFAULT::forward_kernel);
  }
  return {t.out.view_symint(detail::output_sym_sizes(q, v)),
          t.lse.view_symint(detail::lse_sym_sizes(q))};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> attention_backward_cpu(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& lse, double scale,
    const std::optional<at::Tensor>& key_mask, at::IntArrayRef window,
    std::optional<double> softcap, const std::optional<at::Tensor>& alibi_slopes,
    const std::optional<at::Tensor>& sinks, double dropout_p,
    const std::optional<at::Tensor>& dropout_seed) {
  detail::check_backward_inputs(grad_out, q, k, v, out, lse, scale, key_mask, window, softcap,
                                alibi_slopes, sinks, dropout_p, dropout_seed);
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
                    {},
                    {},
                    {}};
  set_key_mask(t, key_mask);
  set_score_options(t, window, softcap, alibi_slopes, sinks, dropout_p, dropout_seed);
  allocate_sink_gradient(t, sinks);
  t.lse = lse.reshape({t.q.size(0), t.q.size(1), t.q.size(2)}).contiguous();
  t.dq = at::empty(t.q.sizes(), q.options());
  t.dk = at::empty(t.k.sizes(), k.options());
  t.dv = at::empty(t.v.sizes(), v.options());
  if (t.dq.numel() > 0 || t.dk.numel() > 0 || t.dv.numel() > 0) {
    run_kernel(t, AVX512::backward_kernel, AVX2::backward_kernel, DEFAULT::backward_kernel);
  }
  return {t.dq.view_symint(q.sym_sizes()), t.dk.view_symint(k.sym_sizes()),
          t.dv.view_symint(v.sym_sizes()), sink_gradient(t.dsinks, q, sinks)};
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
    double scale, at::IntArrayRef window, std::optional<double> softcap,
    const std::optional<at::Tensor>& alibi_slopes, const std::optional<at::Tensor>& sinks,
    double dropout_p, const std::optional<at::Tensor>& dropout_seed) {
  detail::check_varlen_forward_call(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                    scale, window, softcap, alibi_slopes, sinks, dropout_p,
                                    dropout_seed);
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
                   {},
                   {}};
  t.sequences =
      packed_sequences("causal_attention.varlen_attention_forward", q, k, cu_seqlens_q,
                       cu_seqlens_k, max_seqlen_q.expect_int(), max_seqlen_k.expect_int());
  set_score_options(t, window, softcap, alibi_slopes, sinks, dropout_p, dropout_seed);
  if (out.numel() > 0 && t.sequences.cu_q.numel() > 1) {
    run_kernel(t, AVX512::forward_kernel, AVX2::forward_kernel, DEFAULT::forward_kernel);
  }
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> varlen_attention_backward_cpu(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& lse, const at::Tensor& cu_seqlens_q,
    const at::Tensor& cu_seqlens_k, c10::SymInt max_seqlen_q, c10::SymInt max_seqlen_k,
    double scale, at::IntArrayRef window, std::optional<double> softcap,
    const std::optional<at::Tensor>& alibi_slopes, const std::optional<at::Tensor>& sinks,
    double dropout_p, const std::optional<at::Tensor>& dropout_seed) {
  detail::check_varlen_backward_inputs(grad_out, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k,
                                       max_seqlen_q, max_seqlen_k, scale, window, softcap,
                                       alibi_slopes, sinks, dropout_p, dropout_seed);
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
                    {},
                    {},
                    {}};
  t.sequences =
      packed_sequences("causal_attention.varlen_attention_backward", q, k, cu_seqlens_q,
                       cu_seqlens_k, max_seqlen_q.expect_int(), max_seqlen_k.expect_int());
  set_score_options(t, window, softcap, alibi_slopes, sinks, dropout_p, dropout_seed);
  allocate_sink_gradient(t, sinks);
  if ((dq.numel() > 0 || dk.numel() > 0 || dv.numel() > 0) && t.sequences.cu_q.numel() > 1) {
    run_kernel(t, AVX512::backward_kernel, AVX2::backward_kernel, DEFAULT::backward_kernel);
  }
  return {dq, dk, dv, sink_gradient(t.dsinks, q, sinks)};
}

// The dropout keep mask of scores (..., Hq, Lq, Lk), from the kernels' own hash (batch = the
// flat index of the leading dims).
at::Tensor dropout_keep_mask_cpu(const at::Tensor& dropout_seed, c10::SymIntArrayRef shape,
                                 double dropout_p) {
  constexpr const char* op = "causal_attention.dropout_keep_mask";
  detail::check_dropout_seed(op, dropout_p, dropout_seed);
  TORCH_CHECK_VALUE(shape.size() >= 2, op,
                    ": shape must be (..., Lq, Lk) with at least 2 dims, got shape=", shape);
  const std::vector<int64_t> sizes = C10_AS_INTARRAYREF_SLOW(shape).vec();
  at::Tensor mask = at::empty(sizes, dropout_seed.options().dtype(at::kBool));
  const int64_t len_k = sizes.back(), len_q = sizes[sizes.size() - 2];
  const int64_t heads = sizes.size() >= 3 ? sizes[sizes.size() - 3] : 1;
  const int64_t rows = mask.numel() / std::max<int64_t>(len_k, 1);
  const at::Tensor seed = dropout_seed.contiguous();
  const detail::DropoutHash hash(dropout_p, uint64_t(seed.data_ptr<int64_t>()[0]),
                                 uint64_t(seed.data_ptr<int64_t>()[1]));
  bool* out = mask.data_ptr<bool>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const int64_t bh = row / std::max<int64_t>(len_q, 1);
      const uint32_t row_key = hash.row_key(bh / heads, bh % heads, row % len_q);
      for (int64_t key = 0; key < len_k; ++key) {
        out[row * len_k + key] = hash.kept(row_key, key);
      }
    }
  });
  return mask;
}

}  // namespace
}  // namespace causal_attention::cpu

TORCH_LIBRARY_IMPL(causal_attention, CPU, m) {
  m.impl("attention_forward", causal_attention::cpu::attention_forward_cpu);
  m.impl("attention_backward", causal_attention::cpu::attention_backward_cpu);
  m.impl("varlen_attention_forward", causal_attention::cpu::varlen_attention_forward_cpu);
  m.impl("varlen_attention_backward", causal_attention::cpu::varlen_attention_backward_cpu);
  m.impl("dropout_keep_mask", causal_attention::cpu::dropout_keep_mask_cpu);
}
