// causal_attention::nn::KVCache with 8-bit storage (float8_e4m3fn, float8_e5m2, int8), scales per
// token and KV head or per tensor: CausalSelfAttention decoding from it equals the attention in
// float64 on the cache dequantized after each step, with the score options too; each token is
// stored at its own scale (its largest |x| stores as the format's largest), given scales
// saturate, and every misuse throws a typed error, an append's leaving the cache unchanged.
#include "causal_attention/nn.h"

#include "../attention_test_utils.h"
#include "module_test_utils.h"

#include <limits>
#include <string>
#include <tuple>
#include <vector>

namespace causal_attention::tests {
namespace {

using nn::CausalSelfAttention;
using nn::CausalSelfAttentionOptions;
using nn::KVCache;
using nn::ScaleLayout;

// The cache's keys or values as float64: stored value x scale.
at::Tensor dequantized(const at::Tensor& stored, const at::Tensor& scales) {
  const at::Tensor scale = scales.dim() == 0 ? scales : scales.unsqueeze(-1);
  return stored.to(at::kDouble) * scale.to(at::kDouble);
}

// The module's output for the queries of x against the cache as it holds them now: the op's
// attention in float64 on the dequantized cache with the module's score options, then c_proj.
at::Tensor expected_output(CausalSelfAttention& module, const at::Tensor& x, const KVCache& cache) {
  const CausalSelfAttentionOptions& o = module->options;
  AttentionOptions options = AttentionOptions().window(o.window()).softcap(o.softcap());
  if (module->alibi_slopes.defined()) {
    options.alibi_slopes(module->alibi_slopes);
  }
  if (module->sinks.defined()) {
    options.sinks(module->sinks.to(at::kDouble));
  }
  const at::Tensor attended = attention(
      project_heads(module, x)[0].to(at::kDouble), dequantized(cache.keys(), *cache.key_scales()),
      dequantized(cache.values(), *cache.value_scales()), options);
  return project_output(module, attended.to(at::kFloat));
}

struct CacheConfig {
  std::string name;
  at::ScalarType dtype;
  ScaleLayout scales;
  CausalSelfAttentionOptions options;
};

std::vector<CacheConfig> cache_configs() {
  const auto base = [] {
    return CausalSelfAttentionOptions(24, 4).num_kv_heads(2).value_head_dim(5);
  };
  const auto all = base().window({15, 0}).softcap(0.5).sinks(true).alibi(true);
  std::vector<CacheConfig> configs;
  for (const auto& [format, dtype] : std::vector<std::pair<std::string, at::ScalarType>>{
           {"E4m3", at::kFloat8_e4m3fn}, {"E5m2", at::kFloat8_e5m2}, {"Int8", at::kChar}}) {
    configs.push_back({format + "Token", dtype, ScaleLayout::kToken, base()});
    configs.push_back({format + "Tensor", dtype, ScaleLayout::kTensor, base()});
    configs.push_back({format + "TokenEveryOption", dtype, ScaleLayout::kToken, all});
  }
  return configs;
}

class FromAQuantizedCache : public ::testing::TestWithParam<CacheConfig> {};

// 40 positions in chunks (a prompt, single steps, longer ones): past the window of 16 and far
// enough for ALiBi's bias to matter. Each step's output within float32's rounding of the float64
// attention on the cache dequantized after it; the storage one byte a value.
TEST_P(FromAQuantizedCache, DecodingEqualsTheAttentionOnTheDequantizedCache) {
  const CacheConfig& config = GetParam();
  CausalSelfAttention module(config.options);
  torch::NoGradGuard no_grad;
  if (module->sinks.defined()) {
    module->sinks.normal_();
  }
  const at::Tensor x = torch::randn({2, 40, 24});
  const bool per_tensor = config.scales == ScaleLayout::kTensor;
  KVCache cache = module->make_cache(2, 40, config.dtype, config.scales,
                                     per_tensor ? std::optional<double>(0.01) : std::nullopt,
                                     per_tensor ? std::optional<double>(0.02) : std::nullopt);
  EXPECT_TRUE(cache.quantized());
  int64_t start = 0;
  for (const int64_t size : {9, 1, 1, 13, 1, 15}) {
    const at::Tensor chunk = x.narrow(1, start, size);
    const at::Tensor out = module(chunk, &cache);
    const at::Tensor expected = expected_output(module, chunk, cache);
    EXPECT_LE(max_abs_diff(out, expected), 1e-5 * std::max(1.0, max_abs(expected)))
        << "after " << start + size << " positions";
    start += size;
  }
  EXPECT_EQ(cache.length(), 40);
  EXPECT_EQ(cache.keys().scalar_type(), config.dtype);
  EXPECT_EQ(cache.keys().element_size(), 1);
  EXPECT_EQ(cache.key_scales()->dim(), per_tensor ? 0 : 3);
}

INSTANTIATE_TEST_SUITE_P(Formats, FromAQuantizedCache, ::testing::ValuesIn(cache_configs()),
                         [](const auto& info) { return info.param.name; });

// A cache of one sequence, one KV head and head dim 4 of `dtype`, scales per token.
KVCache small_cache(at::ScalarType dtype, std::optional<ScaleLayout> scales = std::nullopt,
                    std::optional<double> k_scale = std::nullopt,
                    std::optional<double> v_scale = std::nullopt) {
  const auto options = at::TensorOptions().dtype(dtype);
  return KVCache(at::zeros({1, 1, 8, 4}, options), at::zeros({1, 1, 8, 4}, options), scales,
                 k_scale, v_scale);
}

TEST(QuantizedKVCache, EachTokenIsStoredAtItsOwnScale) {
  const at::Tensor keys =
      torch::tensor({0.5f, -2.0f, 0.25f, 1.0f, 0.0f, 0.0f, 0.0f, 0.0f, 3.0f, 0.001f, -0.7f, 2.9f})
          .view({1, 1, 3, 4});
  for (const auto& [dtype, largest] : std::vector<std::pair<at::ScalarType, double>>{
           {at::kFloat8_e4m3fn, 448.0}, {at::kFloat8_e5m2, 57344.0}, {at::kChar, 127.0}}) {
    KVCache cache = small_cache(dtype);
    cache.append(keys, keys);
    const at::Tensor scales = *cache.key_scales();
    // the rows' largest |x| over the format's largest; 1 for the row of zeros
    const at::Tensor expected_scales =
        torch::tensor({2.0f, 0.0f, 3.0f}).div(largest).view({1, 1, 3});
    expected_scales.select(2, 1).fill_(1.0f);
    EXPECT_TRUE(scales.equal(expected_scales)) << scales;
    const at::Tensor stored = cache.keys().to(at::kDouble);
    EXPECT_EQ(stored.abs().amax(-1)[0][0][0].item<double>(), largest);
    EXPECT_EQ(stored.abs().amax(-1)[0][0][2].item<double>(), largest);
    EXPECT_TRUE(stored.select(2, 1).eq(0).all().item<bool>());
    const at::Tensor error = (dequantized(cache.keys(), scales) - keys.to(at::kDouble)).abs();
    if (dtype == at::kChar) {  // round to nearest: within half a step of the row's scale
      EXPECT_TRUE(error.le(scales.to(at::kDouble).unsqueeze(-1) * (0.5 + 1e-6)).all().item<bool>())
          << error;
    } else {  // float8: within half a unit in the last place, relative (3 or 2 mantissa bits)
      const double relative = dtype == at::kFloat8_e4m3fn ? 1.0 / 16 : 1.0 / 8;
      EXPECT_TRUE(
          error.le(keys.to(at::kDouble).abs() * relative + 1e-3 * scales.max().item<double>())
              .all()
              .item<bool>())
          << error;
    }
    EXPECT_TRUE(cache.values().equal(cache.keys()));
  }
}

TEST(QuantizedKVCache, GivenScalesSaturateAtTheFormatsLargestValue) {
  const at::Tensor keys = torch::tensor({1e6f, -1e6f, 1.0f, 0.0f}).view({1, 1, 1, 4});
  for (const auto& [dtype, largest] : std::vector<std::pair<at::ScalarType, double>>{
           {at::kFloat8_e4m3fn, 448.0}, {at::kFloat8_e5m2, 57344.0}, {at::kChar, 127.0}}) {
    KVCache cache = small_cache(dtype, ScaleLayout::kTensor, 0.5, 0.25);
    cache.append(keys, keys);
    EXPECT_EQ(cache.key_scales()->item<float>(), 0.5f);
    EXPECT_EQ(cache.value_scales()->item<float>(), 0.25f);
    const at::Tensor stored = cache.keys().to(at::kDouble).flatten();
    EXPECT_EQ(stored[0].item<double>(), largest);
    EXPECT_EQ(stored[1].item<double>(), -largest);
    EXPECT_EQ(stored[2].item<double>(), 2.0);
    EXPECT_EQ(cache.values().to(at::kDouble).flatten()[2].item<double>(), 4.0);
  }
}

TEST(QuantizedKVCache, BadStorageAndScalesThrowValueError) {
  expect_error<c10::ValueError>([] { small_cache(at::kFloat, ScaleLayout::kToken); },
                                {"scales, k_scale and v_scale are for 8-bit storage", "Float"});
  expect_error<c10::ValueError>([] { small_cache(at::kBFloat16, std::nullopt, 2.0); },
                                {"for 8-bit storage"});
  expect_error<c10::ValueError>([] { small_cache(at::kChar, ScaleLayout::kToken, 2.0); },
                                {"k_scale and v_scale are the scales of ScaleLayout::kTensor"});
  for (const double bad : {0.0, -1.0, std::numeric_limits<double>::infinity(),
                           std::numeric_limits<double>::quiet_NaN(), 1e39, 1e-50}) {
    expect_error<c10::ValueError>(
        [&] { small_cache(at::kFloat8_e4m3fn, ScaleLayout::kTensor, bad); },
        {"k_scale must be positive and finite (in float32)"});
    expect_error<c10::ValueError>([&] { small_cache(at::kChar, ScaleLayout::kTensor, 1.0, bad); },
                                  {"v_scale must be positive and finite (in float32)"});
  }
}

TEST(QuantizedKVCache, MisuseThrowsTypedErrorsAndLeavesTheCacheUnchanged) {
  KVCache cache = small_cache(at::kChar);
  cache.append(torch::randn({1, 1, 2, 4}), torch::randn({1, 1, 2, 4}));
  const at::Tensor good = torch::randn({1, 1, 1, 4});
  expect_cache_unchanged_after_error<c10::NotImplementedError>(
      [&] { cache.append(good, good, torch::ones({1, 1}, torch::kBool)); }, cache,
      {"a key_mask with Char storage is not supported"});
  at::Tensor bad = good.clone();
  bad[0][0][0][2] = std::numeric_limits<float>::quiet_NaN();
  expect_cache_unchanged_after_error<c10::ValueError>(
      [&] { cache.append(bad, good); }, cache, {"the new keys must be finite", "NaN or inf"});
  bad[0][0][0][2] = std::numeric_limits<float>::infinity();
  expect_cache_unchanged_after_error<c10::ValueError>([&] { cache.append(good, bad); }, cache,
                                                      {"the new values must be finite"});
  expect_cache_unchanged_after_error<c10::TypeError>(
      [&] { cache.append(good.to(at::kDouble), good.to(at::kDouble)); }, cache,
      {"must be float32, bfloat16 or float16, one dtype", "keys.dtype=Double"});
  expect_cache_unchanged_after_error<c10::TypeError>(
      [&] { cache.append(good, good.to(at::kHalf)); }, cache, {"values.dtype=Half"});
  cache.append(good.to(at::kBFloat16), good.to(at::kBFloat16));  // still usable
  EXPECT_EQ(cache.length(), 3);
}

TEST(QuantizedKVCache, TheModuleDecodesFromItInInferenceOnly) {
  CausalSelfAttention module(CausalSelfAttentionOptions(24, 4).num_kv_heads(2).attn_dropout(0.1));
  KVCache cache = module->make_cache(2, 8, at::kFloat8_e4m3fn);
  const at::Tensor x = torch::randn({2, 3, 24});
  expect_cache_unchanged_after_error<c10::NotImplementedError>(
      [&] { module(x, &cache); }, cache, {"attn_dropout in training", "call eval()"});
  module->eval();
  // The parameters require grad: outside NoGradGuard the call would record.
  expect_cache_unchanged_after_error<c10::NotImplementedError>(
      [&] { module(x, &cache); }, cache, {"inference only", "torch::NoGradGuard"});
  torch::NoGradGuard no_grad;
  expect_cache_unchanged_after_error<c10::NotImplementedError>(
      [&] { module(x, &cache, torch::ones({2, 3}, torch::kBool)); }, cache,
      {"key_mask with an 8-bit KVCache is not supported"});
  expect_cache_unchanged_after_error<c10::NotImplementedError>(
      [&] { module(x, &cache, std::nullopt, torch::ones({3, 3}, torch::kBool)); }, cache,
      {"attn_mask with an 8-bit KVCache is not supported"});
  expect_cache_unchanged_after_error<c10::NotImplementedError>(
      [&] { module->forward_with_weights(x, &cache); }, cache,
      {"attention weights from an 8-bit KVCache are not supported"});
  EXPECT_EQ(module(x, &cache).sizes(), x.sizes());
  EXPECT_EQ(cache.length(), 3);
}

}  // namespace
}  // namespace causal_attention::tests
