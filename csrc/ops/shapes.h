// The shape and dtype policy of the ops: what each output looks like, the default scale and how
// a key mask lines up with the scores. checks.h validates arguments against it; the kernels of
// every dispatch key allocate by it. Written with SymInts so that the Meta kernels follow it under
// symbolic shapes (torch.compile, torch.export).
#pragma once

#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace causal_attention::detail {

// The dtype of lse and of every accumulator: float64 for float64 inputs, float32 otherwise.
inline at::ScalarType accumulation_dtype(at::ScalarType input_dtype) {
  return input_dtype == at::kDouble ? at::kDouble : at::kFloat;
}

// The options of an lse for q: q's device, the accumulation dtype.
inline at::TensorOptions lse_options(const at::Tensor& q) {
  return q.options().dtype(accumulation_dtype(q.scalar_type()));
}

// The options of dq, dk and dv: q's; with delta the call is a step of a larger one, whose
// caller sums its gradients, so they come in the accumulation dtype, unrounded.
inline at::TensorOptions gradient_options(const at::Tensor& q, bool with_delta) {
  return with_delta ? lse_options(q) : q.options();
}

// The scale when none is given, for head dimension D: 1/sqrt(D), as SDPA's.
inline double default_scale(int64_t head_dim) {
  return 1.0 / std::sqrt(static_cast<double>(head_dim));
}

// Dense calls: out (..., Hq, Lq, Dv) and lse (..., Hq, Lq).
inline std::vector<c10::SymInt> output_sym_sizes(const at::Tensor& q, const at::Tensor& v) {
  std::vector<c10::SymInt> sizes(q.sym_sizes().begin(), q.sym_sizes().end());
  sizes.back() = v.sym_size(-1);
  return sizes;
}

inline std::vector<c10::SymInt> lse_sym_sizes(const at::Tensor& q) {
  return std::vector<c10::SymInt>(q.sym_sizes().begin(), q.sym_sizes().end() - 1);
}

// Packed sequences: out (total_q, Hq, Dv) and lse (Hq, total_q), heads first as the kernels
// write it.
inline std::vector<c10::SymInt> varlen_output_sym_sizes(const at::Tensor& q, const at::Tensor& v) {
  return {q.sym_size(0), q.sym_size(1), v.sym_size(2)};
}

inline std::vector<c10::SymInt> varlen_lse_sym_sizes(const at::Tensor& q) {
  return {q.sym_size(1), q.sym_size(0)};
}

// The scores (..., Hq, Lq, Lk) of a dense call, which an attn_mask broadcasts against.
inline std::vector<c10::SymInt> scores_sym_sizes(const at::Tensor& q, const at::Tensor& k) {
  std::vector<c10::SymInt> sizes(q.sym_sizes().begin(), q.sym_sizes().end());
  sizes.back() = k.sym_size(-2);
  return sizes;
}

// A key mask is (*batch, Lk): q's leading (batch) dims, those before (Hq, Lq, D), and k's keys.
inline std::vector<c10::SymInt> key_mask_sym_sizes(const at::Tensor& q, const at::Tensor& k) {
  std::vector<c10::SymInt> sizes(q.sym_sizes().begin(),
                                 q.sym_sizes().end() - std::min<int64_t>(q.dim(), 3));
  sizes.push_back(k.sym_size(-2));
  return sizes;
}

// The key mask broadcast against scores (..., Hq, Lq, Lk): (*batch, 1, 1, Lk), the same keys
// hidden from every head and query row. Without batch dims it is (Lk,), which broadcasts as is.
inline at::Tensor key_mask_over_scores(const at::Tensor& q, const at::Tensor& key_mask) {
  return q.dim() >= 4 ? key_mask.unsqueeze(-2).unsqueeze(-2) : key_mask;
}

}  // namespace causal_attention::detail
