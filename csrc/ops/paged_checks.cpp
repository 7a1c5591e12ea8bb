#include "paged_checks.h"

#include "option_checks.h"
#include "tensor_checks.h"

#include <c10/util/Exception.h>

#include <utility>
#include <vector>

namespace causal_attention::detail {
namespace {

// The caches' dtypes: both q's, or both one 8-bit dtype beside a float32, bfloat16 or float16 q;
// scales only with 8-bit caches.
void check_cache_dtypes(const char* op, const PagedCall& call) {
  const at::Tensor &q = call.q, &k = call.k_cache, &v = call.v_cache;
  if (!is_eight_bit_cache(k.scalar_type()) && !is_eight_bit_cache(v.scalar_type())) {
    for (const auto& [name, t] :
         {std::pair<const char*, const at::Tensor&>{"k_cache", k}, {"v_cache", v}}) {
      TORCH_CHECK_TYPE(t.scalar_type() == q.scalar_type(), op, ": ", name, " must have q's dtype ",
                       q.scalar_type(), " (or be 8-bit: float8_e4m3fn, float8_e5m2, int8), got ",
                       name, ".dtype=", t.scalar_type());
    }
    for (const auto& [name, scale] :
         {std::pair<const char*, const std::optional<at::Tensor>&>{"k_scale", call.k_scale},
          {"v_scale", call.v_scale}}) {
      TORCH_CHECK_VALUE(!scale.has_value(), op, ": ", name,
                        " dequantizes an 8-bit cache (float8_e4m3fn, float8_e5m2, int8); the "
                        "caches are ",
                        k.scalar_type(), ", q's dtype");
    }
    return;
  }
  TORCH_CHECK_TYPE(k.scalar_type() == v.scalar_type(), op,
                   ": 8-bit caches must share one dtype, got k_cache.dtype=", k.scalar_type(),
                   ", v_cache.dtype=", v.scalar_type());
  TORCH_CHECK_TYPE(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16 ||
                       q.scalar_type() == at::kHalf,
                   op, ": q must be float32, bfloat16 or float16 beside ", k.scalar_type(),
                   " caches, got q.dtype=", q.scalar_type());
  for (const auto& [name, scale] :
       {std::pair<const char*, const std::optional<at::Tensor>&>{"k_scale", call.k_scale},
        {"v_scale", call.v_scale}}) {
    if (!scale.has_value()) {
      continue;
    }
    const at::Tensor& s = *scale;
    TORCH_CHECK_VALUE(s.is_cpu() || (q.is_meta() && s.is_meta()), op, ": ", name,
                      " must be a CPU tensor (read on the host), got ", name,
                      ".device=", s.device());
    if (s.sym_numel() == 1 && s.dim() <= 1) {
      TORCH_CHECK_TYPE(at::isFloatingType(s.scalar_type()), op, ": ", name,
                       " (one scale per tensor) must be floating, got ", name,
                       ".dtype=", s.scalar_type());
      continue;
    }
    // One scale a token and KV head, beside the pages.
    TORCH_CHECK_VALUE(s.dim() == 3 && s.sym_size(0) == k.sym_size(0) &&
                          s.sym_size(1) == k.sym_size(1) && s.sym_size(2) == k.sym_size(2),
                      op, ": ", name,
                      " must be one scale per tensor (a float or a one-element tensor) or one per "
                      "token and KV head, (num_pages, page_size, Hkv)=",
                      k.sym_sizes().slice(0, 3), ", got ", name, ".shape=", s.sym_sizes());
    TORCH_CHECK_TYPE(s.scalar_type() == at::kFloat, op, ": ", name,
                     " (one scale per token and KV head) must be float32, got ", name,
                     ".dtype=", s.scalar_type());
  }
}

// spec_mask's dtype, device and shape (its values, each row seeing itself, are read with the
// sequences' lengths on the host: paged_attention_cpu.cpp).
void check_spec_mask(const char* op, const PagedCall& call, const c10::SymInt& batch) {
  if (!call.spec_mask.has_value()) {
    return;
  }
  const at::Tensor &m = *call.spec_mask, &q = call.q;
  TORCH_CHECK_TYPE(m.scalar_type() == at::kBool, op,
                   ": spec_mask must be bool (True where a row sees a new token), got "
                   "spec_mask.dtype=",
                   m.scalar_type());
  TORCH_CHECK_VALUE(
      m.is_cpu() || (q.is_meta() && m.is_meta()), op,
      ": spec_mask must be a CPU tensor (read on the host), got spec_mask.device=", m.device());
  if (call.packed()) {
    TORCH_CHECK_VALUE(
        m.dim() == 2 && m.sym_size(0) == q.sym_size(0) && m.sym_size(1) == *call.max_seqlen_q, op,
        ": spec_mask must be (total_q, max_seqlen_q)=(", q.sym_size(0), ", ", *call.max_seqlen_q,
        ") for packed q, got spec_mask.shape=", m.sym_sizes());
  } else {
    TORCH_CHECK_VALUE(m.dim() == 3 && m.sym_size(0) == batch && m.sym_size(1) == q.sym_size(1) &&
                          m.sym_size(2) == q.sym_size(1),
                      op, ": spec_mask must be (B, Lq, Lq)=(", batch, ", ", q.sym_size(1), ", ",
                      q.sym_size(1), ") for q of shape ", q.sym_sizes(),
                      ", got spec_mask.shape=", m.sym_sizes());
  }
  const c10::SymInt new_tokens = call.packed() ? *call.max_seqlen_q : q.sym_size(1);
  TORCH_CHECK_VALUE(new_tokens <= kMaxSpecTokens, op, ": spec_mask serves steps of at most ",
                    kMaxSpecTokens, " new tokens a sequence, got ",
                    call.packed() ? "max_seqlen_q=" : "Lq=", new_tokens);
}

}  // namespace

bool is_eight_bit_cache(at::ScalarType dtype) {
  return dtype == at::kFloat8_e4m3fn || dtype == at::kFloat8_e5m2 || dtype == at::kChar;
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
  // A token's page is its position divided by page_size, found on the host and in the kernels.
  TORCH_CHECK_VALUE(k.sym_size(1) != 0, op,
                    ": the pages must hold at least one token (page_size = k_cache.shape[1] >= 1), "
                    "got k_cache.shape=",
                    k.sym_sizes());
  TORCH_CHECK_VALUE(k.sym_size(2) != 0 && q.sym_size(-2) % k.sym_size(2) == 0, op,
                    ": q's heads Hq must be a multiple of the caches' Hkv, got q.shape=",
                    q.sym_sizes(), ", k_cache.shape=", k.sym_sizes());
  TORCH_CHECK_TYPE(
      at::isFloatingType(q.scalar_type()), op,
      ": q must be floating (float32, float64, bfloat16, float16), got q.dtype=", q.scalar_type());
  check_cache_dtypes(op, call);
  for (const auto& [name, t] :
       {std::pair<const char*, const at::Tensor&>{"k_cache", k}, {"v_cache", v}}) {
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
  check_spec_mask(op, call, batch);
  // Alibi slopes (Hq,) or (B, Hq), as a packed call's: one row per sequence.
  check_score_options(op, q, {batch}, q.sym_size(-2), call.options);
  return resolve_scale(op, q, call.scale);
}

}  // namespace causal_attention::detail
