#include "tensor_checks.h"

#include "shapes.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <vector>

namespace causal_attention::detail {
namespace {

bool is_supported_dtype(at::ScalarType dtype) {
  return dtype == at::kDouble || dtype == at::kFloat || dtype == at::kBFloat16 ||
         dtype == at::kHalf;
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

}  // namespace

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

void check_dense_inputs(const char* op, const at::Tensor& q, const at::Tensor& k,
                        const at::Tensor& v) {
  check_attention_tensors(op, q, k, v, kDenseLayout);
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

void check_attn_mask(const char* op, const at::Tensor& q, const at::Tensor& k,
                     const AttentionMask& attn_mask) {
  if (!attn_mask.has_value()) {
    return;
  }
  const at::Tensor& mask = *attn_mask;
  check_dense_tensor(op, "attn_mask", mask);
  const at::ScalarType dtype = mask.scalar_type();
  TORCH_CHECK_TYPE(dtype == at::kBool || dtype == at::kFloat || dtype == q.scalar_type(), op,
                   ": attn_mask must be bool (True where a query may attend a key), float32 or "
                   "q's dtype ",
                   q.scalar_type(), " (added to the scores), got attn_mask.dtype=", dtype);
  TORCH_CHECK_VALUE(mask.device() == q.device(), op, ": attn_mask must be on q's device ",
                    q.device(), ", got attn_mask.device=", mask.device());
  const std::vector<c10::SymInt> scores = scores_sym_sizes(q, k);
  bool broadcastable = mask.dim() <= int64_t(scores.size());
  for (int64_t d = 1; broadcastable && d <= mask.dim(); ++d) {
    const c10::SymInt& size = mask.sym_size(-d);
    broadcastable = size == 1 || size == scores[scores.size() - d];
  }
  TORCH_CHECK_VALUE(broadcastable, op,
                    ": attn_mask must be broadcastable to the scores (*batch, Hq, Lq, Lk)=",
                    c10::SymIntArrayRef(scores), ", got attn_mask.shape=", mask.sym_sizes(),
                    " for q.shape=", q.sym_sizes(), ", k.shape=", k.sym_sizes());
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
