#include "checks.h"

#include "shapes.h"

#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace causal_attention::detail {
namespace {

bool is_supported_dtype(at::ScalarType dtype) {
  return dtype == at::kDouble || dtype == at::kFloat || dtype == at::kBFloat16 ||
         dtype == at::kHalf;
}

// Runs before anything asks a tensor for its sizes. An undefined tensor (None from Python,
// at::Tensor() from C++) has no shape, dtype or device to report: unchecked, it fails deep inside
// autograd with "tensor does not have a device". A nested tensor has no sizes to ask for
// ("NestedTensorImpl doesn't support sizes"), and a sparse or MKL-DNN one no strides for the
// kernels to read: unchecked, they fail in the first size check or past the Autograd kernel, with
// a message that names no argument. NotImplementedError, as torch's dispatcher raises for a
// layout an op has no kernel for.
void check_dense_tensor(const char* op, const char* name, const at::Tensor& t) {
  TORCH_CHECK_TYPE(t.defined(), op, ": ", name,
                   " must be a tensor, got None (an undefined tensor)");
  TORCH_CHECK_NOT_IMPLEMENTED(!t.is_nested(), op, ": ", name,
                              " must be a dense tensor, got a nested tensor; for a ragged batch, "
                              "pad it (with a key_mask) or pack it (varlen_attention)");
  TORCH_CHECK_NOT_IMPLEMENTED(t.layout() == at::kStrided, op, ": ", name,
                              " must be a dense (strided) tensor, got ", name,
                              ".layout=", t.layout());
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

// Where the heads and the rows (queries, keys) of q, k and v sit: (..., H, L, D) for dense
// calls, (L, H, D) for packed sequences. Error messages name these dims.
struct Layout {
  int64_t heads_dim, rows_dim;
};
constexpr Layout kDenseLayout{-3, -2};
constexpr Layout kPackedLayout{-2, -3};

void check_attention_tensors(const char* op, const at::Tensor& q, const at::Tensor& k,
                             const at::Tensor& v, Layout layout) {
  check_dense_tensor(op, "q", q);
  check_dense_tensor(op, "k", k);
  check_dense_tensor(op, "v", v);
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
  for (int64_t d = 0; layout.heads_dim == kDenseLayout.heads_dim && d + 3 < rank; ++d) {
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
  TORCH_CHECK_VALUE(k.sym_size(layout.rows_dim) == v.sym_size(layout.rows_dim), op,
                    ": k and v must have the same number of keys Lk (dim ", layout.rows_dim,
                    "), got k.shape=", k.sym_sizes(), ", v.shape=", v.sym_sizes());
  if (rank >= 3) {
    const c10::SymInt heads_q = q.sym_size(layout.heads_dim);
    const c10::SymInt heads_kv = k.sym_size(layout.heads_dim);
    TORCH_CHECK_VALUE(v.sym_size(layout.heads_dim) == heads_kv, op,
                      ": k and v must have the same number of heads (dim ", layout.heads_dim,
                      "), got k.shape=", k.sym_sizes(), ", v.shape=", v.sym_sizes());
    const bool divisible = heads_kv == 0 ? heads_q == 0 : heads_q % heads_kv == 0;
    TORCH_CHECK_VALUE(divisible, op, ": the query heads Hq (q dim ", layout.heads_dim,
                      ") must be a multiple of the key/value heads Hkv (k dim ", layout.heads_dim,
                      "), got q.shape=", q.sym_sizes(), ", k.shape=", k.sym_sizes());
  }
}

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

void check_key_mask(const char* op, const at::Tensor& q, const at::Tensor& k,
                    const std::optional<at::Tensor>& key_mask) {
  if (!key_mask.has_value()) {
    return;
  }
  const at::Tensor& mask = *key_mask;
  check_dense_tensor(op, "key_mask", mask);
  TORCH_CHECK_TYPE(mask.scalar_type() == at::kBool, op,
                   ": key_mask must be a bool tensor (True where a key may be attended), got "
                   "key_mask.dtype=",
                   mask.scalar_type());
  TORCH_CHECK_VALUE(mask.device() == q.device(), op, ": key_mask must be on q's device ",
                    q.device(), ", got key_mask.device=", mask.device());
  const std::vector<c10::SymInt> expected = key_mask_sym_sizes(q, k);
  TORCH_CHECK_VALUE(mask.sym_sizes() == c10::SymIntArrayRef(expected), op,
                    ": key_mask must have shape (*batch, Lk)=", c10::SymIntArrayRef(expected),
                    " (q's leading dims and k's keys), got key_mask.shape=", mask.sym_sizes(),
                    " for q.shape=", q.sym_sizes(), ", k.shape=", k.sym_sizes());
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

void check_packed_rank(const char* op, const char* name, const at::Tensor& t, const char* layout) {
  TORCH_CHECK_VALUE(t.dim() == 3, op, ": ", name, " must have 3 dimensions ", layout, ", got ",
                    name, ".shape=", t.sym_sizes());
}

void check_cumulative_lengths_tensor(const char* op, const char* name, const at::Tensor& cu,
                                     const at::Tensor& q) {
  check_dense_tensor(op, name, cu);
  TORCH_CHECK_TYPE(cu.scalar_type() == at::kInt, op, ": ", name,
                   " must be int32 (cumulative sequence lengths), got ", name,
                   ".dtype=", cu.scalar_type());
  TORCH_CHECK_VALUE(cu.dim() == 1 && cu.sym_size(0) >= 1, op, ": ", name,
                    " must be 1-D with N + 1 >= 1 entries, got ", name, ".shape=", cu.sym_sizes());
  TORCH_CHECK_VALUE(cu.device() == q.device(), op, ": ", name, " must be on q's device ",
                    q.device(), ", got ", name, ".device=", cu.device());
}

// Packed sequences: q (total_q, Hq, D), k (total_k, Hkv, D), v (total_k, Hkv, Dv), cu_seqlens_q
// and cu_seqlens_k int32 1-D of one length N + 1 on q's device, max_seqlen_q and max_seqlen_k
// non-negative, and no key mask. Shapes only, so that the Meta kernels run it; the values of
// cu_seqlens are check_cumulative_lengths'.
void check_packed_inputs(const char* op, const at::Tensor& q, const at::Tensor& k,
                         const at::Tensor& v, const std::optional<at::Tensor>& key_mask,
                         const PackedLengths& packed) {
  TORCH_CHECK_VALUE(packed.cu_seqlens_q.has_value() && packed.cu_seqlens_k.has_value() &&
                        packed.max_seqlen_q.has_value() && packed.max_seqlen_k.has_value(),
                    op,
                    ": packed sequences need all of cu_seqlens_q, cu_seqlens_k, max_seqlen_q and "
                    "max_seqlen_k, got only some of them");
  TORCH_CHECK_VALUE(!key_mask.has_value(), op,
                    ": key_mask is for dense calls; packed sequences (cu_seqlens) hold no padding");
  check_dense_tensor(op, "q", q);
  check_dense_tensor(op, "k", k);
  check_dense_tensor(op, "v", v);
  check_packed_rank(op, "q", q, "(total_q, Hq, D)");
  check_packed_rank(op, "k", k, "(total_k, Hkv, D)");
  check_packed_rank(op, "v", v, "(total_k, Hkv, Dv)");
  check_attention_tensors(op, q, k, v, kPackedLayout);
  const at::Tensor& cu_seqlens_q = *packed.cu_seqlens_q;
  const at::Tensor& cu_seqlens_k = *packed.cu_seqlens_k;
  check_cumulative_lengths_tensor(op, "cu_seqlens_q", cu_seqlens_q, q);
  check_cumulative_lengths_tensor(op, "cu_seqlens_k", cu_seqlens_k, q);
  TORCH_CHECK_VALUE(cu_seqlens_q.sym_size(0) == cu_seqlens_k.sym_size(0), op,
                    ": cu_seqlens_q and cu_seqlens_k must have the same length N + 1, got "
                    "cu_seqlens_q.shape=",
                    cu_seqlens_q.sym_sizes(), ", cu_seqlens_k.shape=", cu_seqlens_k.sym_sizes());
  const c10::SymInt& max_seqlen_q = *packed.max_seqlen_q;
  const c10::SymInt& max_seqlen_k = *packed.max_seqlen_k;
  TORCH_CHECK_VALUE(max_seqlen_q >= 0 && max_seqlen_k >= 0, op,
                    ": max_seqlen_q and max_seqlen_k must be non-negative, got max_seqlen_q=",
                    max_seqlen_q, ", max_seqlen_k=", max_seqlen_k);
}

// The inputs, the key mask and the score options of a dense or packed call.
void check_inputs_and_options(const char* op, const at::Tensor& q, const at::Tensor& k,
                              const at::Tensor& v, const std::optional<at::Tensor>& key_mask,
                              const ScoreOptions& options, const PackedLengths& packed) {
  if (packed.any()) {
    check_packed_inputs(op, q, k, v, key_mask, packed);
    const std::vector<c10::SymInt> sequences{packed.cu_seqlens_q->sym_size(0) - 1};
    check_score_options(op, q, sequences, q.sym_size(1), options);
  } else {
    check_attention_tensors(op, q, k, v, kDenseLayout);
    check_key_mask(op, q, k, key_mask);
    check_score_options(op, q, dense_batch(q), dense_heads(q), options);
  }
}

// The dtypes and devices of a backward's grad_out, out (q's dtype) and lse (the accumulation
// dtype), whatever their layout.
void check_saved_forward(const char* op, const at::Tensor& q, const at::Tensor& grad_out,
                         const at::Tensor& out, const at::Tensor& lse) {
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

}  // namespace

double check_attention_call(const char* op, const AttentionCall& call) {
  check_inputs_and_options(op, call.q, call.k, call.v, call.key_mask, call.options, call.packed);
  return resolve_scale(op, call.q, call.scale);
}

ForwardCall resolve_attention_call(const AttentionCall& call) {
  ForwardCall forward{call.q, call.k, call.v};
  forward.scale = check_attention_call(
      call.packed.any() ? "causal_attention.varlen_attention" : "causal_attention.attention", call);
  forward.key_mask = call.key_mask;
  forward.options = call.options;
  forward.options.dropout_seed = draw_dropout_seed(call.options.dropout_p, call.generator);
  forward.packed = call.packed;
  return forward;
}

void check_forward_call(const ForwardCall& call) {
  constexpr const char* op = "causal_attention.attention_forward";
  check_inputs_and_options(op, call.q, call.k, call.v, call.key_mask, call.options, call.packed);
  check_scale(op, call.scale, call.q.scalar_type());
  check_given_dropout_seed(op, call.q, call.options);
}

void check_backward_call(const BackwardCall& call) {
  constexpr const char* op = "causal_attention.attention_backward";
  const at::Tensor& q = call.q;
  check_dense_tensor(op, "grad_out", call.grad_out);
  check_inputs_and_options(op, q, call.k, call.v, call.key_mask, call.options, call.packed);
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

int64_t check_cumulative_lengths(const char* op, const char* name, const at::Tensor& cu_seqlens,
                                 int64_t total, const char* max_name, int64_t max_seqlen) {
  const int32_t* cu = cu_seqlens.data_ptr<int32_t>();
  const int64_t n = cu_seqlens.numel() - 1;
  TORCH_CHECK_VALUE(cu[0] == 0, op, ": ", name, " must start at 0, got ", name, "[0]=", cu[0]);
  int64_t longest = 0;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t length = int64_t(cu[i + 1]) - cu[i];
    TORCH_CHECK_VALUE(length >= 0, op, ": ", name, " must be non-decreasing, got ", name, "[", i,
                      "]=", cu[i], " > ", name, "[", i + 1, "]=", cu[i + 1]);
    TORCH_CHECK_VALUE(length <= max_seqlen, op, ": sequence ", i, " has length ", length, " (",
                      name, "[", i + 1, "] - ", name, "[", i, "]), more than ", max_name, "=",
                      max_seqlen);
    longest = std::max(longest, length);
  }
  TORCH_CHECK_VALUE(cu[n] == total, op, ": the last entry of ", name,
                    " must be the number of packed rows ", total, ", got ", name, "[", n,
                    "]=", cu[n]);
  return longest;
}

}  // namespace causal_attention::detail
