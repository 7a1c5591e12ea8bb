#include "checks.h"

#include <c10/util/Exception.h>

#include <cmath>

namespace causal_attention::detail {
namespace {

bool is_supported_dtype(at::ScalarType dtype) {
  return dtype == at::kDouble || dtype == at::kFloat || dtype == at::kBFloat16 ||
         dtype == at::kHalf;
}

// An undefined tensor (None from Python, at::Tensor() from C++) has no shape, dtype or device to
// report: without this check it fails deep inside autograd with "tensor does not have a device".
void check_defined(const char* op, const char* name, const at::Tensor& t) {
  TORCH_CHECK_TYPE(t.defined(), op, ": ", name,
                   " must be a tensor, got None (an undefined tensor)");
}

void check_rank(const char* op, const char* name, const at::Tensor& t) {
  TORCH_CHECK_VALUE(t.dim() >= 2, op, ": ", name,
                    " must have at least 2 dimensions (..., L, D), got ", name,
                    ".shape=", t.sym_sizes());
}

void check_dtype(const char* op, const char* name, const at::Tensor& t) {
  TORCH_CHECK_TYPE(is_supported_dtype(t.scalar_type()), op, ": ", name,
                   " must be float64, float32, bfloat16 or float16, got ", name,
                   ".dtype=", t.scalar_type());
}

}  // namespace

void check_attention_inputs(const char* op, const at::Tensor& q, const at::Tensor& k,
                            const at::Tensor& v) {
  check_defined(op, "q", q);
  check_defined(op, "k", k);
  check_defined(op, "v", v);
  check_rank(op, "q", q);
  check_rank(op, "k", k);
  check_rank(op, "v", v);
  check_dtype(op, "q", q);
  check_dtype(op, "k", k);
  check_dtype(op, "v", v);
  TORCH_CHECK_TYPE(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(), op,
                   ": q, k and v must have the same dtype, got q.dtype=", q.scalar_type(),
                   ", k.dtype=", k.scalar_type(), ", v.dtype=", v.scalar_type());
  TORCH_CHECK_VALUE(k.device() == q.device() && v.device() == q.device(), op,
                    ": q, k and v must be on the same device, got q.device=", q.device(),
                    ", k.device=", k.device(), ", v.device=", v.device());
  TORCH_CHECK_VALUE(k.dim() == q.dim() && v.dim() == q.dim(), op,
                    ": q, k and v must have the same number of dimensions, got q.shape=",
                    q.sym_sizes(), ", k.shape=", k.sym_sizes(), ", v.shape=", v.sym_sizes());
  const int64_t rank = q.dim();
  for (int64_t d = 0; d + 3 < rank; ++d) {
    TORCH_CHECK_VALUE(q.sym_size(d) == k.sym_size(d) && q.sym_size(d) == v.sym_size(d), op,
                      ": q, k and v must have equal leading (batch) dimensions, got q.shape=",
                      q.sym_sizes(), ", k.shape=", k.sym_sizes(), ", v.shape=", v.sym_sizes());
  }
  TORCH_CHECK_VALUE(q.sym_size(-1) == k.sym_size(-1), op,
                    ": q and k must have the same head dimension D (last dim), got q.shape=",
                    q.sym_sizes(), ", k.shape=", k.sym_sizes());
  TORCH_CHECK_VALUE(
      q.sym_size(-1) != 0, op,
      ": the head dimension D (last dim of q and k) must be positive, got q.shape=", q.sym_sizes());
  TORCH_CHECK_VALUE(k.sym_size(-2) == v.sym_size(-2), op,
                    ": k and v must have the same number of keys Lk (dim -2), got k.shape=",
                    k.sym_sizes(), ", v.shape=", v.sym_sizes());
  if (rank >= 3) {
    const c10::SymInt heads_q = q.sym_size(-3);
    const c10::SymInt heads_kv = k.sym_size(-3);
    TORCH_CHECK_VALUE(v.sym_size(-3) == heads_kv, op,
                      ": k and v must have the same number of heads (dim -3), got k.shape=",
                      k.sym_sizes(), ", v.shape=", v.sym_sizes());
    const bool divisible = heads_kv == 0 ? heads_q == 0 : heads_q % heads_kv == 0;
    TORCH_CHECK_VALUE(divisible, op,
                      ": the query heads Hq (q dim -3) must be a multiple of the key/value heads "
                      "Hkv (k dim -3), got q.shape=",
                      q.sym_sizes(), ", k.shape=", k.sym_sizes());
  }
}

void check_scale(const char* op, double scale) {
  TORCH_CHECK_VALUE(std::isfinite(scale), op, ": scale must be finite, got scale=", scale);
}

double resolve_scale(const char* op, const at::Tensor& q, std::optional<double> scale) {
  if (scale.has_value()) {
    check_scale(op, *scale);
    return *scale;
  }
  check_rank(op, "q", q);
  const int64_t head_dim = q.sym_size(-1).guard_int(__FILE__, __LINE__);
  TORCH_CHECK_VALUE(
      head_dim > 0, op,
      ": the head dimension D (last dim of q) must be positive, got q.shape=", q.sym_sizes());
  return 1.0 / std::sqrt(static_cast<double>(head_dim));
}

void check_forward_call(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                        double scale) {
  constexpr const char* op = "causal_attention.attention_forward";
  check_attention_inputs(op, q, k, v);
  check_scale(op, scale);
}

double check_attention_call(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            std::optional<double> scale) {
  constexpr const char* op = "causal_attention.attention";
  check_attention_inputs(op, q, k, v);
  return resolve_scale(op, q, scale);
}

at::ScalarType accumulation_dtype(at::ScalarType input_dtype) {
  return input_dtype == at::kDouble ? at::kDouble : at::kFloat;
}

std::vector<c10::SymInt> output_sym_sizes(const at::Tensor& q, const at::Tensor& v) {
  std::vector<c10::SymInt> sizes(q.sym_sizes().begin(), q.sym_sizes().end());
  sizes.back() = v.sym_size(-1);
  return sizes;
}

std::vector<c10::SymInt> lse_sym_sizes(const at::Tensor& q) {
  return std::vector<c10::SymInt>(q.sym_sizes().begin(), q.sym_sizes().end() - 1);
}

void check_backward_inputs(const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k,
                           const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse,
                           double scale) {
  constexpr const char* op = "causal_attention.attention_backward";
  check_defined(op, "grad_out", grad_out);
  check_attention_inputs(op, q, k, v);
  check_defined(op, "out", out);
  check_defined(op, "lse", lse);
  check_scale(op, scale);
  const std::vector<c10::SymInt> expected_out = output_sym_sizes(q, v);
  const std::vector<c10::SymInt> expected_lse = lse_sym_sizes(q);
  TORCH_CHECK_VALUE(
      grad_out.sym_sizes() == c10::SymIntArrayRef(expected_out), op,
      ": grad_out must have shape (..., Hq, Lq, Dv)=", c10::SymIntArrayRef(expected_out),
      ", got grad_out.shape=", grad_out.sym_sizes());
  TORCH_CHECK_VALUE(out.sym_sizes() == c10::SymIntArrayRef(expected_out), op,
                    ": out must have shape (..., Hq, Lq, Dv)=", c10::SymIntArrayRef(expected_out),
                    ", got out.shape=", out.sym_sizes());
  TORCH_CHECK_VALUE(lse.sym_sizes() == c10::SymIntArrayRef(expected_lse), op,
                    ": lse must have shape (..., Hq, Lq)=", c10::SymIntArrayRef(expected_lse),
                    ", got lse.shape=", lse.sym_sizes());
  TORCH_CHECK_TYPE(
      grad_out.scalar_type() == q.scalar_type() && out.scalar_type() == q.scalar_type(), op,
      ": grad_out and out must have q's dtype ", q.scalar_type(),
      ", got grad_out.dtype=", grad_out.scalar_type(), ", out.dtype=", out.scalar_type());
  TORCH_CHECK_TYPE(lse.scalar_type() == accumulation_dtype(q.scalar_type()), op,
                   ": lse must have dtype ", accumulation_dtype(q.scalar_type()),
                   " for q.dtype=", q.scalar_type(), ", got lse.dtype=", lse.scalar_type());
  TORCH_CHECK_VALUE(
      grad_out.device() == q.device() && out.device() == q.device() && lse.device() == q.device(),
      op, ": grad_out, out and lse must be on q's device ", q.device());
}

}  // namespace causal_attention::detail
