// The op schemas, defined once, and the one kernel of each op that is another op with its
// arguments resolved (attention, varlen_attention, and the names packed calls had before
// attention_forward took them). The public C++ API and the dispatcher calls are api.cpp.
#include "checks.h"
#include "cpu/block_gemm.h"
#include "cpu/block_shapes.h"
#include "cpu/decode_products.h"
#include "schema_adapters.h"

#include <ATen/OpMathType.h>
#include <torch/library.h>

#include <string>
#include <utility>
#include <vector>

namespace causal_attention {
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
  detail::BackwardCall call(detail::ForwardCall{q, k, v});
  call.scale = scale;
  call.options =
      detail::score_options(window, softcap, alibi_slopes, sinks, dropout_p, dropout_seed);
  call.packed = {cu_seqlens_q, cu_seqlens_k, std::move(max_seqlen_q), std::move(max_seqlen_k)};
  call.grad_out = grad_out;
  call.out = out;
  call.lse = lse;
  return detail::call_attention_backward(call);
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
      "Tensor? sinks=None, Tensor? k_scale=None, Tensor? v_scale=None, Tensor? spec_mask=None) -> "
      "(Tensor out, Tensor lse)");
  // How a call of this dtype made now multiplies its blocks on the CPU: "native" or "widened"
  // (cpu/block_gemm.h).
  m.def("block_products(ScalarType dtype) -> str",
        [](c10::ScalarType dtype) { return std::string(cpu::block_products_in_use(dtype)); });
  // How a bfloat16 decode made now multiplies its query rows by bfloat16 and float8 cache rows:
  // "pairs" (AVX-512 BF16's dot products of pairs) or "float32" (cpu/decode_products.h).
  m.def("decode_products() -> str", []() { return std::string(cpu::decode_products_in_use()); });
  // The block shape (query rows, keys) of a call of this dtype made now with these head and
  // value dims whose query rows see at most len_k keys (every key, or with `windowed` a sliding
  // window's span shorter than the keys: cpu/block_shapes.h), as its kernels take it.
  m.def(
      "block_shape(ScalarType dtype, int head_dim, int value_dim, int len_k, bool windowed=False) "
      "-> int[]",
      [](c10::ScalarType dtype, int64_t head_dim, int64_t value_dim, int64_t len_k, bool windowed) {
        const cpu::BlockSizes blocks =
            cpu::block_sizes(head_dim, value_dim, len_k, windowed,
                             cpu::native_products_now(dtype) ? dtype : at::toOpMathType(dtype));
        return std::vector<int64_t>{blocks.query_rows, blocks.keys};
      });

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
