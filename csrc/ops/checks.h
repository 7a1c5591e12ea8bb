// Argument validation shared by every kernel of the ops (CPU, Meta, Autograd), so that a bad call
// fails the same way whichever dispatch key it reaches, with a typed error naming the op and the
// argument. Written against sym_sizes() so that the Meta kernels can run it under symbolic shapes
// (torch.compile, torch.export). What a valid call's outputs look like is shapes.h.
#pragma once

#include <ATen/core/Generator.h>
#include <ATen/core/Tensor.h>

#include <optional>

namespace causal_attention::detail {

// Checks q (..., Hq, Lq, D), k (..., Hkv, Lk, D), v (..., Hkv, Lk, Dv): defined, dense (neither
// nested nor sparse), ranks, dtypes, devices, leading dims, head dims, Hq % Hkv. Throws
// c10::ValueError / c10::TypeError / c10::NotImplementedError (nested, sparse) naming the
// argument. Every other tensor argument of the ops gets the same defined-and-dense check.
void check_attention_inputs(const char* op, const at::Tensor& q, const at::Tensor& k,
                            const at::Tensor& v);

// The scale `attention` uses: `scale` if given (checked finite in q's accumulation dtype, the
// dtype the kernels compute in), else default_scale(D) (checked D > 0).
double resolve_scale(const char* op, const at::Tensor& q, std::optional<double> scale);

// Checks key_mask, where given: bool, on q's device, shaped (*batch, Lk), with q's leading
// (batch) dims and k's number of keys.
void check_key_mask(const char* op, const at::Tensor& q, const at::Tensor& k,
                    const std::optional<at::Tensor>& key_mask);

// The score options (ops.h): window two entries >= -1; softcap finite and > 0; alibi_slopes
// float32 (Hq,) or (*batch, Hq) on q's device; sinks (Hq,) in q's dtype or float32 on q's device;
// dropout_p in [0, 1). `batch` is q's leading dims (the sequence count N for packed calls) and
// `heads_q` its query heads.
void check_score_options(const char* op, const at::Tensor& q, c10::SymIntArrayRef batch,
                         const c10::SymInt& heads_q, at::IntArrayRef window,
                         std::optional<double> softcap,
                         const std::optional<at::Tensor>& alibi_slopes,
                         const std::optional<at::Tensor>& sinks, double dropout_p);

// The kernel ops' dropout seed: int64 (2,) (seed, offset) on the CPU, required when
// dropout_p > 0.
void check_dropout_seed(const char* op, double dropout_p,
                        const std::optional<at::Tensor>& dropout_seed);

// The seed the differentiable ops hand their kernel op: drawn from `generator` (the default CPU
// generator when none) as at::empty({2}, at::kLong).random_(generator) when dropout_p > 0, else
// none.
std::optional<at::Tensor> draw_dropout_seed(double dropout_p,
                                            const std::optional<at::Generator>& generator);

// Everything `attention_forward` checks, reported under its own name: the inputs, the key mask,
// a scale finite in q's accumulation dtype, the score options and the dropout seed.
void check_forward_call(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale,
                        const std::optional<at::Tensor>& key_mask, at::IntArrayRef window,
                        std::optional<double> softcap,
                        const std::optional<at::Tensor>& alibi_slopes,
                        const std::optional<at::Tensor>& sinks, double dropout_p,
                        const std::optional<at::Tensor>& dropout_seed);

// Everything `attention` checks (`op` names it: attention or attention_weights); returns the
// resolved scale.
double check_attention_call(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            std::optional<double> scale, const std::optional<at::Tensor>& key_mask,
                            at::IntArrayRef window, std::optional<double> softcap,
                            const std::optional<at::Tensor>& alibi_slopes,
                            const std::optional<at::Tensor>& sinks, double dropout_p,
                            const char* op = "causal_attention.attention");

// Checks the inputs of attention_backward: those of the forward plus grad_out and out shaped
// (..., Hq, Lq, Dv) in q's dtype, and lse (..., Hq, Lq) in the accumulation dtype.
void check_backward_inputs(const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k,
                           const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse,
                           double scale, const std::optional<at::Tensor>& key_mask,
                           at::IntArrayRef window, std::optional<double> softcap,
                           const std::optional<at::Tensor>& alibi_slopes,
                           const std::optional<at::Tensor>& sinks, double dropout_p,
                           const std::optional<at::Tensor>& dropout_seed);

// Everything `varlen_attention_forward` checks on shapes, and its scale. Packed sequences: q
// (total_q, Hq, D), k (total_k, Hkv, D), v (total_k, Hkv, Dv), cu_seqlens_q and cu_seqlens_k int32
// 1-D of one length N + 1 on q's device, max_seqlen_q and max_seqlen_k non-negative. Shapes only,
// so that the Meta kernels run it; the values of cu_seqlens are check_cumulative_lengths'.
void check_varlen_forward_call(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                               const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k,
                               const c10::SymInt& max_seqlen_q, const c10::SymInt& max_seqlen_k,
                               double scale, at::IntArrayRef window, std::optional<double> softcap,
                               const std::optional<at::Tensor>& alibi_slopes,
                               const std::optional<at::Tensor>& sinks, double dropout_p,
                               const std::optional<at::Tensor>& dropout_seed);

// Everything `varlen_attention` checks on shapes; returns the resolved scale.
double check_varlen_attention_call(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                   const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k,
                                   const c10::SymInt& max_seqlen_q, const c10::SymInt& max_seqlen_k,
                                   std::optional<double> scale, at::IntArrayRef window,
                                   std::optional<double> softcap,
                                   const std::optional<at::Tensor>& alibi_slopes,
                                   const std::optional<at::Tensor>& sinks, double dropout_p);

// Those of the forward, plus grad_out and out (total_q, Hq, Dv) in q's dtype and lse
// (Hq, total_q) in the accumulation dtype.
void check_varlen_backward_inputs(const at::Tensor& grad_out, const at::Tensor& q,
                                  const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
                                  const at::Tensor& lse, const at::Tensor& cu_seqlens_q,
                                  const at::Tensor& cu_seqlens_k, const c10::SymInt& max_seqlen_q,
                                  const c10::SymInt& max_seqlen_k, double scale,
                                  at::IntArrayRef window, std::optional<double> softcap,
                                  const std::optional<at::Tensor>& alibi_slopes,
                                  const std::optional<at::Tensor>& sinks, double dropout_p,
                                  const std::optional<at::Tensor>& dropout_seed);

// The values of one cumulative-lengths tensor (contiguous int32 on the CPU): starts at 0, never
// decreases, ends at `total` rows, no length above `max_seqlen`. Returns the longest length.
int64_t check_cumulative_lengths(const char* op, const char* name, const at::Tensor& cu_seqlens,
                                 int64_t total, const char* max_name, int64_t max_seqlen);

}  // namespace causal_attention::detail
