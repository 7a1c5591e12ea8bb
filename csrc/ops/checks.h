// Argument validation shared by every kernel of the three ops (CPU, Meta, Autograd), so that a
// bad call fails the same way whichever dispatch key it reaches. Written against sym_sizes() so
// that the Meta kernels can run it under symbolic shapes (torch.compile, torch.export).
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>

namespace causal_attention::detail {

// Checks q (..., Hq, Lq, D), k (..., Hkv, Lk, D), v (..., Hkv, Lk, Dv): defined, ranks, dtypes,
// devices, leading dims, head dims, Hq % Hkv. Throws c10::ValueError / c10::TypeError naming the
// argument.
void check_attention_inputs(const char* op, const at::Tensor& q, const at::Tensor& k,
                            const at::Tensor& v);

// Throws c10::ValueError unless `scale` is finite.
void check_scale(const char* op, double scale);

// The scale `attention` uses: `scale` if given (checked finite), else 1/sqrt(D).
double resolve_scale(const char* op, const at::Tensor& q, std::optional<double> scale);

// Everything `attention_forward` checks, reported under its own name.
void check_forward_call(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                        double scale);

// Everything `attention` checks, reported under its own name; returns the resolved scale.
double check_attention_call(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            std::optional<double> scale);

// Checks the inputs of attention_backward: those of the forward plus grad_out and out shaped
// (..., Hq, Lq, Dv) in q's dtype, and lse (..., Hq, Lq) in the accumulation dtype.
void check_backward_inputs(const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k,
                           const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse,
                           double scale);

// The dtype of lse and of every accumulator: float64 for float64 inputs, float32 otherwise.
at::ScalarType accumulation_dtype(at::ScalarType input_dtype);

// Output shape (..., Hq, Lq, Dv) and lse shape (..., Hq, Lq), symbolic-shape friendly.
std::vector<c10::SymInt> output_sym_sizes(const at::Tensor& q, const at::Tensor& v);
std::vector<c10::SymInt> lse_sym_sizes(const at::Tensor& q);

}  // namespace causal_attention::detail
