#include "checks.h"

#include "shapes.h"
#include "tensor_checks.h"

#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

#include <algorithm>
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

// The score options (ops.h). `batch` is q's leading dims (the sequence count N for packed calls)
// and `heads_q` its query heads.
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

// The kernel ops' (seed, offset), read on the host: a CPU tensor, or a Meta one in a Meta call
// (tracing, where no kernel reads it). A Meta seed in a CPU call would be read as undefined
// memory.
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

// The leading (batch) dims of a dense q, and its query heads (1 for a 2-D call).
std::vector<c10::SymInt> dense_batch(const at::Tensor& q) {
  return std::vector<c10::SymInt>(q.sym_sizes().begin(),
                                  q.sym_sizes().end() - std::min<int64_t>(q.dim(), 3));
}
c10::SymInt dense_heads(const at::Tensor& q) {
  return q.dim() >= 3 ? q.sym_size(-3) : c10::SymInt(1);
}

// The inputs, the masks and the score options of a dense or packed call (an AttentionCall or a
// ForwardCall).
template <typename Call>
void check_inputs_and_options(const char* op, const Call& call) {
  const at::Tensor &q = call.q, &k = call.k, &v = call.v;
  if (call.packed.any()) {
    check_packed_inputs(op, q, k, v, call.key_mask, call.packed);
    TORCH_CHECK_VALUE(!call.attn_mask.has_value(), op,
                      ": attn_mask is for dense calls; in packed sequences (cu_seqlens) each "
                      "sequence sees only its own keys, narrowed by the window");
    const std::vector<c10::SymInt> sequences{call.packed.cu_seqlens_q->sym_size(0) - 1};
    check_score_options(op, q, sequences, q.sym_size(1), call.options);
  } else {
    check_dense_inputs(op, q, k, v);
    check_key_mask(op, q, k, call.key_mask);
    check_attn_mask(op, q, k, call.attn_mask);
    check_score_options(op, q, dense_batch(q), dense_heads(q), call.options);
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

double check_paged_call(const PagedCall& call) {
  constexpr const char* op = "causal_attention.paged_attention";
  const at::Tensor &q = call.q, &k = call.k_cache, &v = call.v_cache;
  // The tables are checked with cu_seqlens_q below.
  for (const auto& [name, t] :
       {std::pair<const char*, const at::Tensor&>{"q", q}, {"k_cache", k}, {"v_cache", v}}) {
    check_dense_tensor(op, name, t);
  }
  const bool packed = call.packed();
  const char* q_layout = packed ? "(total_q, Hq, D)" : "(B, Lq, Hq, D)";
  TORCH_CHECK_VALUE(q.dim() == (packed ? 3 : 4), op, ": q must be ", q_layout,
                    packed ? " with cu_seqlens_q" : " (or packed with cu_seqlens_q)",
                    ", got q.shape=", q.sym_sizes());
  TORCH_CHECK_VALUE(k.dim() == 4 && v.dim() == 4 && k.sym_size(0) == v.sym_size(0) &&
                        k.sym_size(1) == v.sym_size(1) && k.sym_size(2) == v.sym_size(2) &&
                        k.sym_size(3) == q.sym_size(-1),
                    op,
                    ": k_cache and v_cache must be (num_pages, page_size, Hkv, D) and (num_pages, "
                    "page_size, Hkv, Dv) with q's D, got q.shape=",
                    q.sym_sizes(), ", k_cache.shape=", k.sym_sizes(),
                    ", v_cache.shape=", v.sym_sizes());
  TORCH_CHECK_VALUE(k.sym_size(2) != 0 && q.sym_size(-2) % k.sym_size(2) == 0, op,
                    ": q's heads Hq must be a multiple of the caches' Hkv, got q.shape=",
                    q.sym_sizes(), ", k_cache.shape=", k.sym_sizes());
  TORCH_CHECK_TYPE(
      at::isFloatingType(q.scalar_type()), op,
      ": q must be floating (float32, float64, bfloat16, float16), got q.dtype=", q.scalar_type());
  for (const auto& [name, t] :
       {std::pair<const char*, const at::Tensor&>{"k_cache", k}, {"v_cache", v}}) {
    TORCH_CHECK_TYPE(t.scalar_type() == q.scalar_type(), op, ": ", name, " must have q's dtype ",
                     q.scalar_type(), ", got ", name, ".dtype=", t.scalar_type());
    TORCH_CHECK_VALUE(t.device() == q.device(), op, ": ", name, " must be on q's device ",
                      q.device(), ", got ", name, ".device=", t.device());
  }
  const c10::SymInt batch = packed ? call.cu_seqlens_q->sym_size(0) - 1 : q.sym_size(0);
  // The tables are read on the host, as the kernels walk the pages.
  const std::vector<std::pair<const char*, const at::Tensor*>> tables = {
      {"block_table", &call.block_table},
      {"cache_seqlens", &call.cache_seqlens},
      {"cu_seqlens_q", packed ? &*call.cu_seqlens_q : nullptr}};
  for (const auto& [name, t] : tables) {
    if (t == nullptr) {
      continue;
    }
    check_dense_tensor(op, name, *t);
    TORCH_CHECK_TYPE(t->scalar_type() == at::kInt, op, ": ", name, " must be int32, got ", name,
                     ".dtype=", t->scalar_type());
    TORCH_CHECK_VALUE(t->is_cpu() || (q.is_meta() && t->is_meta()), op, ": ", name,
                      " must be a CPU tensor (read on the host), got ", name,
                      ".device=", t->device());
  }
  TORCH_CHECK_VALUE(call.block_table.dim() == 2 && call.block_table.sym_size(0) == batch, op,
                    ": block_table must be (B, max_pages) with B=", batch,
                    " sequences, got "
                    "block_table.shape=",
                    call.block_table.sym_sizes());
  TORCH_CHECK_VALUE(call.cache_seqlens.dim() == 1 && call.cache_seqlens.sym_size(0) == batch, op,
                    ": cache_seqlens must be (B,) with B=", batch,
                    " sequences, got "
                    "cache_seqlens.shape=",
                    call.cache_seqlens.sym_sizes());
  if (packed) {
    TORCH_CHECK_VALUE(
        call.cu_seqlens_q->dim() == 1 && call.cu_seqlens_q->sym_size(0) >= 1, op,
        ": cu_seqlens_q must be (B + 1,), got cu_seqlens_q.shape=", call.cu_seqlens_q->sym_sizes());
    TORCH_CHECK_VALUE(call.max_seqlen_q.has_value() && *call.max_seqlen_q >= 0, op,
                      ": packed q needs max_seqlen_q >= 0 with cu_seqlens_q");
  } else {
    TORCH_CHECK_VALUE(!call.max_seqlen_q.has_value(), op,
                      ": max_seqlen_q goes with cu_seqlens_q (packed q), got it for a dense q");
  }
  // Alibi slopes (Hq,) or (B, Hq), as a packed call's: one row per sequence.
  check_score_options(op, q, {batch}, q.sym_size(-2), call.options);
  return resolve_scale(op, q, call.scale);
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
