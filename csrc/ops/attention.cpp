// The op schemas, defined once; the public C++ API; the dispatcher calls of schema_adapters.h;
// and the one kernel of each op that is another op with its arguments resolved (attention,
// varlen_attention, and the names packed calls had before attention_forward took them). The API
// calls through cached dispatcher handles rather than the kernels, so C++ callers get autograd,
// autocast, Meta and device dispatch exactly as Python callers do.
#include "causal_attention/ops.h"

#include "checks.h"
#include "cpu/block_gemm.h"
#include "schema_adapters.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <string>

namespace causal_attention {
namespace detail {
namespace {

template <typename Signature>
c10::TypedOperatorHandle<Signature> operator_handle(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

}  // namespace

at::Tensor call_attention(const AttentionCall& c) {
  const ScoreOptions& o = c.options;
  if (c.packed.any()) {
    static auto op =
        operator_handle<VarlenAttentionSignature>("causal_attention::varlen_attention");
    const PackedLengths& p = c.packed;
    return op.call(c.q, c.k, c.v, p.cu_seqlens_q.value_or(at::Tensor()),
                   p.cu_seqlens_k.value_or(at::Tensor()), p.max_seqlen_q.value_or(0),
                   p.max_seqlen_k.value_or(0), c.scale, o.window, o.softcap, o.alibi_slopes,
                   o.sinks, o.dropout_p, c.generator);
  }
  static auto op = operator_handle<AttentionSignature>("causal_attention::attention");
  return op.call(c.q, c.k, c.v, c.scale, c.key_mask, c.attn_mask, o.window, o.softcap,
                 o.alibi_slopes, o.sinks, o.dropout_p, c.generator);
}

at::Tensor call_attention_weights(const AttentionCall& c) {
  static auto op = operator_handle<AttentionSignature>("causal_attention::attention_weights");
  const ScoreOptions& o = c.options;
  return op.call(c.q, c.k, c.v, c.scale, c.key_mask, c.attn_mask, o.window, o.softcap,
                 o.alibi_slopes, o.sinks, o.dropout_p, c.generator);
}

std::tuple<at::Tensor, at::Tensor> call_attention_forward(const ForwardCall& c) {
  static auto op = operator_handle<ForwardSignature>("causal_attention::attention_forward");
  const ScoreOptions& o = c.options;
  const PackedLengths& p = c.packed;
  return op.call(c.q, c.k, c.v, c.scale, c.key_mask, o.window, o.softcap, o.alibi_slopes, o.sinks,
                 o.dropout_p, o.dropout_seed, p.cu_seqlens_q, p.cu_seqlens_k, p.max_seqlen_q,
                 p.max_seqlen_k, c.attn_mask, c.query_offset);
}

std::tuple<at::Tensor, at::Tensor> call_paged_attention(const PagedCall& c) {
  static auto op = operator_handle<PagedSignature>("causal_attention::paged_attention");
  const ScoreOptions& o = c.options;
  return op.call(c.q, c.k_cache, c.v_cache, c.block_table, c.cache_seqlens, c.cu_seqlens_q,
                 c.max_seqlen_q, c.scale, o.window, o.softcap, o.alibi_slopes, o.sinks);
}

namespace {

// attention_gradients and attention_backward through their handle: the call's flat arguments,
// then the ones the op has beyond attention_backward's.
template <typename Op, typename... Extra>
auto call_backward_op(const Op& op, const BackwardCall& c, Extra... extra) {
  const ScoreOptions& o = c.options;
  const PackedLengths& p = c.packed;
  return op.call(c.grad_out, c.q, c.k, c.v, c.out, c.lse, c.scale, c.key_mask, o.window, o.softcap,
                 o.alibi_slopes, o.sinks, o.dropout_p, o.dropout_seed, p.cu_seqlens_q,
                 p.cu_seqlens_k, p.max_seqlen_q, p.max_seqlen_k, c.attn_mask, extra...);
}

}  // namespace

Gradients call_attention_gradients(const BackwardCall& c) {
  static auto op = operator_handle<GradientsSignature>("causal_attention::attention_gradients");
  return call_backward_op(op, c, c.attn_mask_grad, c.query_offset, c.delta);
}

BackwardGradients call_attention_backward(const BackwardCall& c) {
  static auto op = operator_handle<BackwardSignature>("causal_attention::attention_backward");
  return call_backward_op(op, c, c.query_offset, c.delta);
}

}  // namespace detail

namespace {

// The score options of a C++ API call (the kernel ops' seed aside).
detail::ScoreOptions score_options(const AttentionOptions& options) {
  detail::ScoreOptions score;
  score.window.assign(options.window().begin(), options.window().end());
  score.softcap = options.softcap();
  score.alibi_slopes = options.alibi_slopes();
  score.sinks = options.sinks();
  score.dropout_p = options.dropout_p();
  return score;
}

// A C++ API call of a differentiable op as the struct the ops take.
detail::AttentionCall attention_call(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                     const AttentionOptions& options) {
  detail::AttentionCall call{q, k, v};
  call.scale = options.scale();
  call.key_mask = options.key_mask();
  call.attn_mask = options.attn_mask();
  call.options = score_options(options);
  call.generator = options.generator();
  return call;
}

// The kernel ops take the scale as an argument and the seed given: the options' scale and
// generator have no place there.
detail::ForwardCall forward_call(const char* op, const at::Tensor& q, const at::Tensor& k,
                                 const at::Tensor& v, double scale, const AttentionOptions& options,
                                 const std::optional<at::Tensor>& dropout_seed) {
  TORCH_CHECK_VALUE(!options.scale().has_value() && !options.generator().has_value(), op,
                    ": the kernel ops take the scale as an argument and dropout_seed for dropout; "
                    "AttentionOptions::scale and ::generator are for attention, "
                    "attention_weights and varlen_attention");
  detail::ForwardCall forward{q, k, v};
  forward.scale = scale;
  forward.key_mask = options.key_mask();
  forward.attn_mask = options.attn_mask();
  forward.options = score_options(options);
  forward.options.dropout_seed = dropout_seed;
  return forward;
}

detail::BackwardCall backward_call(const char* op, const at::Tensor& grad_out, const at::Tensor& q,
                                   const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
                                   const at::Tensor& lse, double scale,
                                   const AttentionOptions& options,
                                   const std::optional<at::Tensor>& dropout_seed) {
  detail::BackwardCall call(forward_call(op, q, k, v, scale, options, dropout_seed));
  call.grad_out = grad_out;
  call.out = out;
  call.lse = lse;
  return call;
}

}  // namespace

at::Tensor attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                     const AttentionOptions& options) {
  return detail::call_attention(attention_call(q, k, v, options));
}

at::Tensor attention_weights(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                             const AttentionOptions& options) {
  return detail::call_attention_weights(attention_call(q, k, v, options));
}

at::Tensor varlen_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k,
                            c10::SymInt max_seqlen_q, c10::SymInt max_seqlen_k,
                            const AttentionOptions& options) {
  TORCH_CHECK_VALUE(!options.key_mask().has_value() && !options.attn_mask().has_value(),
                    "causal_attention.varlen_attention: key_mask and attn_mask are for dense "
                    "calls; packed sequences (cu_seqlens) hold no padding, and each sequence sees "
                    "only its own keys");
  detail::AttentionCall call = attention_call(q, k, v, options);
  call.packed = {cu_seqlens_q, cu_seqlens_k, std::move(max_seqlen_q), std::move(max_seqlen_k)};
  return detail::call_attention(call);
}

std::tuple<at::Tensor, at::Tensor> attention_forward(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale,
    const AttentionOptions& options, const std::optional<at::Tensor>& dropout_seed) {
  return detail::call_attention_forward(
      forward_call("causal_attention.attention_forward", q, k, v, scale, options, dropout_seed));
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> attention_gradients(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& lse, double scale, const AttentionOptions& options,
    const std::optional<at::Tensor>& dropout_seed, bool attn_mask_grad) {
  detail::BackwardCall call = backward_call("causal_attention.attention_gradients", grad_out, q, k,
                                            v, out, lse, scale, options, dropout_seed);
  call.attn_mask_grad = attn_mask_grad;
  return detail::call_attention_gradients(call);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> attention_backward(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& lse, double scale, const AttentionOptions& options,
    const std::optional<at::Tensor>& dropout_seed) {
  return detail::call_attention_backward(backward_call("causal_attention.attention_backward",
                                                       grad_out, q, k, v, out, lse, scale, options,
                                                       dropout_seed));
}

std::tuple<at::Tensor, at::Tensor> paged_attention(
    const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
    const at::Tensor& block_table, const at::Tensor& cache_seqlens, const AttentionOptions& options,
    const std::optional<at::Tensor>& cu_seqlens_q, std::optional<c10::SymInt> max_seqlen_q) {
  TORCH_CHECK_VALUE(!options.key_mask().has_value() && !options.attn_mask().has_value() &&
                        options.dropout_p() == 0 && !options.generator().has_value(),
                    "causal_attention.paged_attention: key_mask, attn_mask and dropout are not "
                    "options of the paged op (an inference op over whole sequences: their "
                    "lengths are cache_seqlens); got key_mask=",
                    options.key_mask().has_value(), ", attn_mask=", options.attn_mask().has_value(),
                    ", dropout_p=", options.dropout_p());
  detail::PagedCall call{q, k_cache, v_cache, block_table, cache_seqlens};
  call.cu_seqlens_q = cu_seqlens_q;
  call.max_seqlen_q = std::move(max_seqlen_q);
  call.scale = options.scale();
  call.options = score_options(options);
  return detail::call_paged_attention(call);
}

at::Tensor dropout_keep_mask(const at::Tensor& dropout_seed, c10::SymIntArrayRef shape,
                             double dropout_p) {
  static auto op =
      detail::operator_handle<decltype(dropout_keep_mask)>("causal_attention::dropout_keep_mask");
  return op.call(dropout_seed, shape, dropout_p);
}

namespace {

// `attention` and `varlen_attention` are `attention_forward`'s out at the resolved scale, with
// the dropout seed drawn: this one kernel for every backend the forward op has a kernel for,
// checked under the op's own name and calling the forward op through the dispatcher, so the
// backend's forward kernel (the CPU kernels, the Meta shapes) does the work. Autograd and
// autocast have their own kernels (autograd/, autocast/); compile and export keep the op whole.
//
// Registered per backend, not as CompositeExplicitAutograd: that alias also covers the sparse,
// sparse CSR, MKL-DNN and quantized backends, and in inference mode (which skips the Autograd
// kernel) tensors of those layouts must stay refused by the dispatcher, naming the op and the
// backend, as the forward op refuses them. Not CompositeImplicitAutograd either: that covers
// those backends too and would decompose the op into attention_forward in torch.compile and
// torch.export graphs.
at::Tensor attention_from_forward(const detail::AttentionCall& call) {
  return std::get<0>(detail::call_attention_forward(detail::resolve_attention_call(call)));
}

// The packed kernel ops' names before attention_forward and attention_backward took packed
// sequences, kept so that programs saved with them (TorchScript, exported graphs) still load and
// run. CompositeImplicitAutograd: they are the merged ops, whatever the key.
std::tuple<at::Tensor, at::Tensor> packed_forward_alias(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cu_seqlens_q,
    const at::Tensor& cu_seqlens_k, c10::SymInt max_seqlen_q, c10::SymInt max_seqlen_k,
    double scale, at::IntArrayRef window, std::optional<double> softcap,
    const std::optional<at::Tensor>& alibi_slopes, const std::optional<at::Tensor>& sinks,
    double dropout_p, const std::optional<at::Tensor>& dropout_seed) {
  return detail::forward_from_schema<detail::call_attention_forward>(
      q, k, v, scale, std::nullopt, window, softcap, alibi_slopes, sinks, dropout_p, dropout_seed,
      cu_seqlens_q, cu_seqlens_k, std::move(max_seqlen_q), std::move(max_seqlen_k), std::nullopt,
      std::nullopt);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> packed_backward_alias(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& lse, const at::Tensor& cu_seqlens_q,
    const at::Tensor& cu_seqlens_k, c10::SymInt max_seqlen_q, c10::SymInt max_seqlen_k,
    double scale, at::IntArrayRef window, std::optional<double> softcap,
    const std::optional<at::Tensor>& alibi_slopes, const std::optional<at::Tensor>& sinks,
    double dropout_p, const std::optional<at::Tensor>& dropout_seed) {
  static auto op =
      detail::operator_handle<detail::BackwardSignature>("causal_attention::attention_backward");
  return op.call(grad_out, q, k, v, out, lse, scale, std::nullopt, window, softcap, alibi_slopes,
                 sinks, dropout_p, dropout_seed, cu_seqlens_q, cu_seqlens_k,
                 std::move(max_seqlen_q), std::move(max_seqlen_k), std::nullopt, std::nullopt,
                 std::nullopt);
}

}  // namespace

// The score options of every op, after its other arguments (see ops.h): the differentiable ops
// draw dropout's seed from a generator, the kernel ops take it, and take packed sequences last.
#define CAUSAL_ATTENTION_SCORE_OPTIONS                                                          \
  "int[2] window=[-1, 0], float? softcap=None, Tensor? alibi_slopes=None, Tensor? sinks=None, " \
  "float dropout_p=0.0, "
#define CAUSAL_ATTENTION_DRAWN_SEED "Generator? generator=None"
#define CAUSAL_ATTENTION_GIVEN_SEED "Tensor? dropout_seed=None"
// The kernel ops take attn_mask, then query_offset (and the backward ops delta) last, after the
// arguments they had before them, so that programs saved with positional calls keep their meaning.
#define CAUSAL_ATTENTION_PACKED_SEQUENCES                                               \
  ", Tensor? cu_seqlens_q=None, Tensor? cu_seqlens_k=None, SymInt? max_seqlen_q=None, " \
  "SymInt? max_seqlen_k=None, Tensor? attn_mask=None"

TORCH_LIBRARY(causal_attention, m) {
  m.def(
      "attention(Tensor q, Tensor k, Tensor v, *, float? scale=None, Tensor? "
      "key_mask=None, Tensor? "
      "attn_mask=None, " CAUSAL_ATTENTION_SCORE_OPTIONS CAUSAL_ATTENTION_DRAWN_SEED ") -> Tensor");
  m.def(
      "attention_forward(Tensor q, Tensor k, Tensor v, float scale, Tensor? "
      "key_mask=None, " CAUSAL_ATTENTION_SCORE_OPTIONS
          CAUSAL_ATTENTION_GIVEN_SEED CAUSAL_ATTENTION_PACKED_SEQUENCES
      ", SymInt? query_offset=None) -> (Tensor out, Tensor lse)");
  m.def(
      "attention_backward(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
      "float scale, Tensor? key_mask=None, " CAUSAL_ATTENTION_SCORE_OPTIONS
          CAUSAL_ATTENTION_GIVEN_SEED CAUSAL_ATTENTION_PACKED_SEQUENCES
      ", SymInt? query_offset=None, Tensor? delta=None) -> (Tensor dq, Tensor dk, Tensor dv, "
      "Tensor dsinks)");
  m.def(
      "attention_gradients(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
      "float scale, Tensor? key_mask=None, " CAUSAL_ATTENTION_SCORE_OPTIONS
          CAUSAL_ATTENTION_GIVEN_SEED CAUSAL_ATTENTION_PACKED_SEQUENCES
      ", bool attn_mask_grad=False, SymInt? query_offset=None, Tensor? delta=None) -> (Tensor dq, "
      "Tensor dk, Tensor dv, Tensor dsinks, "
      "Tensor dattn_mask)");
  m.def(
      "attention_weights(Tensor q, Tensor k, Tensor v, *, float? scale=None, "
      "Tensor? key_mask=None, Tensor? "
      "attn_mask=None, " CAUSAL_ATTENTION_SCORE_OPTIONS CAUSAL_ATTENTION_DRAWN_SEED ") -> Tensor");
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
      "SymInt max_seqlen_k, float "
      "scale, " CAUSAL_ATTENTION_SCORE_OPTIONS CAUSAL_ATTENTION_GIVEN_SEED
      ") -> (Tensor dq, Tensor dk, Tensor dv, Tensor dsinks)");
  m.def("dropout_keep_mask(Tensor dropout_seed, SymInt[] shape, float dropout_p) -> Tensor");
  m.def(
      "paged_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_table, "
      "Tensor cache_seqlens, *, Tensor? cu_seqlens_q=None, SymInt? max_seqlen_q=None, "
      "float? scale=None, int[2] window=[-1, 0], float? softcap=None, Tensor? alibi_slopes=None, "
      "Tensor? sinks=None) -> (Tensor out, Tensor lse)");
  // How a call of this dtype made now multiplies its blocks on the CPU: "native" or "widened"
  // (cpu/block_gemm.h).
  m.def("block_products(ScalarType dtype) -> str",
        [](c10::ScalarType dtype) { return std::string(cpu::block_products_in_use(dtype)); });

  m.impl("varlen_attention_forward", torch::dispatch(c10::DispatchKey::CompositeImplicitAutograd,
                                                     TORCH_FN(packed_forward_alias)));
  m.impl("varlen_attention_backward", torch::dispatch(c10::DispatchKey::CompositeImplicitAutograd,
                                                      TORCH_FN(packed_backward_alias)));

  // The backends of attention_forward (cpu/, meta/).
  for (const c10::DispatchKey backend : {c10::DispatchKey::CPU, c10::DispatchKey::Meta}) {
    m.impl("attention",
           torch::dispatch(backend, detail::attention_from_schema<attention_from_forward>));
    m.impl("varlen_attention",
           torch::dispatch(backend, detail::varlen_attention_from_schema<attention_from_forward>));
  }
}
#undef CAUSAL_ATTENTION_SCORE_OPTIONS
#undef CAUSAL_ATTENTION_DRAWN_SEED
#undef CAUSAL_ATTENTION_GIVEN_SEED
#undef CAUSAL_ATTENTION_PACKED_SEQUENCES

}  // namespace causal_attention
