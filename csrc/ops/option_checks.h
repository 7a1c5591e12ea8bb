// The checks of the arguments besides the tensors a call attends over: the scale, the score
// options (window, softcap, ALiBi slopes, sinks, dropout_p) and dropout's seed. Each throws
// c10::ValueError or c10::TypeError naming `op` and the argument; above tensor_checks.h, below the
// checks of the calls (checks.h, paged_checks.h). Written against sym_sizes(), so that the Meta
// kernels run them under symbolic shapes.
#pragma once

#include "op_arguments.h"

#include <ATen/core/Tensor.h>

#include <optional>

namespace causal_attention::detail {

// A given scale: finite in the accumulation dtype of q's dtype `q_dtype`.
void check_scale(const char* op, double scale, at::ScalarType q_dtype);

// The scale a call runs at: `scale` checked where given, else 1/sqrt(D) of q (which must then
// have a positive head dimension D).
double resolve_scale(const char* op, const at::Tensor& q, std::optional<double> scale);

void check_dropout_p(const char* op, double dropout_p);

// The score options (ops.h). `batch` is q's leading dims (the sequence count N for packed calls)
// and `heads_q` its query heads.
void check_score_options(const char* op, const at::Tensor& q, c10::SymIntArrayRef batch,
                         const c10::SymInt& heads_q, const ScoreOptions& options);

// The kernel ops' (seed, offset), read on the host: a CPU tensor, or a Meta one in a Meta call
// (tracing, where no kernel reads it). A Meta seed in a CPU call would be read as undefined
// memory.
void check_dropout_seed(const char* op, const at::Tensor& seed, bool meta_call);

// A kernel op's seed, needed where dropout_p > 0: given, and as check_dropout_seed says.
void check_given_dropout_seed(const char* op, const at::Tensor& q, const ScoreOptions& options);

}  // namespace causal_attention::detail
