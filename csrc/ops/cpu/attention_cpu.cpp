// The CPU dispatch key of the dense and packed calls: validates, views the inputs as (batch,
// heads, rows, dim), allocates the outputs and hands them to the kernels' stubs
// (kernels/kernel_api.h), which run the build for this CPU's instruction set. attention and
// varlen_attention reach these through their one kernel (ops/attention.cpp); paged_attention has
// its own entry (paged_attention_cpu.cpp).
#include "../checks.h"
#include "../schema_adapters.h"
#include "../shapes.h"
#include "../tensor_checks.h"
#include "attn_mask.h"
#include "kernel_call.h"
#include "kernels/kernel_api.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <cstdint>
#include <utility>
#include <vector>

namespace causal_attention::cpu {
namespace {

// A call's inputs in the kernels' layout (kernel_api.h): dense (..., H, L, D) ones as
// (batch, H, L, D), packed (total, H, D) ones as (1, H, total, D), with their sequences.
class KernelLayout {
 public:
  explicit KernelLayout(const detail::ForwardCall& call) : packed_(call.packed.any()) {}

  // Views whenever the layout allows, so that outputs allocated contiguous are written in place.
  at::Tensor rows(const at::Tensor& t) const {
    return as_batch_heads_rows(packed_ ? t.transpose(0, 1).unsqueeze(0) : t);
  }
  // lse: (..., Hq, Lq) as (batch, Hq, Lq), or packed (Hq, total_q) as (1, Hq, total_q); a view
  // of a contiguous one.
  at::Tensor lse_rows(const at::Tensor& lse, const at::Tensor& q_rows) const {
    return packed_ ? lse.contiguous().unsqueeze(0)
                   : lse.reshape({q_rows.size(0), q_rows.size(1), q_rows.size(2)}).contiguous();
  }
  std::vector<c10::SymInt> out_sizes(const at::Tensor& q, const at::Tensor& v) const {
    return packed_ ? detail::varlen_output_sym_sizes(q, v) : detail::output_sym_sizes(q, v);
  }
  std::vector<c10::SymInt> lse_sizes(const at::Tensor& q) const {
    return packed_ ? detail::varlen_lse_sym_sizes(q) : detail::lse_sym_sizes(q);
  }
  bool packed() const { return packed_; }

 private:
  bool packed_;
};

PackedSequences packed_sequences(const char* op, const detail::ForwardCall& call) {
  const detail::PackedLengths& lengths = call.packed;
  PackedSequences sequences{lengths.cu_seqlens_q->contiguous(), lengths.cu_seqlens_k->contiguous()};
  sequences.max_len_q =
      detail::check_cumulative_lengths(op, "cu_seqlens_q", sequences.cu_q, call.q.size(0),
                                       "max_seqlen_q", lengths.max_seqlen_q->expect_int());
  sequences.max_len_k =
      detail::check_cumulative_lengths(op, "cu_seqlens_k", sequences.cu_k, call.k.size(0),
                                       "max_seqlen_k", lengths.max_seqlen_k->expect_int());
  return sequences;
}

// The key mask as the kernels read it: contiguous bool (batch, Lk), and the running count of the
// keys it keeps, (batch, Lk + 1) from 0, which says in O(1) whether a key block is hidden
// entirely (skipped), partly (masked entries) or not at all.
void set_key_mask(ForwardTensors& t, const std::optional<at::Tensor>& key_mask) {
  // A mask that hides nothing is no mask: the call then runs exactly as without one.
  if (!key_mask.has_value() || key_mask->numel() == 0 || key_mask->all().item<bool>()) {
    return;
  }
  const int64_t len_k = t.k.size(2);
  t.key_mask = key_mask->reshape({t.q.size(0), len_k}).contiguous();
  t.kept_keys_before = at::zeros({t.q.size(0), len_k + 1}, t.key_mask.options().dtype(at::kInt));
  t.kept_keys_before.narrow(1, 1, len_k).copy_(t.key_mask.cumsum(1, at::kInt));
}

// The inputs of a call, its key mask, sequences and options, as the kernels take them.
ForwardTensors kernel_inputs(const char* op, const detail::ForwardCall& call,
                             const KernelLayout& layout) {
  ForwardTensors t =
      ForwardTensors::of(layout.rows(call.q), layout.rows(call.k), layout.rows(call.v));
  t.scale = call.scale;
  if (layout.packed()) {
    t.sequences = packed_sequences(op, call);
  } else {
    set_key_mask(t, call.key_mask);
    if (call.attn_mask.has_value()) {
      t.attn_mask = kernel_attn_mask(*call.attn_mask, call.q, t);
    }
  }
  t.options = kernel_options(t, call.options);
  if (call.query_offset.has_value()) {
    t.query_offset = call.query_offset->guard_int(__FILE__, __LINE__);
  }
  return t;
}

// Whether a packed call has no sequence, and so nothing to compute.
bool no_sequences(const ForwardTensors& t) {
  return t.sequences.packed() && t.sequences.cu_q.numel() <= 1;
}

std::tuple<at::Tensor, at::Tensor> attention_forward_cpu(const detail::ForwardCall& call) {
  detail::check_forward_call(call);
  const KernelLayout layout(call);
  ForwardTensors t = kernel_inputs("causal_attention.attention_forward", call, layout);
  at::Tensor out = at::empty_symint(layout.out_sizes(call.q, call.v), call.q.options());
  at::Tensor lse = at::empty_symint(layout.lse_sizes(call.q), detail::lse_options(call.q));
  t.out = layout.rows(out);
  t.lse = layout.lse_rows(lse, t.q);  // a view: lse is allocated contiguous
  if (lse.numel() > 0 && !no_sequences(t)) {
    run_kernel(forward_kernel, std::move(t));
  }
  return {out, lse};
}

// attention_gradients, and attention_backward (its results but the mask's), checked under `op`.
detail::Gradients gradients_cpu(const char* op, const detail::BackwardCall& call) {
  detail::check_backward_call(call, op);
  const KernelLayout layout(call);
  BackwardTensors t(kernel_inputs(op, call, layout));
  t.grad_out = layout.rows(call.grad_out);
  t.out = layout.rows(call.out);
  t.lse = layout.lse_rows(call.lse, t.q);
  if (call.delta.has_value()) {
    t.delta = layout.lse_rows(*call.delta, t.q);
  }
  // The sinks' gradient is accumulated in the accumulation dtype and returned in the sinks'
  // dtype; (0,) without sinks.
  const std::optional<at::Tensor>& sinks = call.options.sinks;
  if (sinks.has_value()) {
    t.dsinks = at::zeros({sinks->size(0)},
                         sinks->options().dtype(detail::accumulation_dtype(t.q.scalar_type())));
  }
  const at::TensorOptions gradients = detail::gradient_options(call.q, call.delta.has_value());
  at::Tensor dq = at::empty(call.q.sizes(), gradients);
  at::Tensor dk = at::empty(call.k.sizes(), gradients);
  at::Tensor dv = at::empty(call.v.sizes(), gradients);
  t.dq = layout.rows(dq);
  t.dk = layout.rows(dk);
  t.dv = layout.rows(dv);
  if (call.attn_mask_grad) {
    t.dattn_mask = at::zeros({t.q.size(0), t.q.size(1), t.q.size(2), t.k.size(2)},
                             detail::lse_options(call.q));
  }
  if ((dq.numel() > 0 || dk.numel() > 0 || dv.numel() > 0) && !no_sequences(t)) {
    run_kernel(backward_kernel, t);
  }
  return {dq, dk, dv,
          sinks.has_value() ? t.dsinks.to(sinks->scalar_type()) : at::empty({0}, call.q.options()),
          call.attn_mask_grad ? attn_mask_gradient(t.dattn_mask, call.q, call.k, *call.attn_mask)
                              : at::empty({0}, call.q.options())};
}

detail::Gradients attention_gradients_cpu(const detail::BackwardCall& call) {
  return gradients_cpu("causal_attention.attention_gradients", call);
}
detail::Gradients attention_backward_cpu(const detail::BackwardCall& call) {
  return gradients_cpu("causal_attention.attention_backward", call);
}

// The dropout keep mask of scores (..., Hq, Lq, Lk), from the kernels' own hash (batch = the
// flat index of the leading dims).
at::Tensor dropout_keep_mask_cpu(const at::Tensor& dropout_seed, c10::SymIntArrayRef shape,
                                 double dropout_p) {
  detail::check_dropout_keep_mask_call(dropout_seed, shape, dropout_p);
  const std::vector<int64_t> sizes = C10_AS_INTARRAYREF_SLOW(shape).vec();
  KeepMaskTensors t;
  t.mask = at::empty(sizes, dropout_seed.options().dtype(at::kBool));
  t.len_q = sizes[sizes.size() - 2];
  t.heads = sizes.size() >= 3 ? sizes[sizes.size() - 3] : 1;
  t.dropout_p = dropout_p;
  const at::Tensor seed = dropout_seed.contiguous();
  t.dropout_seed = uint64_t(seed.data_ptr<int64_t>()[0]);
  t.dropout_offset = uint64_t(seed.data_ptr<int64_t>()[1]);
  dropout_keep_mask_kernel(t);
  return t.mask;
}

}  // namespace
}  // namespace causal_attention::cpu

TORCH_LIBRARY_IMPL(causal_attention, CPU, m) {
  using namespace causal_attention;
  m.impl("attention_forward", detail::forward_from_schema<cpu::attention_forward_cpu>);
  m.impl("attention_gradients", detail::gradients_from_schema<cpu::attention_gradients_cpu>);
  m.impl("attention_backward", detail::backward_from_schema<cpu::attention_backward_cpu>);
  m.impl("dropout_keep_mask", causal_attention::cpu::dropout_keep_mask_cpu);
}
