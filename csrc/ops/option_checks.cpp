#include "option_checks.h"

#include "shapes.h"
#include "tensor_checks.h"

#include <c10/util/Exception.h>

#include <cmath>
#include <vector>

namespace causal_attention::detail {
namespace {

// Whether `value` stays finite once converted to the accumulation dtype of q's dtype `q_dtype`
// (float32 for float32, bfloat16 and float16; float64 for float64), the dtype the kernels compute
// in: they convert scale and softcap with static_cast<acc_t>, so 1e39, a finite double, would be
// inf in float32 and every row NaN.
bool finite_in_accumulation(double value, at::ScalarType q_dtype) {
  return accumulation_dtype(q_dtype) == at::kDouble ? std::isfinite(value)
                                                    : std::isfinite(static_cast<float>(value));
}

const char* accumulation_name(at::ScalarType q_dtype) {
  return accumulation_dtype(q_dtype) == at::kDouble ? "float64" : "float32";
}

}  // namespace

void check_scale(const char* op, double scale, at::ScalarType q_dtype) {
  TORCH_CHECK_VALUE(finite_in_accumulation(scale, q_dtype), op, ": scale must be finite in ",
                    accumulation_name(q_dtype), ", the accumulation dtype of q.dtype=", q_dtype,
                    ", got scale=", scale);
}

double resolve_scale(const char* op, const at::Tensor& q, std::optional<double> scale) {
  if (scale.has_value()) {
    check_scale(op, *scale, q.scalar_type());
    return *scale;
  }
  check_rank(op, "q", q);
  const int64_t head_dim = q.sym_size(-1).guard_int(__FILE__, __LINE__);
  TORCH_CHECK_VALUE(
      head_dim > 0, op,
      ": the head dimension D (last dim of q) must be positive, got q.shape=", q.sym_sizes());
  return default_scale(head_dim);
}

void check_dropout_p(const char* op, double dropout_p) {
  TORCH_CHECK_VALUE(dropout_p >= 0 && dropout_p < 1, op,
                    ": dropout_p must be in [0, 1), got dropout_p=", dropout_p);
}

void check_score_options(const char* op, const at::Tensor& q, c10::SymIntArrayRef batch,
                         const c10::SymInt& heads_q, const ScoreOptions& options) {
  const c10::IntArrayRef window = options.window;
  TORCH_CHECK_VALUE(window.size() == 2, op,
                    ": window must be two ints (left, right), got window=", window);
  TORCH_CHECK_VALUE(
      window[0] >= -1 && window[1] >= -1, op,
      ": window entries must be >= -1 (-1: unbounded on that side), got window=", window);
  if (options.softcap.has_value()) {
    // Converted like the scale: 1e39 is inf in float32, and 1e-46 is 0, which would turn the
    // cap off without a word.
    const double softcap = *options.softcap;
    const bool positive = accumulation_dtype(q.scalar_type()) == at::kDouble
                              ? softcap > 0
                              : static_cast<float>(softcap) > 0;
    TORCH_CHECK_VALUE(finite_in_accumulation(softcap, q.scalar_type()) && positive, op,
                      ": softcap must be finite and > 0 in ", accumulation_name(q.scalar_type()),
                      ", the accumulation dtype of q.dtype=", q.scalar_type(),
                      " (None: off), got softcap=", softcap);
  }
  if (options.alibi_slopes.has_value()) {
    const at::Tensor& slopes = *options.alibi_slopes;
    check_dense_tensor(op, "alibi_slopes", slopes);
    TORCH_CHECK_TYPE(
        slopes.scalar_type() == at::kFloat, op,
        ": alibi_slopes must be float32, got alibi_slopes.dtype=", slopes.scalar_type());
    TORCH_CHECK_VALUE(slopes.device() == q.device(), op, ": alibi_slopes must be on q's device ",
                      q.device(), ", got alibi_slopes.device=", slopes.device());
    std::vector<c10::SymInt> batched(batch.begin(), batch.end());
    batched.push_back(heads_q);
    const bool per_head = slopes.dim() == 1 && slopes.sym_size(0) == heads_q;
    TORCH_CHECK_VALUE(per_head || slopes.sym_sizes() == c10::SymIntArrayRef(batched), op,
                      ": alibi_slopes must have shape (Hq,)=(", heads_q,
                      ",) or (*batch, Hq)=", c10::SymIntArrayRef(batched),
                      ", got alibi_slopes.shape=", slopes.sym_sizes());
  }
  if (options.sinks.has_value()) {
    const at::Tensor& sinks = *options.sinks;
    check_dense_tensor(op, "sinks", sinks);
    TORCH_CHECK_TYPE(sinks.scalar_type() == q.scalar_type() || sinks.scalar_type() == at::kFloat,
                     op, ": sinks must have q's dtype ", q.scalar_type(),
                     " or float32, got sinks.dtype=", sinks.scalar_type());
    TORCH_CHECK_VALUE(sinks.device() == q.device(), op, ": sinks must be on q's device ",
                      q.device(), ", got sinks.device=", sinks.device());
    TORCH_CHECK_VALUE(sinks.dim() == 1 && sinks.sym_size(0) == heads_q, op,
                      ": sinks must have shape (Hq,)=(", heads_q,
                      ",), one logit per query head, got sinks.shape=", sinks.sym_sizes());
  }
  check_dropout_p(op, options.dropout_p);
}

void check_dropout_seed(const char* op, const at::Tensor& seed, bool meta_call) {
  check_dense_tensor(op, "dropout_seed", seed);
  TORCH_CHECK_TYPE(
      seed.scalar_type() == at::kLong, op,
      ": dropout_seed must be int64 (seed, offset), got dropout_seed.dtype=", seed.scalar_type());
  TORCH_CHECK_VALUE(seed.dim() == 1 && seed.sym_size(0) == 2 && (seed.is_cpu() || meta_call), op,
                    ": dropout_seed must be a CPU tensor of shape (2,) (seed, offset), got "
                    "dropout_seed.shape=",
                    seed.sym_sizes(), " on ", seed.device());
}

void check_given_dropout_seed(const char* op, const at::Tensor& q, const ScoreOptions& options) {
  if (options.dropout_p == 0) {
    return;
  }
  TORCH_CHECK_VALUE(options.dropout_seed.has_value(), op,
                    ": dropout_p > 0 needs dropout_seed, an int64 (2,) tensor (seed, offset), "
                    "got dropout_p=",
                    options.dropout_p, " and dropout_seed=None");
  check_dropout_seed(op, *options.dropout_seed, q.is_meta());
}

}  // namespace causal_attention::detail
