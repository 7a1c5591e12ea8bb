// The KV cache of CausalSelfAttention: preallocated storage written in place, so that decoding
// one position costs no reallocation and no copy of the positions already cached.
#include "causal_attention/nn.h"

#include <ATen/core/grad_mode.h>
#include <ATen/ops/isfinite.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/ones_like.h>
#include <ATen/ops/scalar_tensor.h>
#include <ATen/ops/where.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <limits>
#include <utility>

namespace causal_attention::nn {
namespace {

// The largest finite value of an 8-bit cache format, where quantized values saturate; nullopt
// for another dtype (Python's causal_attention.quantization.format_max).
std::optional<double> format_max(at::ScalarType dtype) {
  switch (dtype) {
    case at::kFloat8_e4m3fn:
      return 448.0;
    case at::kFloat8_e5m2:
      return 57344.0;
    case at::kChar:
      return 127.0;
    default:
      return std::nullopt;
  }
}

// One scale per row of x (..., D) for storing it in `dtype`: the row's largest |x| over the
// format's largest value, float32 (...); a row of zeros gets 1 (any scale stores it exactly, and
// the reader refuses 0), a scale that would underflow float32 the smallest normal float32.
at::Tensor token_scales(const at::Tensor& x, at::ScalarType dtype) {
  const at::Tensor amax = x.detach().to(at::kFloat).abs().amax(-1);
  const at::Tensor scale =
      (amax / *format_max(dtype)).clamp_min_(std::numeric_limits<float>::min());
  return at::where(amax == 0, at::ones_like(scale), scale);
}

// x / scale in float32 (scale broadcasts against x), saturated to dtype's finite range (float8
// e5m2 would round past it to inf, int8 wrap around) and rounded to nearest even.
at::Tensor quantize(const at::Tensor& x, const at::Tensor& scale, at::ScalarType dtype) {
  const double limit = *format_max(dtype);
  at::Tensor scaled = (x.detach().to(at::kFloat) / scale).clamp_(-limit, limit);
  if (dtype == at::kChar) {
    scaled.round_();
  }
  return scaled.to(dtype);
}

// With kToken, float32 ones (B, Hkv, max_len) beside the storage; with kTensor the scale `name`
// (nullopt: 1) as a 0-d float32 tensor, checked positive and finite in float32, as the attention
// reads it.
at::Tensor scale_storage(ScaleLayout layout, const char* name, std::optional<double> scale,
                         const at::Tensor& storage) {
  const auto options = storage.options().dtype(at::kFloat);
  if (layout == ScaleLayout::kToken) {
    return at::ones({storage.size(0), storage.size(1), storage.size(2)}, options);
  }
  const double value = scale.value_or(1.0);
  const float single = static_cast<float>(value);
  TORCH_CHECK_VALUE(std::isfinite(single) && single > 0.0f, "KVCache: ", name,
                    " must be positive and finite (in float32), got ", name, "=", value);
  return at::scalar_tensor(value, options);
}

}  // namespace

KVCache::KVCache(at::Tensor key_storage, at::Tensor value_storage,
                 std::optional<ScaleLayout> scales, std::optional<double> k_scale,
                 std::optional<double> v_scale)
    : key_storage_(std::move(key_storage)), value_storage_(std::move(value_storage)) {
  TORCH_CHECK_VALUE(key_storage_.dim() == 4 && value_storage_.dim() == 4,
                    "KVCache: key and value storage must be 4-D (B, Hkv, max_len, D), got "
                    "key_storage.shape=",
                    key_storage_.sizes(), ", value_storage.shape=", value_storage_.sizes());
  TORCH_CHECK_VALUE(key_storage_.sizes().slice(0, 3) == value_storage_.sizes().slice(0, 3),
                    "KVCache: key and value storage must agree in (B, Hkv, max_len), got "
                    "key_storage.shape=",
                    key_storage_.sizes(), ", value_storage.shape=", value_storage_.sizes());
  TORCH_CHECK_TYPE(key_storage_.scalar_type() == value_storage_.scalar_type(),
                   "KVCache: key and value storage must have the same dtype, got "
                   "key_storage.dtype=",
                   key_storage_.scalar_type(),
                   ", value_storage.dtype=", value_storage_.scalar_type());
  TORCH_CHECK_VALUE(key_storage_.device() == value_storage_.device(),
                    "KVCache: key and value storage must be on the same device, got "
                    "key_storage.device=",
                    key_storage_.device(), ", value_storage.device=", value_storage_.device());
  const at::ScalarType dtype = key_storage_.scalar_type();
  if (!format_max(dtype).has_value()) {
    TORCH_CHECK_VALUE(!scales.has_value() && !k_scale.has_value() && !v_scale.has_value(),
                      "KVCache: scales, k_scale and v_scale are for 8-bit storage "
                      "(float8_e4m3fn, float8_e5m2, int8); the storage is ",
                      dtype);
  } else {
    scales_ = scales.value_or(ScaleLayout::kToken);
    TORCH_CHECK_VALUE(*scales_ == ScaleLayout::kTensor || (!k_scale && !v_scale),
                      "KVCache: k_scale and v_scale are the scales of ScaleLayout::kTensor; "
                      "kToken computes its own");
    key_scale_storage_ = scale_storage(*scales_, "k_scale", k_scale, key_storage_);
    value_scale_storage_ = scale_storage(*scales_, "v_scale", v_scale, key_storage_);
  }
  mask_storage_ = at::ones({key_storage_.size(0), key_storage_.size(2)},
                           key_storage_.options().dtype(at::kBool));
}

at::Tensor KVCache::keys() const {
  return key_storage_.narrow(2, 0, length_);
}

at::Tensor KVCache::values() const {
  return value_storage_.narrow(2, 0, length_);
}

std::optional<at::Tensor> KVCache::key_mask() const {
  if (!has_key_mask_) {
    return std::nullopt;
  }
  return mask_storage_.narrow(1, 0, length_);
}

std::optional<at::Tensor> KVCache::key_scales() const {
  if (!scales_.has_value()) {
    return std::nullopt;
  }
  return *scales_ == ScaleLayout::kToken ? key_scale_storage_.narrow(2, 0, length_)
                                         : key_scale_storage_;
}

std::optional<at::Tensor> KVCache::value_scales() const {
  if (!scales_.has_value()) {
    return std::nullopt;
  }
  return *scales_ == ScaleLayout::kToken ? value_scale_storage_.narrow(2, 0, length_)
                                         : value_scale_storage_;
}

void KVCache::reset() {
  length_ = 0;
  has_key_mask_ = false;
  // Drops the autograd history of a sequence decoded under autograd, so that the next one does
  // not keep its graph alive.
  key_storage_.detach_();
  value_storage_.detach_();
}

std::tuple<at::Tensor, at::Tensor, std::optional<at::Tensor>> KVCache::append(
    const at::Tensor& keys, const at::Tensor& values, const std::optional<at::Tensor>& key_mask) {
  const auto fits = [](const at::Tensor& added, const at::Tensor& storage) {
    return added.dim() == 4 && added.size(0) == storage.size(0) &&
           added.size(1) == storage.size(1) && added.size(3) == storage.size(3);
  };
  TORCH_CHECK_VALUE(
      fits(keys, key_storage_) && fits(values, value_storage_) && keys.size(2) == values.size(2),
      "KVCache: the new keys (B, Hkv, L, D) and values (B, Hkv, L, Dv) must match "
      "the cache's batch size, heads and head dims, got keys.shape=",
      keys.sizes(), ", values.shape=", values.sizes(),
      " for a cache of keys (B, Hkv, max_len, D)=", key_storage_.sizes(),
      " and values (B, Hkv, max_len, Dv)=", value_storage_.sizes());
  if (quantized()) {
    const at::ScalarType dtype = keys.scalar_type();
    TORCH_CHECK_TYPE(values.scalar_type() == dtype &&
                         (dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf),
                     "KVCache: the new keys and values must be float32, bfloat16 or float16, one "
                     "dtype, to be quantized into the cache's ",
                     key_storage_.scalar_type(), ", got keys.dtype=", keys.scalar_type(),
                     ", values.dtype=", values.scalar_type());
    TORCH_CHECK_NOT_IMPLEMENTED(!key_mask.has_value(), "KVCache: a key_mask with ",
                                key_storage_.scalar_type(),
                                " storage is not supported (the attention on 8-bit keys and "
                                "values takes no mask); decode unpadded prompts, or use a float "
                                "cache");
    for (const auto& [name, t] : {std::pair<const char*, const at::Tensor&>{"keys", keys},
                                  std::pair<const char*, const at::Tensor&>{"values", values}}) {
      TORCH_CHECK_VALUE(at::isfinite(t).all().item<bool>(), "KVCache: the new ", name,
                        " must be finite to be quantized into the cache's ",
                        key_storage_.scalar_type(), ", got NaN or inf");
    }
  } else {
    TORCH_CHECK_TYPE(keys.scalar_type() == key_storage_.scalar_type() &&
                         values.scalar_type() == key_storage_.scalar_type(),
                     "KVCache: the new keys and values must have the cache's dtype ",
                     key_storage_.scalar_type(), ", got keys.dtype=", keys.scalar_type(),
                     ", values.dtype=", values.scalar_type());
  }
  TORCH_CHECK_VALUE(
      keys.device() == key_storage_.device() && values.device() == key_storage_.device(),
      "KVCache: the new keys and values must be on the cache's device ", key_storage_.device(),
      ", got keys.device=", keys.device(), ", values.device=", values.device());
  const int64_t added = keys.size(2);
  if (key_mask.has_value()) {
    const at::Tensor& mask = *key_mask;
    TORCH_CHECK_TYPE(mask.defined(), "KVCache: key_mask must be a defined bool tensor or nullopt");
    TORCH_CHECK_TYPE(mask.scalar_type() == at::kBool,
                     "KVCache: key_mask must be a bool tensor (true for real tokens), got "
                     "key_mask.dtype=",
                     mask.scalar_type());
    TORCH_CHECK_VALUE(mask.dim() == 2 && mask.size(0) == keys.size(0) && mask.size(1) == added,
                      "KVCache: key_mask must be (B, L)=", at::IntArrayRef({keys.size(0), added}),
                      " of the new keys, got key_mask.shape=", mask.sizes());
    TORCH_CHECK_VALUE(mask.device() == mask_storage_.device(),
                      "KVCache: key_mask must be on the cache's device ", mask_storage_.device(),
                      ", got key_mask.device=", mask.device());
  }
  TORCH_CHECK_VALUE(length_ + added <= max_len(), "KVCache: cannot append ", added,
                    " positions to a cache holding ", length_, " of max_len=", max_len(),
                    "; reset() it or make a larger cache");
  if (quantized()) {
    write_quantized(keys, key_storage_, key_scale_storage_);
    write_quantized(values, value_storage_, value_scale_storage_);
    length_ += added;
    // No copies for autograd: quantized values carry no gradient (inference only).
    return {this->keys(), this->values(), std::nullopt};
  }
  key_storage_.narrow(2, length_, added).copy_(keys);
  value_storage_.narrow(2, length_, added).copy_(values);
  // Written on every append, a nullopt mask included: a later masked step attends with the mask
  // of every cached position, and storage from before a reset must not leak into it.
  if (key_mask.has_value()) {
    mask_storage_.narrow(1, length_, added).copy_(*key_mask);
    has_key_mask_ = true;
  } else {
    mask_storage_.narrow(1, length_, added).fill_(true);
  }
  length_ += added;
  std::optional<at::Tensor> cached_mask = this->key_mask();
  if (at::GradMode::is_enabled() && (keys.requires_grad() || values.requires_grad())) {
    // The mask too: ops that save it for backward must not see a later reset's writes.
    if (cached_mask.has_value()) {
      cached_mask = cached_mask->clone();
    }
    return {this->keys().clone(), this->values().clone(), cached_mask};
  }
  return {this->keys(), this->values(), cached_mask};
}

void KVCache::write_quantized(const at::Tensor& added, at::Tensor& storage,
                              at::Tensor& scale_storage) {
  const at::ScalarType dtype = storage.scalar_type();
  at::Tensor scale = scale_storage;
  if (*scales_ == ScaleLayout::kToken) {
    scale = token_scales(added, dtype);  // (B, Hkv, L)
    scale_storage.narrow(2, length_, added.size(2)).copy_(scale);
    scale = scale.unsqueeze(-1);
  }
  storage.narrow(2, length_, added.size(2)).copy_(quantize(added, scale, dtype));
}

}  // namespace causal_attention::nn
