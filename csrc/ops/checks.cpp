// The checks of each op's call (checks.h): a dense or a packed call's inputs, masks and score
// options, each in one place (check_dense_call, check_packed_call), and what each op adds to
// them. Built on tensor_checks.h and option_checks.h; paged_attention's are paged_checks.cpp.
#include "checks.h"

#include "option_checks.h"
#include "shapes.h"
#include "tensor_checks.h"

#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <vector>

namespace causal_attention::detail {
namespace {

// The leading (batch) dims of a dense q, and its query heads (1 for a 2-D call).
std::vector<c10::SymInt> dense_batch(const at::Tensor& q) {
  return std::vector<c10::SymInt>(q.sym_sizes().begin(),
                                  q.sym_sizes().end() - std::min<int64_t>(q.dim(), 3));
}
c10::SymInt dense_heads(const at::Tensor& q) {
  return q.dim() >= 3 ? q.sym_size(-3) : c10::SymInt(1);
}

// A dense call's inputs q (..., Hq, Lq, D), k, v, its key mask and attn_mask, and its score
// options (an AttentionCall or a ForwardCall).
template <typename Call>
void check_dense_call(const char* op, const Call& call) {
  const at::Tensor &q = call.q, &k = call.k, &v = call.v;
  check_dense_inputs(op, q, k, v);
  check_key_mask(op, q, k, call.key_mask);
  check_attn_mask(op, q, k, call.attn_mask);
  check_score_options(op, q, dense_batch(q), dense_heads(q), call.options);
}

// A packed call's inputs q (total_q, Hq, D), k, v with their sequences (no mask), and its score
// options, one ALiBi row per sequence (an AttentionCall or a ForwardCall).
template <typename Call>
void check_packed_call(const char* op, const Call& call) {
  const at::Tensor &q = call.q, &k = call.k, &v = call.v;
  check_packed_inputs(op, q, k, v, call.key_mask, call.packed);
  TORCH_CHECK_VALUE(!call.attn_mask.has_value(), op,
                    ": attn_mask is for dense calls; in packed sequences (cu_seqlens) each "
                    "sequence sees only its own keys, narrowed by the window");
  const std::vector<c10::SymInt> sequences{call.packed.cu_seqlens_q->sym_size(0) - 1};
  check_score_options(op, q, sequences, q.sym_size(1), call.options);
}

// The inputs, the masks and the score options of a dense or packed call.
template <typename Call>
void check_inputs_and_options(const char* op, const Call& call) {
  if (call.packed.any()) {
    check_packed_call(op, call);
  } else {
    check_dense_call(op, call);
  }
}

// A kernel op's query_offset: for dense calls only (a packed sequence's rows end where its keys
// do).
void check_query_offset(const char* op, const ForwardCall& call) {
  TORCH_CHECK_VALUE(!call.query_offset.has_value() || !call.packed.any(), op,
                    ": query_offset is for dense calls; packed sequences (cu_seqlens) are aligned "
                    "bottom-right each, got query_offset=",
                    *call.query_offset);
}

}  // namespace

double check_attention_call(const char* op, const AttentionCall& call) {
  check_inputs_and_options(op, call);
  return resolve_scale(op, call.q, call.scale);
}

ForwardCall resolve_attention_call(const AttentionCall& call) {
  ForwardCall forward{call.q, call.k, call.v};
  forward.scale = check_attention_call(
      call.packed.any() ? "causal_attention.varlen_attention" : "causal_attention.attention", call);
  forward.key_mask = call.key_mask;
  forward.attn_mask = call.attn_mask;
  forward.options = call.options;
  forward.options.dropout_seed = draw_dropout_seed(call.options.dropout_p, call.generator);
  forward.packed = call.packed;
  return forward;
}

void check_forward_call(const ForwardCall& call) {
  constexpr const char* op = "causal_attention.attention_forward";
  check_inputs_and_options(op, call);
  check_query_offset(op, call);
  check_scale(op, call.scale, call.q.scalar_type());
  check_given_dropout_seed(op, call.q, call.options);
}

void check_backward_call(const BackwardCall& call, const char* op) {
  const at::Tensor& q = call.q;
  check_dense_tensor(op, "grad_out", call.grad_out);
  check_inputs_and_options(op, call);
  check_given_dropout_seed(op, q, call.options);
  check_dense_tensor(op, "out", call.out);
  check_dense_tensor(op, "lse", call.lse);
  check_scale(op, call.scale, q.scalar_type());
  const bool packed = call.packed.any();
  const std::vector<c10::SymInt> expected_out =
      packed ? varlen_output_sym_sizes(q, call.v) : output_sym_sizes(q, call.v);
  const std::vector<c10::SymInt> expected_lse = packed ? varlen_lse_sym_sizes(q) : lse_sym_sizes(q);
  const char* out_layout = packed ? "(total_q, Hq, Dv)" : "(..., Hq, Lq, Dv)";
  TORCH_CHECK_VALUE(call.grad_out.sym_sizes() == c10::SymIntArrayRef(expected_out), op,
                    ": grad_out must have shape ", out_layout, "=",
                    c10::SymIntArrayRef(expected_out),
                    ", got grad_out.shape=", call.grad_out.sym_sizes());
  TORCH_CHECK_VALUE(call.out.sym_sizes() == c10::SymIntArrayRef(expected_out), op,
                    ": out must have shape ", out_layout, "=", c10::SymIntArrayRef(expected_out),
                    ", got out.shape=", call.out.sym_sizes());
  TORCH_CHECK_VALUE(call.lse.sym_sizes() == c10::SymIntArrayRef(expected_lse), op,
                    ": lse must have shape ", packed ? "(Hq, total_q)" : "(..., Hq, Lq)", "=",
                    c10::SymIntArrayRef(expected_lse), ", got lse.shape=", call.lse.sym_sizes());
  check_saved_forward(op, q, call.grad_out, call.out, call.lse);
  check_query_offset(op, call);
  if (call.delta.has_value()) {
    const at::Tensor& delta = *call.delta;
    check_dense_tensor(op, "delta", delta);
    TORCH_CHECK_TYPE(delta.scalar_type() == call.lse.scalar_type(), op,
                     ": delta must have lse's dtype ", call.lse.scalar_type(),
                     ", got delta.dtype=", delta.scalar_type());
    TORCH_CHECK_VALUE(delta.sym_sizes() == call.lse.sym_sizes() && delta.device() == q.device(), op,
                      ": delta must have lse's shape ", call.lse.sym_sizes(), " on ", q.device(),
                      ", got delta.shape=", delta.sym_sizes(), " on ", delta.device());
  }
  TORCH_CHECK_VALUE(
      !call.attn_mask_grad ||
          (call.attn_mask.has_value() && at::isFloatingType(call.attn_mask->scalar_type())),
      op,
      ": attn_mask_grad=True asks for the gradient of a floating attn_mask, got "
      "attn_mask=",
      call.attn_mask.has_value() ? c10::toString(call.attn_mask->scalar_type()) : "None");
}

void check_dropout_keep_mask_call(const at::Tensor& dropout_seed, c10::SymIntArrayRef shape,
                                  double dropout_p) {
  constexpr const char* op = "causal_attention.dropout_keep_mask";
  check_dropout_p(op, dropout_p);
  check_dropout_seed(op, dropout_seed, dropout_seed.is_meta());
  TORCH_CHECK_VALUE(shape.size() >= 2, op,
                    ": shape must be (..., Lq, Lk) with at least 2 dims, got shape=", shape);
}

std::optional<at::Tensor> draw_dropout_seed(double dropout_p,
                                            const std::optional<at::Generator>& generator) {
  if (dropout_p == 0) {
    return std::nullopt;
  }
  return at::empty({2}, at::TensorOptions().dtype(at::kLong)).random_(generator);
}

}  // namespace causal_attention::detail
