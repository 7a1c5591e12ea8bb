// causal_attention::nn: CausalSelfAttention equals torch::nn::MultiheadAttention with a causal
// mask and a nanoGPT-style reference on its own parameters, in output and every gradient, across
// GQA, Dv != D, no bias, three dtypes and with a key mask; with every score option (windows,
// softcap, sinks, ALiBi) it equals a materialized reference, the sinks' gradient included, and
// attention dropout trains with the op's mask and evaluates exactly; dtype conversions keep the
// ALiBi slopes float32; KV-cache decoding equals the full forward, with the options too, a
// left-padded batch of prompts decodes as each prompt alone, and every misuse throws a typed
// error; attention_weights equals a naive softmax.
#include "causal_attention/nn.h"

#include "../attention_test_utils.h"
#include "module_test_utils.h"

#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/modulelist.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

namespace causal_attention::tests {
namespace {

using nn::CausalSelfAttention;
using nn::CausalSelfAttentionOptions;
using nn::KVCache;

// nanoGPT's computation, with SDPA, on the parameters of `module`. With key_mask (B, L), SDPA gets
// causality and the key mask as one boolean attn_mask (a row that sees no key gives zeros there,
// as in our op).
at::Tensor nanogpt_reference(CausalSelfAttention& module, const at::Tensor& x,
                             const std::optional<at::Tensor>& key_mask = std::nullopt) {
  const auto heads = project_heads(module, x);
  const int64_t batch = x.size(0), len = x.size(1);
  std::optional<at::Tensor> visible;
  if (key_mask.has_value()) {
    visible = bottom_right_mask(len, len).logical_and(key_mask->view({batch, 1, 1, len}));
  }
  const at::Tensor y =
      at::scaled_dot_product_attention(heads[0], heads[1], heads[2], visible, /*dropout_p=*/0.0,
                                       /*is_causal=*/!visible.has_value(), /*scale=*/std::nullopt,
                                       /*enable_gqa=*/heads[0].size(1) != heads[1].size(1));
  return project_output(module, y);
}

// The module's computation with its score options, the attention materialized as nanoGPT does
// without flash attention, extended as the models that have each option do it: Gemma 2's
// softcap * tanh(S / softcap), ALiBi's -slope * |i - j|, gpt-oss's sinks as an extra softmax
// column that is then dropped. With `keep` (B, Hq, L, L), the probabilities it is false at are
// dropped and the rest scaled by 1 / (1 - dropout_p). Independent of the op.
at::Tensor materialized_reference(CausalSelfAttention& module, const at::Tensor& x,
                                  const std::optional<at::Tensor>& key_mask = std::nullopt,
                                  const std::optional<at::Tensor>& keep = std::nullopt,
                                  double dropout_p = 0.0) {
  const CausalSelfAttentionOptions& o = module->options;
  const auto heads = project_heads(module, x);
  const int64_t batch = x.size(0), len = x.size(1), num_heads = o.num_heads();
  at::Tensor scores = at::matmul(heads[0], expand_kv_heads(heads[1], num_heads).transpose(-2, -1))
                          .mul(default_scale(heads[0]));
  if (o.softcap().has_value()) {
    scores = *o.softcap() * at::tanh(scores / *o.softcap());
  }
  const at::Tensor rows = torch::arange(len).unsqueeze(-1), keys = torch::arange(len);
  if (module->alibi_slopes.defined()) {
    scores = scores - module->alibi_slopes.to(scores.scalar_type()).view({num_heads, 1, 1}) *
                          (rows - keys).abs();
  }
  at::Tensor visible = torch::ones({len, len}, torch::kBool);
  const auto [left, right] = o.window();
  if (left >= 0) {
    visible = visible.logical_and(keys >= rows - left);
  }
  if (right >= 0) {
    visible = visible.logical_and(keys <= rows + right);
  }
  if (key_mask.has_value()) {
    visible = visible.logical_and(key_mask->view({batch, 1, 1, len}));
  }
  // Rows without keys get finite dummy scores (zeroed below), so that neither the softmax nor
  // its gradient sees a row of -inf.
  const at::Tensor no_key = visible.logical_not().all(-1, /*keepdim=*/true);
  scores = scores.masked_fill(visible.logical_not(), -std::numeric_limits<double>::infinity())
               .masked_fill(no_key, 0.0);
  at::Tensor probs;
  if (module->sinks.defined()) {
    const at::Tensor sink = module->sinks.view({1, num_heads, 1, 1}).expand({batch, -1, len, 1});
    probs = at::cat({scores, sink}, -1).softmax(-1).narrow(-1, 0, len);
  } else {
    probs = scores.softmax(-1);
  }
  probs = probs.masked_fill(no_key, 0.0);
  if (keep.has_value()) {
    probs = probs * *keep / (1.0 - dropout_p);
  }
  return project_output(module, at::matmul(probs, expand_kv_heads(heads[2], num_heads)));
}

// The output of fn(x) and the gradients under grad_out of x (first) and of `params`.
template <typename Fn>
std::vector<at::Tensor> output_and_grads(Fn fn, const at::Tensor& x, const at::Tensor& grad_out,
                                         const std::vector<at::Tensor>& params) {
  const at::Tensor leaf = x.detach().requires_grad_(true);
  const at::Tensor out = fn(leaf);
  std::vector<at::Tensor> inputs{leaf};
  inputs.insert(inputs.end(), params.begin(), params.end());
  std::vector<at::Tensor> results = torch::autograd::grad({out}, inputs, {grad_out});
  results.insert(results.begin(), out.detach());
  return results;
}

struct ModuleConfig {
  std::string name;
  CausalSelfAttentionOptions options;
};

std::vector<ModuleConfig> module_configs() {
  return {
      {"Mha", CausalSelfAttentionOptions(32, 4)},
      {"Gqa", CausalSelfAttentionOptions(32, 4).num_kv_heads(2)},
      {"MqaD10Dv6",
       CausalSelfAttentionOptions(24, 4).num_kv_heads(1).head_dim(10).value_head_dim(6)},
      {"NoBias", CausalSelfAttentionOptions(24, 3).bias(false)},
  };
}

// Bool (2, len): the first row left-padded by 13; the second right-padded by 9 with hidden
// positions in between, its first rows seeing no key.
at::Tensor padding_and_holes(int64_t len) {
  at::Tensor mask = torch::ones({2, len}, torch::kBool);
  mask[0].narrow(0, 0, 13).fill_(false);
  mask[1].narrow(0, 0, 3).fill_(false);
  mask[1].narrow(0, 20, 5).fill_(false);
  mask[1].narrow(0, len - 9, 9).fill_(false);
  return mask;
}

class AgainstNanoGptReference : public ::testing::TestWithParam<ModuleConfig> {};

// In float64 tightly; in float32 and bfloat16 at most twice as far from the float64 answer as
// the reference computed in the same dtype; without and with a key mask. The dtypes share one
// test (one process under ctest).
TEST_P(AgainstNanoGptReference, OutputAndEveryGradientInEachDtype) {
  const CausalSelfAttentionOptions& options = GetParam().options;
  for (const auto& [dtype, key_mask] :
       std::vector<std::pair<at::ScalarType, std::optional<at::Tensor>>>{
           {at::kDouble, std::nullopt},
           {at::kFloat, std::nullopt},
           {at::kBFloat16, std::nullopt},
           {at::kDouble, padding_and_holes(70)},
           {at::kFloat, padding_and_holes(70)},
           {at::kBFloat16, padding_and_holes(70)}}) {
    SCOPED_TRACE(std::string(c10::toString(dtype)) + (key_mask ? ", key mask" : ""));
    CausalSelfAttention module(options);
    module->to(dtype);
    auto module64 = std::dynamic_pointer_cast<nn::CausalSelfAttentionImpl>(module->clone());
    module64->to(at::kDouble);
    CausalSelfAttention reference64(module64);

    const at::Tensor x = torch::randn({2, 70, options.embed_dim()}, at::kDouble).to(dtype);
    const at::Tensor grad_out = torch::randn(x.sizes(), at::kDouble).to(dtype);
    const auto ours =
        output_and_grads([&](const at::Tensor& t) { return module(t, nullptr, key_mask); }, x,
                         grad_out, module->parameters());
    const auto same_dtype = output_and_grads(
        [&](const at::Tensor& t) { return nanogpt_reference(module, t, key_mask); }, x, grad_out,
        module->parameters());
    const auto exact = output_and_grads(
        [&](const at::Tensor& t) { return nanogpt_reference(reference64, t, key_mask); },
        x.to(at::kDouble), grad_out.to(at::kDouble), reference64->parameters());
    if (key_mask.has_value() && dtype == at::kDouble) {
      // The mask must matter, or this would be the unmasked case again.
      EXPECT_GT(max_abs_diff(exact[0], nanogpt_reference(reference64, x.to(at::kDouble))), 1e-2);
    }

    ASSERT_EQ(ours.size(), 2 + module->parameters().size());
    EXPECT_EQ(ours[0].scalar_type(), dtype);
    for (size_t i = 0; i < ours.size(); ++i) {
      SCOPED_TRACE(i == 0   ? "output"
                   : i == 1 ? "grad x"
                            : "grad of parameter " + std::to_string(i - 2));
      const double error = max_abs_diff(ours[i], exact[i]);
      if (dtype == at::kDouble) {
        EXPECT_LE(error, 1e-10);
      } else {
        // Plus one rounding to the dtype at the largest magnitude: where the reference's final
        // rounding happens to land near the exact value, ours may round to the neighbour (a
        // bfloat16 weight gradient once erred by 0.05279 against a bound of 0.05276 without it);
        // and sums over many positions (bias gradients) round differently with the memory
        // alignment of their operands.
        // bfloat16's unit roundoff is 2^-8; float32's (2^-24) is below the alignment slack.
        const double relative_slack = dtype == at::kBFloat16 ? 0x1p-8 : 1e-6;
        EXPECT_LE(error, 2 * max_abs_diff(same_dtype[i], exact[i]) +
                             relative_slack * std::max(1.0, max_abs(exact[i])));
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Configs, AgainstNanoGptReference, ::testing::ValuesIn(module_configs()),
                         [](const auto& info) { return info.param.name; });

class AgainstMultiheadAttention : public ::testing::TestWithParam<bool> {};

TEST_P(AgainstMultiheadAttention, OutputGradientsAndWeights) {
  const bool bias = GetParam();
  const int64_t embed_dim = 32, heads = 4, len = 19;
  CausalSelfAttention module(CausalSelfAttentionOptions(embed_dim, heads).bias(bias));
  torch::nn::MultiheadAttention mha(
      torch::nn::MultiheadAttentionOptions(embed_dim, heads).bias(bias));
  module->to(at::kDouble);
  mha->to(at::kDouble);
  {
    torch::NoGradGuard no_grad;
    mha->in_proj_weight.copy_(module->c_attn->weight);
    mha->out_proj->weight.copy_(module->c_proj->weight);
    if (bias) {
      mha->in_proj_bias.copy_(module->c_attn->bias);
      mha->out_proj->bias.copy_(module->c_proj->bias);
    }
  }
  // The C++ module adds attn_mask to the scores (a bool mask is not a mask there).
  const at::Tensor causal_mask = torch::zeros({len, len}, at::kDouble)
                                     .masked_fill(bottom_right_mask(len, len).logical_not(),
                                                  -std::numeric_limits<double>::infinity());
  // torch::nn::MultiheadAttention takes (L, B, E).
  const auto mha_forward = [&](const at::Tensor& x, bool need_weights) {
    const at::Tensor seq_first = x.transpose(0, 1);
    auto [out, weights] =
        mha->forward(seq_first, seq_first, seq_first, /*key_padding_mask=*/at::Tensor(),
                     need_weights, causal_mask, /*average_attn_weights=*/false);
    return std::make_pair(out.transpose(0, 1), weights);
  };

  const at::Tensor x = torch::randn({3, len, embed_dim}, at::kDouble);
  const at::Tensor grad_out = torch::randn(x.sizes(), at::kDouble);
  std::vector<at::Tensor> module_params{module->c_attn->weight, module->c_proj->weight};
  std::vector<at::Tensor> mha_params{mha->in_proj_weight, mha->out_proj->weight};
  if (bias) {
    module_params.insert(module_params.end(), {module->c_attn->bias, module->c_proj->bias});
    mha_params.insert(mha_params.end(), {mha->in_proj_bias, mha->out_proj->bias});
  }
  const auto ours =
      output_and_grads([&](const at::Tensor& t) { return module(t); }, x, grad_out, module_params);
  const auto theirs = output_and_grads(
      [&](const at::Tensor& t) { return mha_forward(t, false).first; }, x, grad_out, mha_params);
  ASSERT_EQ(ours.size(), theirs.size());
  for (size_t i = 0; i < ours.size(); ++i) {
    EXPECT_LE(max_abs_diff(ours[i], theirs[i]), 1e-10) << "result " << i;
  }

  torch::NoGradGuard no_grad;
  const auto [out, weights] = module->forward_with_weights(x);
  EXPECT_LE(max_abs_diff(out, ours[0]), 1e-12);
  EXPECT_LE(max_abs_diff(weights, mha_forward(x, true).second), 1e-10);
}

INSTANTIATE_TEST_SUITE_P(Bias, AgainstMultiheadAttention, ::testing::Bool(),
                         [](const auto& info) { return info.param ? "Bias" : "NoBias"; });

TEST(CausalSelfAttentionOptions, DefaultsAreResolved) {
  CausalSelfAttention module(CausalSelfAttentionOptions(48, 6).num_kv_heads(2).value_head_dim(4));
  EXPECT_EQ(*module->options.num_kv_heads(), 2);
  EXPECT_EQ(*module->options.head_dim(), 8);
  EXPECT_EQ(*module->options.value_head_dim(), 4);
  EXPECT_EQ(module->c_attn->weight.sizes(), at::IntArrayRef({(6 + 2) * 8 + 2 * 4, 48}));
  EXPECT_EQ(module->c_proj->weight.sizes(), at::IntArrayRef({48, 6 * 4}));
  std::vector<std::string> names;
  for (const auto& item : module->named_parameters()) {
    names.push_back(item.key());
  }
  EXPECT_EQ(names, (std::vector<std::string>{"c_attn.weight", "c_attn.bias", "c_proj.weight",
                                             "c_proj.bias"}));
}

TEST(CausalSelfAttentionOptions, BadOptionsThrowValueError) {
  const auto make = [](const CausalSelfAttentionOptions& options) {
    return [options] { CausalSelfAttention module(options); };
  };
  expect_error<c10::ValueError>(make(CausalSelfAttentionOptions(0, 4)),
                                {"embed_dim and num_heads must be positive", "embed_dim=0"});
  expect_error<c10::ValueError>(make(CausalSelfAttentionOptions(32, 4).num_kv_heads(3)),
                                {"num_kv_heads must be a positive divisor", "num_kv_heads=3"});
  expect_error<c10::ValueError>(make(CausalSelfAttentionOptions(30, 4)),
                                {"multiple of num_heads", "embed_dim=30, num_heads=4"});
  expect_error<c10::ValueError>(make(CausalSelfAttentionOptions(32, 4).value_head_dim(0)),
                                {"value_head_dim=0"});
  expect_error<c10::ValueError>(make(CausalSelfAttentionOptions(32, 4).dropout(1.5)),
                                {"dropout must be in [0, 1]", "dropout=1.5"});
  // The op has no all-dropped case, unlike Dropout(1.0).
  expect_error<c10::ValueError>(make(CausalSelfAttentionOptions(32, 4).attn_dropout(1.0)),
                                {"attn_dropout must be in [0, 1)", "attn_dropout=1"});
  expect_error<c10::ValueError>(make(CausalSelfAttentionOptions(32, 4).attn_dropout(-0.1)),
                                {"attn_dropout=-0.1"});
  expect_error<c10::ValueError>(make(CausalSelfAttentionOptions(32, 4).window({-2, 0})),
                                {"window entries must be >= -1", "window=(-2, 0)"});
  expect_error<c10::ValueError>(make(CausalSelfAttentionOptions(32, 4).window({4, -3})),
                                {"window=(4, -3)"});
  for (const double softcap : {0.0, -1.0, std::numeric_limits<double>::infinity(),
                               std::numeric_limits<double>::quiet_NaN()}) {
    expect_error<c10::ValueError>(make(CausalSelfAttentionOptions(32, 4).softcap(softcap)),
                                  {"softcap must be finite and > 0"});
  }
  expect_error<c10::ValueError>([] { nn::alibi_slopes(0); },
                                {"alibi_slopes: num_heads must be positive", "num_heads=0"});
}

// (name, options): each score option binds on 40 positions (the test checks that it matters).
std::vector<ModuleConfig> score_option_configs() {
  const auto base = [] {
    return CausalSelfAttentionOptions(24, 4).num_kv_heads(2).value_head_dim(5);
  };
  return {
      {"SlidingWindow", base().window({15, 0})},
      {"Band", base().window({6, 3})},
      {"Bidirectional", base().window({-1, -1})},
      {"Softcap", base().softcap(0.25)},
      {"Sinks", base().sinks(true)},
      {"Alibi", base().alibi(true)},
      {"All", base().window({15, 0}).softcap(0.5).sinks(true).alibi(true)},
  };
}

// A module with `options` in `dtype`, its sinks (if any) drawn from N(0, 1): their zero
// initialization would test the gradient at one special point only.
CausalSelfAttention module_with(const CausalSelfAttentionOptions& options, at::ScalarType dtype) {
  CausalSelfAttention module(options);
  module->to(dtype);
  if (module->sinks.defined()) {
    torch::NoGradGuard no_grad;
    module->sinks.normal_();
  }
  return module;
}

class WithScoreOptions : public ::testing::TestWithParam<ModuleConfig> {};

// In float64 tightly and in float32 within float32's accuracy, without and with a key mask: the
// output and the gradients of x and of every parameter, the sinks included.
TEST_P(WithScoreOptions, MatchTheMaterializedReferenceInOutputAndEveryGradient) {
  for (const auto& [dtype, key_mask] :
       std::vector<std::pair<at::ScalarType, std::optional<at::Tensor>>>{
           {at::kDouble, std::nullopt},
           {at::kDouble, padding_and_holes(40)},
           {at::kFloat, padding_and_holes(40)}}) {
    SCOPED_TRACE(std::string(c10::toString(dtype)) + (key_mask ? ", key mask" : ""));
    CausalSelfAttention module = module_with(GetParam().options, dtype);
    auto module64 = std::dynamic_pointer_cast<nn::CausalSelfAttentionImpl>(module->clone());
    module64->to(at::kDouble);
    CausalSelfAttention reference64(module64);
    const at::Tensor x = torch::randn({2, 40, 24}, at::kDouble).to(dtype);
    const at::Tensor grad_out = torch::randn(x.sizes(), at::kDouble).to(dtype);

    const auto ours =
        output_and_grads([&](const at::Tensor& t) { return module(t, nullptr, key_mask); }, x,
                         grad_out, module->parameters());
    const auto exact = output_and_grads(
        [&](const at::Tensor& t) { return materialized_reference(reference64, t, key_mask); },
        x.to(at::kDouble), grad_out.to(at::kDouble), reference64->parameters());
    // The options must matter, or this would be the plain module again.
    EXPECT_GT(max_abs_diff(exact[0], nanogpt_reference(reference64, x.to(at::kDouble), key_mask)),
              1e-2);
    ASSERT_EQ(ours.size(), 2 + module->parameters().size());
    EXPECT_EQ(module->sinks.defined(), GetParam().options.sinks());
    for (size_t i = 0; i < ours.size(); ++i) {
      SCOPED_TRACE(i == 0   ? "output"
                   : i == 1 ? "grad x"
                            : "grad of parameter " + std::to_string(i - 2));
      const double bound = dtype == at::kDouble ? 1e-10 : 1e-4 * std::max(1.0, max_abs(exact[i]));
      EXPECT_LE(max_abs_diff(ours[i], exact[i]), bound);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Options, WithScoreOptions, ::testing::ValuesIn(score_option_configs()),
                         [](const auto& info) { return info.param.name; });

TEST(CausalSelfAttention, AttentionDropoutTrainsWithTheOpMaskAndEvaluatesExactly) {
  const double p = 0.3;
  CausalSelfAttention module = module_with(
      CausalSelfAttentionOptions(32, 4).num_kv_heads(2).window({7, 0}).sinks(true).attn_dropout(p),
      at::kDouble);
  const at::Tensor x = torch::randn({2, 12, 32}, at::kDouble);
  const at::Tensor grad_out = torch::randn(x.sizes(), at::kDouble);
  module->train();
  torch::manual_seed(5);
  const auto ours = output_and_grads([&](const at::Tensor& t) { return module(t); }, x, grad_out,
                                     module->parameters());
  // The mask of the op's dropout after the same seed: (seed, offset) drawn from the default
  // generator as the op draws them, and its counter-based keep mask of the scores' shape.
  torch::manual_seed(5);
  const at::Tensor dropout_seed = at::empty({2}, at::kLong).random_();
  const at::Tensor keep = causal_attention::dropout_keep_mask(
      dropout_seed, c10::fromIntArrayRefSlow({2, 4, 12, 12}), p);
  const double dropped = 1.0 - keep.to(at::kDouble).mean().item<double>();
  EXPECT_GT(dropped, 0.2);
  EXPECT_LT(dropped, 0.4);
  const auto exact = output_and_grads(
      [&](const at::Tensor& t) { return materialized_reference(module, t, std::nullopt, keep, p); },
      x, grad_out, module->parameters());
  // forward_with_weights draws the same mask and makes its output from the dropped weights.
  torch::manual_seed(5);
  const auto with_weights = output_and_grads(
      [&](const at::Tensor& t) { return std::get<0>(module->forward_with_weights(t)); }, x,
      grad_out, module->parameters());
  ASSERT_EQ(ours.size(), exact.size());
  for (size_t i = 0; i < ours.size(); ++i) {
    SCOPED_TRACE("result " + std::to_string(i));
    EXPECT_LE(max_abs_diff(ours[i], exact[i]), 1e-10);
    EXPECT_LE(max_abs_diff(with_weights[i], exact[i]), 1e-10);
  }
  // Each call draws a new mask.
  EXPECT_GT(max_abs_diff(module(x), module(x)), 1e-3);

  // Evaluation attends exactly and draws nothing from the generator.
  module->eval();
  torch::manual_seed(9);
  torch::NoGradGuard no_grad;
  EXPECT_LE(max_abs_diff(module(x), materialized_reference(module, x)), 1e-10);
  const at::Tensor after_eval = torch::rand({4});
  torch::manual_seed(9);
  EXPECT_TRUE(torch::rand({4}).equal(after_eval));
}

TEST(CausalSelfAttentionOptions, AlibiSlopesAreTheGeometricSequenceAndItsInterpolation) {
  const auto powers_of_two = [](const std::vector<double>& exponents) {
    std::vector<float> slopes;
    for (const double e : exponents) {
      slopes.push_back(static_cast<float>(std::pow(2.0, -e)));
    }
    return torch::tensor(slopes);
  };
  const std::vector<double> exponents8{1, 2, 3, 4, 5, 6, 7, 8};
  EXPECT_TRUE(nn::alibi_slopes(8).equal(powers_of_two(exponents8)));
  // 12 heads: the 8 slopes of the power of two below, then every other slope of 16 heads.
  std::vector<double> exponents12 = exponents8;
  exponents12.insert(exponents12.end(), {0.5, 1.5, 2.5, 3.5});
  EXPECT_TRUE(nn::alibi_slopes(12).equal(powers_of_two(exponents12)));
  EXPECT_EQ(nn::alibi_slopes(1).item<float>(), 1.0f / 256);
}

TEST(CausalSelfAttentionOptions, SinksAndSlopesAreRegisteredAndDtypeConversionsKeepTheSlopes) {
  CausalSelfAttention module(CausalSelfAttentionOptions(48, 6).sinks(true).alibi(true));
  std::vector<std::string> parameters, buffers;
  for (const auto& item : module->named_parameters()) {
    parameters.push_back(item.key());
  }
  for (const auto& item : module->named_buffers()) {
    buffers.push_back(item.key());
  }
  EXPECT_EQ(parameters, (std::vector<std::string>{"sinks", "c_attn.weight", "c_attn.bias",
                                                  "c_proj.weight", "c_proj.bias"}));
  EXPECT_EQ(buffers, std::vector<std::string>{"alibi_slopes"});
  EXPECT_TRUE(module->sinks.equal(torch::zeros({6})));
  const at::Tensor slopes = nn::alibi_slopes(6);  // 6 heads: 2^-1.5 and others, inexact in bf16
  EXPECT_TRUE(module->alibi_slopes.equal(slopes));

  torch::nn::ModuleList parent(module);  // a parent's to() reaches the module's
  for (const at::ScalarType dtype : {at::kBFloat16, at::kHalf, at::kDouble}) {
    SCOPED_TRACE(c10::toString(dtype));
    if (dtype == at::kHalf) {
      module->to(torch::kCPU, dtype);
    } else if (dtype == at::kBFloat16) {
      parent->to(dtype);
    } else {
      module->to(dtype);
    }
    EXPECT_EQ(module->sinks.scalar_type(), dtype);
    EXPECT_EQ(module->alibi_slopes.scalar_type(), at::kFloat);
    EXPECT_TRUE(module->alibi_slopes.equal(slopes));
    torch::NoGradGuard no_grad;
    EXPECT_EQ(module(torch::randn({1, 5, 48}).to(dtype)).scalar_type(), dtype);
  }
  // clone() copies both.
  {
    torch::NoGradGuard no_grad;
    module->sinks.normal_();
  }
  const auto copy = std::dynamic_pointer_cast<nn::CausalSelfAttentionImpl>(module->clone());
  EXPECT_TRUE(copy->sinks.equal(module->sinks));
  EXPECT_TRUE(copy->alibi_slopes.equal(slopes));
  EXPECT_EQ(copy->named_buffers().size(), 1u);
}

TEST(CausalSelfAttention, BadInputThrowsTypedErrors) {
  CausalSelfAttention module(32, 4);
  expect_error<c10::ValueError>([&] { module(torch::randn({2, 5, 16})); },
                                {"x must be (B, L, E) with E=embed_dim=32", "[2, 5, 16]"});
  expect_error<c10::ValueError>([&] { module(torch::randn({5, 32})); }, {"x.shape=[5, 32]"});
  expect_error<c10::TypeError>([&] { module(torch::randn({2, 5, 32}, at::kDouble)); },
                               {"parameters' dtype Float", "x.dtype=Double"});
  // Before, an undefined x failed in x.dim() with a c10::Error that named no argument.
  expect_error<c10::TypeError>([&] { module(at::Tensor()); },
                               {"x must be a tensor (B, L, E), got an undefined tensor"});
  expect_error<c10::TypeError>([&] { module->forward_with_weights(at::Tensor()); },
                               {"CausalSelfAttention: x must be a tensor"});
  KVCache cache = module->make_cache(1, 4);
  expect_error<c10::TypeError>([&] { module(at::Tensor(), &cache); }, {"x must be a tensor"});
  EXPECT_EQ(cache.length(), 0);
}

TEST(CausalSelfAttention, DropoutActsOnTheOutputInTrainingOnly) {
  CausalSelfAttention module(CausalSelfAttentionOptions(32, 4).dropout(1.0));
  const at::Tensor x = torch::randn({2, 5, 32});
  module->train();
  EXPECT_EQ(module(x).count_nonzero().item<int64_t>(), 0);
  module->eval();
  EXPECT_LE(max_abs_diff(module(x), nanogpt_reference(module, x)), 1e-5);
}

// Feeds x (B, L, E) through the module in chunks of the given sizes, concatenating the outputs.
at::Tensor decode(CausalSelfAttention& module, const at::Tensor& x, KVCache& cache,
                  const std::vector<int64_t>& chunks) {
  std::vector<at::Tensor> outputs;
  int64_t start = 0;
  for (const int64_t size : chunks) {
    outputs.push_back(module(x.narrow(1, start, size), &cache));
    start += size;
  }
  EXPECT_EQ(start, x.size(1));
  return torch::cat(outputs, 1);
}

TEST(KVCache, DecodingEqualsTheFullForward) {
  CausalSelfAttention module(CausalSelfAttentionOptions(24, 4).num_kv_heads(2).value_head_dim(5));
  const at::Tensor x = torch::randn({2, 11, 24});
  torch::NoGradGuard no_grad;
  const at::Tensor full = module(x);
  for (const auto& chunks :
       std::vector<std::vector<int64_t>>{std::vector<int64_t>(11, 1), {3, 1, 4, 2, 1}, {11}}) {
    KVCache cache = module->make_cache(2, 16);
    EXPECT_LE(max_abs_diff(decode(module, x, cache, chunks), full), 1e-5);
    EXPECT_EQ(cache.length(), 11);
    EXPECT_EQ(cache.keys().sizes(), at::IntArrayRef({2, 2, 11, 6}));
    EXPECT_EQ(cache.values().sizes(), at::IntArrayRef({2, 2, 11, 5}));
  }
}

TEST(KVCache, DecodingWithScoreOptionsEqualsTheFullForward) {
  // 40 positions: past the sliding window of 16, and far enough for ALiBi's bias to matter.
  CausalSelfAttention module = module_with(score_option_configs().back().options, at::kFloat);
  const at::Tensor x = torch::randn({2, 40, 24});
  torch::NoGradGuard no_grad;
  const at::Tensor full = module(x);
  for (const auto& chunks :
       std::vector<std::vector<int64_t>>{std::vector<int64_t>(40, 1), {13, 1, 9, 17}}) {
    KVCache cache = module->make_cache(2, 40);
    EXPECT_LE(max_abs_diff(decode(module, x, cache, chunks), full), 1e-5);
  }
}

TEST(KVCache, ResetAndReuse) {
  CausalSelfAttention module(CausalSelfAttentionOptions(32, 4).num_kv_heads(2));
  const at::Tensor x = torch::randn({2, 6, 32});
  c10::InferenceMode inference;
  KVCache cache = module->make_cache(2, 6);
  const at::Tensor first = decode(module, x, cache, {2, 4});
  cache.reset();
  EXPECT_EQ(cache.length(), 0);
  decode(module, torch::randn({2, 6, 32}), cache, {6});
  cache.reset();
  EXPECT_LE(max_abs_diff(decode(module, x, cache, std::vector<int64_t>(6, 1)), first), 1e-5);
}

TEST(KVCache, WeightsSeeTheCachedPositions) {
  CausalSelfAttention module(32, 4);
  const at::Tensor x = torch::randn({1, 7, 32});
  torch::NoGradGuard no_grad;
  const at::Tensor full_weights = std::get<1>(module->forward_with_weights(x));
  KVCache cache = module->make_cache(1, 8);
  module(x.narrow(1, 0, 4), &cache);
  const auto [out, weights] = module->forward_with_weights(x.narrow(1, 4, 3), &cache);
  EXPECT_EQ(weights.sizes(), at::IntArrayRef({1, 4, 3, 7}));
  EXPECT_LE(max_abs_diff(weights, full_weights.narrow(2, 4, 3)), 1e-5);
  EXPECT_LE(max_abs_diff(out, module(x).narrow(1, 4, 3)), 1e-5);
}

TEST(KVCache, DecodingBackpropagatesAndResetDropsTheGraph) {
  CausalSelfAttention module(16, 2);
  module->to(at::kDouble);
  const at::Tensor x = torch::randn({1, 5, 16}, at::kDouble);
  const at::Tensor full_grad =
      torch::autograd::grad({module(x).sum()}, {module->c_attn->weight})[0];
  KVCache cache = module->make_cache(1, 5);
  const at::Tensor decoded_grad =
      torch::autograd::grad({decode(module, x, cache, {2, 3}).sum()}, {module->c_attn->weight})[0];
  EXPECT_LE(max_abs_diff(decoded_grad, full_grad), 1e-10);
  EXPECT_TRUE(cache.keys().requires_grad());
  cache.reset();
  EXPECT_FALSE(cache.keys().requires_grad());
}

TEST(KVCache, MisuseThrowsAndLeavesTheCacheUnchanged) {
  CausalSelfAttention module(CausalSelfAttentionOptions(32, 4).num_kv_heads(2));
  KVCache cache = module->make_cache(2, 5);
  module(torch::randn({2, 3, 32}), &cache);

  expect_cache_unchanged_after_error<c10::ValueError>(
      [&] { module(torch::randn({2, 3, 32}), &cache); }, cache,
      {"cannot append 3 positions to a cache holding 3 of max_len=5"});
  expect_cache_unchanged_after_error<c10::ValueError>(
      [&] { module(torch::randn({3, 1, 32}), &cache); }, cache,
      {"must match the cache's batch size", "keys.shape=[3, 2, 1, 8]"});
  CausalSelfAttention other_heads(32, 4);
  expect_cache_unchanged_after_error<c10::ValueError>(
      [&] { other_heads(torch::randn({2, 1, 32}), &cache); }, cache,
      {"keys.shape=[2, 4, 1, 8]", "(B, Hkv, max_len, D)=[2, 2, 5, 8]"});
  CausalSelfAttention other_value_width(
      CausalSelfAttentionOptions(32, 4).num_kv_heads(2).value_head_dim(4));
  expect_cache_unchanged_after_error<c10::ValueError>(
      [&] { other_value_width(torch::randn({2, 1, 32}), &cache); }, cache,
      {"values.shape=[2, 2, 1, 4]"});
  CausalSelfAttention float64(CausalSelfAttentionOptions(32, 4).num_kv_heads(2));
  float64->to(at::kDouble);
  expect_cache_unchanged_after_error<c10::TypeError>(
      [&] { float64(torch::randn({2, 1, 32}, at::kDouble), &cache); }, cache,
      {"cache's dtype Float", "keys.dtype=Double"});

  module(torch::randn({2, 2, 32}), &cache);  // still usable
  EXPECT_EQ(cache.length(), 5);
}

// Prompts of 7, 3 and 5 positions, left-padded to one batch (the padding random, so that a leak
// shows), then 4 decoded positions: prefill with the key mask, decoding steps without one (the
// last one with the weights). At every real position each row equals its prompt run alone.
TEST(KVCache, LeftPaddedPromptsDecodeLikeEachPromptAlone) {
  CausalSelfAttention module(CausalSelfAttentionOptions(24, 4).num_kv_heads(2).value_head_dim(5));
  const std::vector<int64_t> prompt_lengths{7, 3, 5};
  const int64_t prompt = 7, new_tokens = 4, batch = 3;
  std::vector<at::Tensor> sequences;
  at::Tensor x = torch::randn({batch, prompt + new_tokens, 24});
  at::Tensor key_mask = torch::ones({batch, prompt + new_tokens}, torch::kBool);
  for (int64_t row = 0; row < batch; ++row) {
    const int64_t padding = prompt - prompt_lengths[row];
    sequences.push_back(torch::randn({1, prompt_lengths[row] + new_tokens, 24}));
    x[row].narrow(0, padding, prompt_lengths[row] + new_tokens).copy_(sequences.back()[0]);
    key_mask[row].narrow(0, 0, padding).fill_(false);
  }
  torch::NoGradGuard no_grad;
  KVCache cache = module->make_cache(batch, prompt + new_tokens);
  std::vector<at::Tensor> outputs{
      module(x.narrow(1, 0, prompt), &cache, key_mask.narrow(1, 0, prompt))};
  outputs.push_back(module(x.narrow(1, prompt, 2), &cache));
  outputs.push_back(module(x.narrow(1, prompt + 2, 1), &cache));
  const auto [last, weights] = module->forward_with_weights(x.narrow(1, prompt + 3, 1), &cache);
  outputs.push_back(last);
  const at::Tensor batched = torch::cat(outputs, 1);
  ASSERT_TRUE(cache.key_mask().has_value());
  EXPECT_TRUE(cache.key_mask()->equal(key_mask));
  EXPECT_EQ(weights.sizes(), at::IntArrayRef({batch, 4, 1, prompt + new_tokens}));
  for (int64_t row = 0; row < batch; ++row) {
    SCOPED_TRACE("row " + std::to_string(row));
    const int64_t padding = prompt - prompt_lengths[row];
    const auto [alone, alone_weights] = module->forward_with_weights(sequences[row]);
    EXPECT_LE(max_abs_diff(batched[row].narrow(0, padding, alone.size(1)), alone[0]), 1e-5);
    EXPECT_LE(max_abs_diff(weights[row].narrow(-1, padding, alone.size(1)),
                           alone_weights[0].narrow(1, alone.size(1) - 1, 1)),
              1e-5);
    EXPECT_EQ(weights[row].narrow(-1, 0, padding).count_nonzero().item<int64_t>(), 0);
  }
}

// A document mask over one packed row is each document through the module alone, and a learned
// bias trains through it: its gradient is the one the same module with the bias given as a
// float mask to the op directly gets.
TEST(CausalSelfAttention, AttnMaskIsEachDocumentAloneAndALearnedBiasGetsItsGradient) {
  torch::manual_seed(0);
  CausalSelfAttention module(CausalSelfAttentionOptions(32, 4).num_kv_heads(2));
  module->to(torch::kDouble);
  const std::vector<int64_t> lengths{5, 11, 8};
  const at::Tensor x = torch::randn({1, 24, 32}, torch::kDouble);
  const at::Tensor document =
      torch::repeat_interleave(torch::arange(3), torch::tensor(lengths, torch::kLong));
  const at::Tensor packed =
      module(x, nullptr, std::nullopt, document.unsqueeze(1).eq(document.unsqueeze(0)));
  std::vector<at::Tensor> alone;
  for (const at::Tensor& part : x.split_with_sizes(lengths, 1)) {
    alone.push_back(module(part));
  }
  EXPECT_LE(max_abs_diff(packed, torch::cat(alone, 1)), 1e-12);

  const at::Tensor bias = torch::randn({1, 4, 6, 6}, torch::kDouble).requires_grad_();
  const at::Tensor y = torch::randn({2, 6, 32}, torch::kDouble);
  const at::Tensor out = module(y, nullptr, std::nullopt, bias);
  const at::Tensor grad = torch::autograd::grad({out.square().sum()}, {bias})[0];
  EXPECT_EQ(grad.sizes(), bias.sizes());
  EXPECT_GT(grad.abs().sum().item<double>(), 0.0);
  // The bias shifts scores: a constant over every key of a row changes nothing.
  const at::Tensor shifted = module(y, nullptr, std::nullopt, bias.detach() + 3.0);
  EXPECT_LE(max_abs_diff(shifted, out.detach()), 1e-12);
  const auto [weights_out, weights] = module->forward_with_weights(y, nullptr, std::nullopt, bias);
  EXPECT_LE(max_abs_diff(weights_out, out.detach()), 1e-12);
  EXPECT_LE(max_abs_diff(weights.sum(-1), torch::ones({2, 4, 6}, torch::kDouble)), 1e-12);
}

TEST(KVCache, ResetForgetsTheKeyMask) {
  CausalSelfAttention module(32, 4);
  const at::Tensor x = torch::randn({2, 6, 32});
  at::Tensor key_mask = torch::ones({2, 6}, torch::kBool);
  key_mask[0].narrow(0, 0, 4).fill_(false);
  torch::NoGradGuard no_grad;
  KVCache cache = module->make_cache(2, 6);
  module(x, &cache, key_mask);
  ASSERT_TRUE(cache.key_mask().has_value());
  EXPECT_TRUE(cache.key_mask()->equal(key_mask));
  cache.reset();
  EXPECT_FALSE(cache.key_mask().has_value());
  EXPECT_LE(max_abs_diff(decode(module, x, cache, {3, 3}), module(x)), 1e-5);
  EXPECT_FALSE(cache.key_mask().has_value());
  // Positions appended without a mask are real even where the last sequence had padding: a
  // masked step after them must not find that sequence's mask in the storage.
  cache.reset();
  const at::Tensor unmasked = module(x.narrow(1, 0, 3), &cache);
  const at::Tensor masked = module(x.narrow(1, 3, 3), &cache, torch::ones({2, 3}, torch::kBool));
  ASSERT_TRUE(cache.key_mask().has_value());
  EXPECT_TRUE(cache.key_mask()->all().item<bool>());
  EXPECT_LE(max_abs_diff(torch::cat({unmasked, masked}, 1), module(x)), 1e-5);
}

TEST(KVCache, BadKeyMaskThrowsAndLeavesTheCacheUnchanged) {
  CausalSelfAttention module(CausalSelfAttentionOptions(32, 4).num_kv_heads(2));
  KVCache cache = module->make_cache(2, 6);
  at::Tensor prefill_mask = torch::ones({2, 3}, torch::kBool);
  prefill_mask[0][0] = false;
  module(torch::randn({2, 3, 32}), &cache, prefill_mask);
  const at::Tensor step = torch::randn({2, 1, 32});
  expect_cache_unchanged_after_error<c10::TypeError>(
      [&] { module(step, &cache, torch::ones({2, 1}, torch::kLong)); }, cache,
      {"key_mask must be a bool tensor", "key_mask.dtype=Long"});
  expect_cache_unchanged_after_error<c10::TypeError>([&] { module(step, &cache, at::Tensor()); },
                                                     cache,
                                                     {"key_mask must be a defined bool tensor"});
  // The mask of the new positions, not of the whole cache.
  expect_cache_unchanged_after_error<c10::ValueError>(
      [&] { module(step, &cache, torch::ones({2, 4}, torch::kBool)); }, cache,
      {"key_mask must be (B, L)=[2, 1] of x", "key_mask.shape=[2, 4]"});
  expect_cache_unchanged_after_error<c10::ValueError>(
      [&] { module(step, &cache, torch::ones({2, 1}, torch::kBool).to(at::kMeta)); }, cache,
      {"key_mask must be on x's device cpu", "key_mask.device=meta"});
  expect_cache_unchanged_after_error<c10::ValueError>(
      [&] { module(torch::randn({2, 4, 32}), &cache, torch::zeros({2, 4}, torch::kBool)); }, cache,
      {"cannot append 4 positions"});
  // KVCache::append checks the mask itself too, for callers other than the module.
  const at::Tensor keys = torch::zeros({2, 2, 1, 8}), values = torch::zeros({2, 2, 1, 8});
  expect_cache_unchanged_after_error<c10::TypeError>(
      [&] { cache.append(keys, values, torch::ones({2, 1})); }, cache,
      {"KVCache: key_mask must be a bool tensor", "key_mask.dtype=Float"});
  expect_cache_unchanged_after_error<c10::ValueError>(
      [&] { cache.append(keys, values, torch::ones({1, 2}, torch::kBool)); }, cache,
      {"KVCache: key_mask must be (B, L)=[2, 1] of the new keys", "key_mask.shape=[1, 2]"});
  module(step, &cache);  // still usable
  EXPECT_EQ(cache.length(), 4);
  ASSERT_TRUE(cache.key_mask().has_value());
  EXPECT_TRUE(
      cache.key_mask()->equal(torch::cat({prefill_mask, torch::ones({2, 1}, torch::kBool)}, 1)));
}

TEST(CausalSelfAttention, BadKeyMaskWithoutACacheThrowsNamingIt) {
  CausalSelfAttention module(32, 4);
  const at::Tensor x = torch::randn({2, 5, 32});
  expect_error<c10::ValueError>([&] { module(x, nullptr, torch::ones({5}, torch::kBool)); },
                                {"key_mask must be (B, L)=[2, 5] of x", "key_mask.shape=[5]"});
  expect_error<c10::TypeError>(
      [&] { module->forward_with_weights(x, nullptr, torch::ones({2, 5}, torch::kInt)); },
      {"key_mask must be a bool tensor", "key_mask.dtype=Int"});
}

TEST(KVCache, BadSizesAndStorageThrow) {
  CausalSelfAttention module(32, 4);
  expect_error<c10::ValueError>([&] { module->make_cache(0, 4); },
                                {"batch_size and max_len must be positive", "batch_size=0"});
  expect_error<c10::ValueError>([&] { module->make_cache(2, 0); }, {"max_len=0"});
  expect_error<c10::ValueError>(
      [] { KVCache(torch::zeros({2, 5, 8}), torch::zeros({2, 1, 5, 8})); },
      {"must be 4-D", "key_storage.shape=[2, 5, 8]"});
  expect_error<c10::ValueError>(
      [] { KVCache(torch::zeros({2, 1, 5, 8}), torch::zeros({2, 1, 6, 8})); },
      {"agree in (B, Hkv, max_len)"});
  expect_error<c10::TypeError>(
      [] { KVCache(torch::zeros({2, 1, 5, 8}), torch::zeros({2, 1, 5, 8}, at::kDouble)); },
      {"same dtype"});
}

TEST(AttentionWeights, EqualNaiveSoftmaxWithZerosAboveTheBoundaryAndInEmptyRows) {
  // Lq > Lk: the first two query rows see no key.
  const at::Tensor q = torch::randn({2, 4, 6, 8}, at::kDouble);
  const at::Tensor k = torch::randn({2, 2, 4, 8}, at::kDouble);
  const at::Tensor v = torch::randn({2, 2, 4, 3}, at::kDouble);
  const at::Tensor weights =
      causal_attention::attention_weights(q, k, v, AttentionOptions().scale(0.3));
  const at::Tensor visible = bottom_right_mask(6, 4);
  const at::Tensor scores =
      at::matmul(q, expand_kv_heads(k, 4).transpose(-2, -1))
          .mul(0.3)
          .masked_fill(visible.logical_not(), -std::numeric_limits<double>::infinity());
  const at::Tensor expected = scores.softmax(-1).nan_to_num(0.0);
  EXPECT_LE(max_abs_diff(weights, expected), 1e-12);
  EXPECT_EQ(weights.narrow(2, 0, 2).count_nonzero().item<int64_t>(), 0);
  EXPECT_EQ(weights.masked_select(visible.logical_not()).count_nonzero().item<int64_t>(), 0);
  EXPECT_LE(max_abs_diff(at::matmul(weights, expand_kv_heads(v, 4)),
                         causal_attention::attention(q, k, v, AttentionOptions().scale(0.3))),
            1e-12);
}

TEST(AttentionWeights, BadInputThrowsNamingTheOp) {
  expect_error<c10::TypeError>(
      [] {
        causal_attention::attention_weights(torch::randn({5, 8}), torch::randn({5, 8}, at::kDouble),
                                            torch::randn({5, 8}));
      },
      {"causal_attention.attention_weights", "same dtype"});
}

}  // namespace
}  // namespace causal_attention::tests
