// Helpers shared by the CausalSelfAttention and KVCache GoogleTest files: the module's own
// projections computed apart (for references that attend between them), and the assertion that a
// refused call left a cache as it was.
#pragma once

#include "causal_attention/nn.h"

#include "../attention_test_utils.h"

#include <torch/nn/functional/linear.h>

#include <initializer_list>
#include <optional>
#include <vector>

namespace causal_attention::tests {

// q (B, Hq, L, D), k (B, Hkv, L, D) and v (B, Hkv, L, Dv) of x, projected by c_attn of `module`.
inline std::vector<at::Tensor> project_heads(nn::CausalSelfAttention& module, const at::Tensor& x) {
  namespace F = torch::nn::functional;
  const nn::CausalSelfAttentionOptions& o = module->options;
  const int64_t batch = x.size(0), len = x.size(1);
  const int64_t heads = o.num_heads(), kv_heads = *o.num_kv_heads();
  const int64_t dim = *o.head_dim(), value_dim = *o.value_head_dim();
  const auto qkv = F::linear(x, module->c_attn->weight, module->c_attn->bias)
                       .split_with_sizes({heads * dim, kv_heads * dim, kv_heads * value_dim}, -1);
  const auto split_heads = [&](const at::Tensor& t, int64_t h, int64_t d) {
    return t.reshape({batch, len, h, d}).transpose(1, 2);
  };
  return {split_heads(qkv[0], heads, dim), split_heads(qkv[1], kv_heads, dim),
          split_heads(qkv[2], kv_heads, value_dim)};
}

// c_proj of `module` on the attended heads y (B, Hq, L, Dv).
inline at::Tensor project_output(nn::CausalSelfAttention& module, const at::Tensor& y) {
  return torch::nn::functional::linear(y.transpose(1, 2).flatten(2), module->c_proj->weight,
                                       module->c_proj->bias);
}

// Asserts that fn throws E with every needle in its message and leaves the cache as it was: its
// length, keys, values, key mask and (8-bit) scales.
template <typename E, typename Fn>
void expect_cache_unchanged_after_error(Fn fn, nn::KVCache& cache,
                                        std::initializer_list<const char*> needles) {
  const auto saved = [](const std::optional<at::Tensor>& t) {
    return t ? std::optional<at::Tensor>(t->clone()) : std::nullopt;
  };
  const auto expect_same = [](const std::optional<at::Tensor>& now,
                              const std::optional<at::Tensor>& before) {
    ASSERT_EQ(now.has_value(), before.has_value());
    if (before) {
      EXPECT_TRUE(now->equal(*before));
    }
  };
  const int64_t length = cache.length();
  const at::Tensor keys = cache.keys().clone(), values = cache.values().clone();
  const std::optional<at::Tensor> key_mask = saved(cache.key_mask()),
                                  key_scales = saved(cache.key_scales()),
                                  value_scales = saved(cache.value_scales());
  expect_error<E>(fn, needles);
  EXPECT_EQ(cache.length(), length);
  EXPECT_TRUE(cache.keys().equal(keys));
  EXPECT_TRUE(cache.values().equal(values));
  expect_same(cache.key_mask(), key_mask);
  expect_same(cache.key_scales(), key_scales);
  expect_same(cache.value_scales(), value_scales);
}

}  // namespace causal_attention::tests
