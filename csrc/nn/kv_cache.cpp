// The KV cache of CausalSelfAttention: preallocated storage written in place, so that decoding
// one position costs no reallocation and no copy of the positions already cached.
#include "causal_attention/nn.h"

#include <ATen/core/grad_mode.h>
#include <ATen/ops/ones.h>
#include <c10/util/Exception.h>

#include <utility>

namespace causal_attention::nn {

KVCache::KVCache(at::Tensor key_storage, at::Tensor value_storage)
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
  TORCH_CHECK_TYPE(keys.scalar_type() == key_storage_.scalar_type() &&
                       values.scalar_type() == key_storage_.scalar_type(),
                   "KVCache: the new keys and values must have the cache's dtype ",
                   key_storage_.scalar_type(), ", got keys.dtype=", keys.scalar_type(),
                   ", values.dtype=", values.scalar_type());
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

}  // namespace causal_attention::nn
