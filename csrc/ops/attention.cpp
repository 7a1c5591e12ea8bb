// The op schemas, defined once; the public C++ API; and the one kernel of each op that is another
// op with its arguments resolved (attention, varlen_attention). The API calls through cached
// dispatcher handles rather than the kernels, so C++ callers get autograd, autocast, Meta and
// device dispatch exactly as Python callers do.
#include "causal_attention/ops.h"

#include "checks.h"
#include "cpu/block_gemm.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <string>

namespace causal_attention {

at::Tensor attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                     std::optional<double> scale, const std::optional<at::Tensor>& key_mask,
                     at::IntArrayRef window, std::optional<double> softcap,
                     const std::optional<at::Tensor>& alibi_slopes,
                     const std::optional<at::Tensor>& sinks, double dropout_p,
                     std::optional<at::Generator> generator) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("causal_attention::attention", "")
                       .typed<decltype(attention)>();
  return op.call(q, k, v, scale, key_mask, window, softcap, alibi_slopes, sinks, dropout_p,
                 std::move(generator));
}

std::tuple<at::Tensor, at::Tensor> attention_forward(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale,
    const std::optional<at::Tensor>& key_mask, at::IntArrayRef window,
    std::optional<double> softcap, const std::optional<at::Tensor>& alibi_slopes,
    const std::optional<at::Tensor>& sinks, double dropout_p,
    const std::optional<at::Tensor>& dropout_seed) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("causal_attention::attention_forward", "")
                       .typed<decltype(attention_forward)>();
  return op.call(q, k, v, scale, key_mask, window, softcap, alibi_slopes, sinks, dropout_p,
                 dropout_seed);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> attention_backward(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& lse, double scale,
    const std::optional<at::Tensor>& key_mask, at::IntArrayRef window,
    std::optional<double> softcap, const std::optional<at::Tensor>& alibi_slopes,
    const std::optional<at::Tensor>& sinks, double dropout_p,
    const std::optional<at::Tensor>& dropout_seed) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("causal_attention::attention_backward", "")
                       .typed<decltype(attention_backward)>();
  return op.call(grad_out, q, k, v, out, lse, scale, key_mask, window, softcap, alibi_slopes, sinks,
                 dropout_p, dropout_seed);
}

at::Tensor attention_weights(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                             std::optional<double> scale, const std::optional<at::Tensor>& key_mask,
                             at::IntArrayRef window, std::optional<double> softcap,
                             const std::optional<at::Tensor>& alibi_slopes,
                             const std::optional<at::Tensor>& sinks, double dropout_p,
                             std::optional<at::Generator> generator) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("causal_attention::attention_weights", "")
                       .typed<decltype(attention_weights)>();
  return op.call(q, k, v, scale, key_mask, window, softcap, alibi_slopes, sinks, dropout_p,
                 std::move(generator));
}

at::Tensor varlen_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k,
                            c10::SymInt max_seqlen_q, c10::SymInt max_seqlen_k,
                            std::optional<double> scale, at::IntArrayRef window,
                            std::optional<double> softcap,
                            const std::optional<at::Tensor>& alibi_slopes,
                            const std::optional<at::Tensor>& sinks, double dropout_p,
                            std::optional<at::Generator> generator) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("causal_attention::varlen_attention", "")
                       .typed<decltype(varlen_attention)>();
  return op.call(q, k, v, cu_seqlens_q, cu_seqlens_k, std::move(max_seqlen_q),
                 std::move(max_seqlen_k), scale, window, softcap, alibi_slopes, sinks, dropout_p,
                 std::move(generator));
}

std::tuple<at::Tensor, at::Tensor> varlen_attention_forward(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cu_seqlens_q,
    const at::Tensor& cu_seqlens_k, c10::SymInt max_seqlen_q, c10::SymInt max_seqlen_k,
    double scale, at::IntArrayRef window, std::optional<double> softcap,
    const std::optional<at::Tensor>& alibi_slopes, const std::optional<at::Tensor>& sinks,
    double dropout_p, const std::optional<at::Tensor>& dropout_seed) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("causal_attention::varlen_attention_forward", "")
                       .typed<decltype(varlen_attention_forward)>();
  return op.call(q, k, v, cu_seqlens_q, cu_seqlens_k, std::move(max_seqlen_q),
                 std::move(max_seqlen_k), scale, window, softcap, alibi_slopes, sinks, dropout_p,
                 dropout_seed);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> varlen_attention_backward(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& lse, const at::Tensor& cu_seqlens_q,
    const at::Tensor& cu_seqlens_k, c10::SymInt max_seqlen_q, c10::SymInt max_seqlen_k,
    double scale, at::IntArrayRef window, std::optional<double> softcap,
    const std::optional<at::Tensor>& alibi_slopes, const std::optional<at::Tensor>& sinks,
    double dropout_p, const std::optional<at::Tensor>& dropout_seed) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("causal_attention::varlen_attention_backward", "")
                       .typed<decltype(varlen_attention_backward)>();
  return op.call(grad_out, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, std::move(max_seqlen_q),
                 std::move(max_seqlen_k), scale, window, softcap, alibi_slopes, sinks, dropout_p,
                 dropout_seed);
}

at::Tensor dropout_keep_mask(const at::Tensor& dropout_seed, c10::SymIntArrayRef shape,
                             double dropout_p) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("causal_attention::dropout_keep_mask", "")
                       .typed<decltype(dropout_keep_mask)>();
  return op.call(dropout_seed, shape, dropout_p);
}

namespace {

// `attention` is `attention_forward`'s out at the resolved scale, and `varlen_attention` is
// `varlen_attention_forward`'s: each has this one kernel for every backend the forward op has a
// kernel for, checked under its own name and calling the forward op through the dispatcher, so
// the backend's forward kernel (the CPU kernels, the Meta shapes) does the work. Autograd and
// autocast have their own kernels (autograd/, autocast/); compile and export keep the op whole.
//
// Registered per backend, not as CompositeExplicitAutograd: that alias also covers the sparse,
// sparse CSR, MKL-DNN and quantized backends, and in inference mode (which skips the Autograd
// kernel) tensors of those layouts must stay refused by the dispatcher, naming the op and the
// backend, as the forward op refuses them. Not CompositeImplicitAutograd either: that covers
// those backends too and would decompose the op into attention_forward in torch.compile and
// torch.export graphs.
at::Tensor attention_from_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                  std::optional<double> scale,
                                  const std::optional<at::Tensor>& key_mask, at::IntArrayRef window,
                                  std::optional<double> softcap,
                                  const std::optional<at::Tensor>& alibi_slopes,
                                  const std::optional<at::Tensor>& sinks, double dropout_p,
                                  std::optional<at::Generator> generator) {
  const double resolved = detail::check_attention_call(q, k, v, scale, key_mask, window, softcap,
                                                       alibi_slopes, sinks, dropout_p);
  return std::get<0>(attention_forward(q, k, v, resolved, key_mask, window, softcap, alibi_slopes,
                                       sinks, dropout_p,
                                       detail::draw_dropout_seed(dropout_p, generator)));
}

at::Tensor varlen_attention_from_forward(const at::Tensor& q, const at::Tensor& k,
                                         const at::Tensor& v, const at::Tensor& cu_seqlens_q,
                                         const at::Tensor& cu_seqlens_k, c10::SymInt max_seqlen_q,
                                         c10::SymInt max_seqlen_k, std::optional<double> scale,
                                         at::IntArrayRef window, std::optional<double> softcap,
                                         const std::optional<at::Tensor>& alibi_slopes,
                                         const std::optional<at::Tensor>& sinks, double dropout_p,
                                         std::optional<at::Generator> generator) {
  const double resolved = detail::check_varlen_attention_call(
      q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, window, softcap,
      alibi_slopes, sinks, dropout_p);
  return std::get<0>(
      varlen_attention_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, std::move(max_seqlen_q),
                               std::move(max_seqlen_k), resolved, window, softcap, alibi_slopes,
                               sinks, dropout_p, detail::draw_dropout_seed(dropout_p, generator)));
}

}  // namespace

// The score options of every op, after its other arguments (see ops.h): the differentiable ops
// draw dropout's seed from a generator, the kernel ops take it.
#define CAUSAL_ATTENTION_SCORE_OPTIONS                                                          \
  "int[2] window=[-1, 0], float? softcap=None, Tensor? alibi_slopes=None, Tensor? sinks=None, " \
  "float dropout_p=0.0, "
#define CAUSAL_ATTENTION_DRAWN_SEED "Generator? generator=None"
#define CAUSAL_ATTENTION_GIVEN_SEED "Tensor? dropout_seed=None"

TORCH_LIBRARY(causal_attention, m) {
  m.def(
      "attention(Tensor q, Tensor k, Tensor v, *, float? scale=None, Tensor? "
      "key_mask=None, " CAUSAL_ATTENTION_SCORE_OPTIONS CAUSAL_ATTENTION_DRAWN_SEED ") -> Tensor");
  m.def(
      "attention_forward(Tensor q, Tensor k, Tensor v, float scale, Tensor? "
      "key_mask=None, " CAUSAL_ATTENTION_SCORE_OPTIONS CAUSAL_ATTENTION_GIVEN_SEED
      ") -> (Tensor out, Tensor lse)");
  m.def(
      "attention_backward(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
      "float scale, Tensor? key_mask=None, " CAUSAL_ATTENTION_SCORE_OPTIONS
          CAUSAL_ATTENTION_GIVEN_SEED ") -> (Tensor dq, Tensor dk, Tensor dv, Tensor dsinks)");
  m.def(
      "attention_weights(Tensor q, Tensor k, Tensor v, *, float? scale=None, "
      "Tensor? key_mask=None, " CAUSAL_ATTENTION_SCORE_OPTIONS CAUSAL_ATTENTION_DRAWN_SEED
      ") -> Tensor");
  m.def(
      "varlen_attention(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, "
      "SymInt max_seqlen_q, SymInt max_seqlen_k, *, float? "
      "scale=None, " CAUSAL_ATTENTION_SCORE_OPTIONS CAUSAL_ATTENTION_DRAWN_SEED ") -> Tensor");
  m.def(
      "varlen_attention_forward(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, "
      "Tensor cu_seqlens_k, SymInt max_seqlen_q, SymInt max_seqlen_k, float "
      "scale, " CAUSAL_ATTENTION_SCORE_OPTIONS CAUSAL_ATTENTION_GIVEN_SEED
      ") -> (Tensor out, Tensor lse)");
  m.def(
      "varlen_attention_backward(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor out, "
      "Tensor lse, Tensor cu_seqlens_q, Tensor cu_seqlens_k, SymInt max_seqlen_q, "
      "SymInt max_seqlen_k, float scale, " CAUSAL_ATTENTION_SCORE_OPTIONS
          CAUSAL_ATTENTION_GIVEN_SEED ") -> (Tensor dq, Tensor dk, Tensor dv, Tensor dsinks)");
  m.def("dropout_keep_mask(Tensor dropout_seed, SymInt[] shape, float dropout_p) -> Tensor");
  // How a call of this dtype made now multiplies its blocks on the CPU: "native" or "widened"
  // (cpu/block_gemm.h).
  m.def("block_products(ScalarType dtype) -> str",
        [](c10::ScalarType dtype) { return std::string(cpu::block_products_in_use(dtype)); });

  // The backends of attention_forward and varlen_attention_forward (cpu/, meta/).
  for (const c10::DispatchKey backend : {c10::DispatchKey::CPU, c10::DispatchKey::Meta}) {
    m.impl("attention", torch::dispatch(backend, TORCH_FN(attention_from_forward)));
    m.impl("varlen_attention", torch::dispatch(backend, TORCH_FN(varlen_attention_from_forward)));
  }
}
#undef CAUSAL_ATTENTION_SCORE_OPTIONS
#undef CAUSAL_ATTENTION_DRAWN_SEED
#undef CAUSAL_ATTENTION_GIVEN_SEED

}  // namespace causal_attention
