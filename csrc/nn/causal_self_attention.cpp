// CausalSelfAttention: nanoGPT's module layout (c_attn, c_proj, resid_dropout) around
// causal_attention::attention, with GQA, a separate value head width, the op's score options
// (window, softcap, learned sinks, ALiBi, attention dropout) and a KV cache.
#include "causal_attention/nn.h"
#include "causal_attention/ops.h"

#include <ATen/core/grad_mode.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <ATen/ops/matmul.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <utility>

namespace causal_attention::nn {
namespace {

constexpr const char* kModule = "CausalSelfAttention";

// Checks the options and fills in the defaults of num_kv_heads, head_dim and value_head_dim.
CausalSelfAttentionOptions resolve(CausalSelfAttentionOptions options) {
  const int64_t embed_dim = options.embed_dim();
  const int64_t num_heads = options.num_heads();
  TORCH_CHECK_VALUE(embed_dim > 0 && num_heads > 0, kModule,
                    ": embed_dim and num_heads must be positive, got embed_dim=", embed_dim,
                    ", num_heads=", num_heads);
  const int64_t num_kv_heads = options.num_kv_heads().value_or(num_heads);
  TORCH_CHECK_VALUE(num_kv_heads > 0 && num_heads % num_kv_heads == 0, kModule,
                    ": num_kv_heads must be a positive divisor of num_heads, got num_heads=",
                    num_heads, ", num_kv_heads=", num_kv_heads);
  TORCH_CHECK_VALUE(options.head_dim().has_value() || embed_dim % num_heads == 0, kModule,
                    ": embed_dim must be a multiple of num_heads unless head_dim is given, got "
                    "embed_dim=",
                    embed_dim, ", num_heads=", num_heads);
  const int64_t head_dim = options.head_dim().value_or(embed_dim / num_heads);
  const int64_t value_head_dim = options.value_head_dim().value_or(head_dim);
  TORCH_CHECK_VALUE(head_dim > 0 && value_head_dim > 0, kModule,
                    ": head_dim and value_head_dim must be positive, got head_dim=", head_dim,
                    ", value_head_dim=", value_head_dim);
  TORCH_CHECK_VALUE(options.dropout() >= 0.0 && options.dropout() <= 1.0, kModule,
                    ": dropout must be in [0, 1], got dropout=", options.dropout());
  // Below 1, unlike dropout: the op has no all-dropped case (Dropout(1) is all zeros).
  TORCH_CHECK_VALUE(options.attn_dropout() >= 0.0 && options.attn_dropout() < 1.0, kModule,
                    ": attn_dropout must be in [0, 1), got attn_dropout=", options.attn_dropout());
  const auto& window = options.window();
  TORCH_CHECK_VALUE(window[0] >= -1 && window[1] >= -1, kModule,
                    ": window entries must be >= -1 (-1: unbounded), got window=(", window[0], ", ",
                    window[1], ")");
  const std::optional<double> softcap = options.softcap();
  TORCH_CHECK_VALUE(!softcap.has_value() || (*softcap > 0.0 && std::isfinite(*softcap)), kModule,
                    ": softcap must be finite and > 0, got softcap=", softcap.value_or(0.0));
  return options.num_kv_heads(num_kv_heads).head_dim(head_dim).value_head_dim(value_head_dim);
}

std::optional<at::Tensor> if_defined(const at::Tensor& t) {
  return t.defined() ? std::optional<at::Tensor>(t) : std::nullopt;
}

void check_key_mask(const at::Tensor& key_mask, const at::Tensor& x) {
  TORCH_CHECK_TYPE(key_mask.defined(), kModule,
                   ": key_mask must be a defined bool tensor (B, L) or nullopt");
  TORCH_CHECK_TYPE(key_mask.scalar_type() == at::kBool, kModule,
                   ": key_mask must be a bool tensor (true for real tokens), got key_mask.dtype=",
                   key_mask.scalar_type());
  TORCH_CHECK_VALUE(
      key_mask.dim() == 2 && key_mask.size(0) == x.size(0) && key_mask.size(1) == x.size(1),
      kModule, ": key_mask must be (B, L)=", x.sizes().slice(0, 2),
      " of x, got key_mask.shape=", key_mask.sizes(), " for x.shape=", x.sizes());
  TORCH_CHECK_VALUE(key_mask.device() == x.device(), kModule, ": key_mask must be on x's device ",
                    x.device(), ", got key_mask.device=", key_mask.device());
}

}  // namespace

at::Tensor alibi_slopes(int64_t num_heads) {
  TORCH_CHECK_VALUE(num_heads > 0,
                    "alibi_slopes: num_heads must be positive, got num_heads=", num_heads);
  int64_t closest = 1;
  while (2 * closest <= num_heads) {
    closest *= 2;
  }
  at::Tensor slopes = at::empty({num_heads}, at::kFloat);
  float* slope = slopes.data_ptr<float>();
  // Each is 2 to an exact exponent, rounded once to float32, as Python's 2.0 ** -e.
  for (int64_t i = 1; i <= closest; ++i) {
    *slope++ = static_cast<float>(std::pow(2.0, -(8.0 * i / closest)));
  }
  for (int64_t i = 1; i <= num_heads - closest; ++i) {
    *slope++ = static_cast<float>(std::pow(2.0, -(4.0 * (2 * i - 1) / closest)));
  }
  return slopes;
}

CausalSelfAttentionOptions::CausalSelfAttentionOptions(int64_t embed_dim, int64_t num_heads)
    : embed_dim_(embed_dim), num_heads_(num_heads) {}

CausalSelfAttentionImpl::CausalSelfAttentionImpl(const CausalSelfAttentionOptions& options)
    : options(resolve(options)) {
  reset();
}

void CausalSelfAttentionImpl::reset() {
  const int64_t num_heads = options.num_heads();
  const int64_t num_kv_heads = *options.num_kv_heads();
  const int64_t head_dim = *options.head_dim();
  const int64_t value_head_dim = *options.value_head_dim();
  const int64_t qkv_width = (num_heads + num_kv_heads) * head_dim + num_kv_heads * value_head_dim;
  c_attn = register_module(
      "c_attn", torch::nn::Linear(
                    torch::nn::LinearOptions(options.embed_dim(), qkv_width).bias(options.bias())));
  c_proj = register_module(
      "c_proj",
      torch::nn::Linear(torch::nn::LinearOptions(num_heads * value_head_dim, options.embed_dim())
                            .bias(options.bias())));
  resid_dropout = register_module("resid_dropout", torch::nn::Dropout(options.dropout()));
  if (options.sinks()) {
    // 0: each row starts with one extra logit of 0 in its denominator.
    sinks = register_parameter("sinks", at::zeros({num_heads}));
  }
  if (options.alibi()) {
    alibi_slopes = register_buffer("alibi_slopes", causal_attention::nn::alibi_slopes(num_heads));
  }
}

void CausalSelfAttentionImpl::to(torch::Device device, torch::Dtype dtype, bool non_blocking) {
  const at::Tensor slopes = alibi_slopes.defined() ? alibi_slopes.clone() : at::Tensor();
  Cloneable::to(device, dtype, non_blocking);
  restore_alibi_slopes(slopes);
}

void CausalSelfAttentionImpl::to(torch::Dtype dtype, bool non_blocking) {
  const at::Tensor slopes = alibi_slopes.defined() ? alibi_slopes.clone() : at::Tensor();
  Cloneable::to(dtype, non_blocking);
  restore_alibi_slopes(slopes);
}

void CausalSelfAttentionImpl::restore_alibi_slopes(const at::Tensor& slopes) {
  if (slopes.defined()) {
    alibi_slopes.set_data(slopes.to(alibi_slopes.device()));
  }
}

CausalSelfAttentionImpl::Heads CausalSelfAttentionImpl::project_heads(
    const at::Tensor& x, KVCache* cache, const std::optional<at::Tensor>& key_mask) {
  // An undefined x would fail in x.dim() with a c10::Error that names no argument.
  TORCH_CHECK_TYPE(x.defined(), kModule, ": x must be a tensor (B, L, E), got an undefined tensor");
  TORCH_CHECK_VALUE(x.dim() == 3 && x.size(2) == options.embed_dim(), kModule,
                    ": x must be (B, L, E) with E=embed_dim=", options.embed_dim(),
                    ", got x.shape=", x.sizes());
  TORCH_CHECK_TYPE(x.scalar_type() == c_attn->weight.scalar_type(), kModule,
                   ": x must have the parameters' dtype ", c_attn->weight.scalar_type(),
                   ", got x.dtype=", x.scalar_type());
  if (key_mask.has_value()) {
    // Checked here, before anything enters the cache, and named after x: with a cache, the op
    // would only see the mask of every cached position.
    check_key_mask(*key_mask, x);
  }
  const int64_t batch = x.size(0);
  const int64_t len = x.size(1);
  const int64_t num_heads = options.num_heads();
  const int64_t num_kv_heads = *options.num_kv_heads();
  const int64_t head_dim = *options.head_dim();
  const int64_t value_head_dim = *options.value_head_dim();
  // (B, L, H * D) -> (B, H, L, D) as a view: the op reads any strides.
  const auto split_heads = [&](const at::Tensor& t, int64_t heads, int64_t dim) {
    return t.view({batch, len, heads, dim}).transpose(1, 2);
  };
  const std::vector<at::Tensor> qkv = c_attn(x).split_with_sizes(
      {num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * value_head_dim}, -1);
  Heads heads{split_heads(qkv[0], num_heads, head_dim), split_heads(qkv[1], num_kv_heads, head_dim),
              split_heads(qkv[2], num_kv_heads, value_head_dim), key_mask};
  if (cache != nullptr) {
    std::tie(heads.k, heads.v, heads.key_mask) = cache->append(heads.k, heads.v, key_mask);
  }
  return heads;
}

AttentionOptions CausalSelfAttentionImpl::attention_options(const Heads& heads) const {
  return AttentionOptions()
      .key_mask(heads.key_mask)
      .attn_mask(heads.attn_mask)
      .window(options.window())
      .softcap(options.softcap())
      .alibi_slopes(if_defined(alibi_slopes))
      .sinks(if_defined(sinks))
      .dropout_p(is_training() ? options.attn_dropout() : 0.0);
}

at::Tensor CausalSelfAttentionImpl::attend(const Heads& heads) {
  return attention(heads.q, heads.k, heads.v, attention_options(heads));
}

at::Tensor CausalSelfAttentionImpl::project_output(const at::Tensor& attended) {
  const at::Tensor merged = attended.transpose(1, 2).flatten(2);  // (B, L, H * Dv)
  return resid_dropout(c_proj(merged));
}

at::Tensor CausalSelfAttentionImpl::decode_quantized(const at::Tensor& x, KVCache& cache,
                                                     const std::optional<at::Tensor>& key_mask,
                                                     const std::optional<at::Tensor>& attn_mask) {
  for (const auto& [name, mask] :
       {std::pair<const char*, const std::optional<at::Tensor>&>{"key_mask", key_mask},
        std::pair<const char*, const std::optional<at::Tensor>&>{"attn_mask", attn_mask}}) {
    TORCH_CHECK_NOT_IMPLEMENTED(!mask.has_value(), kModule, ": ", name,
                                " with an 8-bit KVCache is not supported (the attention on "
                                "8-bit keys and values takes no mask); use a float cache");
  }
  TORCH_CHECK_NOT_IMPLEMENTED(!(is_training() && options.attn_dropout() > 0.0), kModule,
                              ": attn_dropout in training with an 8-bit KVCache is not supported "
                              "(8-bit caches are for inference); call eval()");
  Heads heads = project_heads(x, nullptr, std::nullopt);
  const bool records = heads.q.requires_grad() || (sinks.defined() && sinks.requires_grad());
  TORCH_CHECK_NOT_IMPLEMENTED(!(records && at::GradMode::is_enabled()), kModule,
                              ": decoding from an 8-bit KVCache is inference only (8-bit keys and "
                              "values are not differentiable); run under torch::NoGradGuard or "
                              "c10::InferenceMode");
  const auto [keys, values, no_mask] = cache.append(heads.k, heads.v);
  const int64_t batch = keys.size(0), length = keys.size(2);
  if (length == 0) {
    // Nothing cached, nothing appended: no row (a page of no rows is not a paged cache).
    return heads.q.new_zeros({batch, heads.q.size(1), 0, values.size(3)});
  }
  at::Tensor k_scale = *cache.key_scales(), v_scale = *cache.value_scales();
  if (*cache.scales() == ScaleLayout::kToken) {
    // (B, Hkv, L) -> (B, L, Hkv): the pages' (num_pages, page_size, Hkv)
    k_scale = k_scale.transpose(1, 2);
    v_scale = v_scale.transpose(1, 2);
  }
  const auto index_options = keys.options().dtype(at::kInt);
  // (B, H, L, D) -> (B, L, H, D) as views: sequence b's keys are page b, rows 0..L-1.
  const auto [out, lse] = paged_attention(
      heads.q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2),
      at::arange(batch, index_options).unsqueeze(1), at::full({batch}, length, index_options),
      AttentionOptions()
          .window(options.window())
          .softcap(options.softcap())
          .alibi_slopes(if_defined(alibi_slopes))
          .sinks(if_defined(sinks)),
      std::nullopt, std::nullopt, k_scale, v_scale);
  return out.transpose(1, 2);
}

at::Tensor CausalSelfAttentionImpl::forward(const at::Tensor& x, KVCache* cache,
                                            const std::optional<at::Tensor>& key_mask,
                                            const std::optional<at::Tensor>& attn_mask) {
  if (cache != nullptr && cache->quantized()) {
    return project_output(decode_quantized(x, *cache, key_mask, attn_mask));
  }
  Heads heads = project_heads(x, cache, key_mask);
  heads.attn_mask = attn_mask;
  return project_output(attend(heads));
}

std::tuple<at::Tensor, at::Tensor> CausalSelfAttentionImpl::forward_with_weights(
    const at::Tensor& x, KVCache* cache, const std::optional<at::Tensor>& key_mask,
    const std::optional<at::Tensor>& attn_mask) {
  TORCH_CHECK_NOT_IMPLEMENTED(cache == nullptr || !cache->quantized(), kModule,
                              ": attention weights from an 8-bit KVCache are not supported (the "
                              "attention on 8-bit keys and values returns the output only)");
  Heads heads = project_heads(x, cache, key_mask);
  heads.attn_mask = attn_mask;
  const AttentionOptions attention_options = this->attention_options(heads);
  at::Tensor weights = attention_weights(heads.q, heads.k, heads.v, attention_options);
  if (attention_options.dropout_p() == 0.0) {
    return {project_output(attend(heads)), std::move(weights)};
  }
  // Every call draws a new dropout mask: the output is made from these weights, so that it is
  // the one they describe. Query head h reads key/value head h / (Hq / Hkv).
  const int64_t batch = heads.q.size(0), len = heads.q.size(2), cached = heads.k.size(2);
  const at::Tensor grouped = weights.reshape({batch, *options.num_kv_heads(), -1, len, cached});
  const at::Tensor attended = at::matmul(grouped, heads.v.unsqueeze(2)).flatten(1, 2);
  return {project_output(attended), std::move(weights)};
}

KVCache CausalSelfAttentionImpl::make_cache(int64_t batch_size, int64_t max_len,
                                            std::optional<at::ScalarType> dtype,
                                            std::optional<ScaleLayout> scales,
                                            std::optional<double> k_scale,
                                            std::optional<double> v_scale) const {
  TORCH_CHECK_VALUE(batch_size > 0 && max_len > 0, kModule,
                    ".make_cache: batch_size and max_len must be positive, got batch_size=",
                    batch_size, ", max_len=", max_len);
  const int64_t num_kv_heads = *options.num_kv_heads();
  const auto storage_options =
      c_attn->weight.options().dtype(dtype.value_or(c_attn->weight.scalar_type()));
  return KVCache(
      at::zeros({batch_size, num_kv_heads, max_len, *options.head_dim()}, storage_options),
      at::zeros({batch_size, num_kv_heads, max_len, *options.value_head_dim()}, storage_options),
      scales, k_scale, v_scale);
}

}  // namespace causal_attention::nn
