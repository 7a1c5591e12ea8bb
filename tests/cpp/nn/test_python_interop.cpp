// Models and weights crossing between Python and C++, through the directory named by
// $CAUSAL_ATTENTION_INTEROP_DIR (scripts/test.sh sets it to build/interop and first runs
// tests/fixtures/export_torchscript_model.py into it):
// - the scripted TinyGPT runs forward and backward here and matches Python's logits and
//   gradients;
// - the Python module's weights load into the C++ module, which then matches Python's output,
//   and with every score option its state_dict (sinks and ALiBi slopes included) does too, and
//   the C++ module backpropagates as Python's;
// - the C++ module's state_dict, with every score option, is written there for
//   tests/python/nn/test_cpp_interop.py, and so are its 8-bit KV caches and their decoding;
// - the README's C++ example compiles (it is included below) and runs.
// A missing directory or file fails the tests, saying how to make it; nothing is skipped.
#include "causal_attention/nn.h"

#include "../attention_test_utils.h"
#include "interop_files.h"
#include "readme_use_in_model.h"

#include <torch/csrc/jit/passes/inliner.h>

#include <algorithm>
#include <array>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <vector>

namespace causal_attention::tests {
namespace {

constexpr const char* kTorchScriptExporter = "export_torchscript_model.py";

nn::CausalSelfAttentionOptions options_from(const std::map<std::string, c10::IValue>& entries,
                                            const std::string& prefix) {
  // The window is a list as Python pickles it, of generic entries.
  const auto window = entries.at(prefix + "window").toListRef();
  EXPECT_EQ(window.size(), 2u);
  const c10::IValue& softcap = entries.at(prefix + "softcap");
  return nn::CausalSelfAttentionOptions(entries.at(prefix + "embed_dim").toInt(),
                                        entries.at(prefix + "num_heads").toInt())
      .num_kv_heads(entries.at(prefix + "num_kv_heads").toInt())
      .head_dim(entries.at(prefix + "head_dim").toInt())
      .value_head_dim(entries.at(prefix + "value_head_dim").toInt())
      .bias(entries.at(prefix + "bias").toBool())
      .window({window.at(0).toInt(), window.at(1).toInt()})
      .softcap(softcap.isNone() ? std::nullopt : std::optional<double>(softcap.toDouble()))
      .sinks(entries.at(prefix + "sinks").toBool())
      .alibi(entries.at(prefix + "alibi").toBool());
}

// A state_dict as Python's torch.save or C++'s torch::pickle_save wrote it, as a map.
std::map<std::string, at::Tensor> state_dict_from(const c10::IValue& written) {
  std::map<std::string, at::Tensor> state;
  for (const auto& entry : written.toGenericDict()) {
    state.emplace(entry.key().toStringRef(), entry.value().toTensor());
  }
  return state;
}

// Copies `state` into the module's parameters and buffers; like Python's
// load_state_dict(strict=True), the names must be exactly the module's.
void load_state_dict(torch::nn::Module& module, const std::map<std::string, at::Tensor>& state) {
  std::vector<std::string> expected_names, given_names;
  for (const auto& item : module.named_parameters()) {
    expected_names.push_back(item.key());
  }
  for (const auto& item : module.named_buffers()) {
    expected_names.push_back(item.key());
  }
  for (const auto& [name, tensor] : state) {
    given_names.push_back(name);
  }
  std::sort(expected_names.begin(), expected_names.end());
  ASSERT_EQ(given_names, expected_names);
  torch::NoGradGuard no_grad;
  for (auto& item : module.named_parameters()) {
    item.value().copy_(state.at(item.key()));
  }
  for (auto& item : module.named_buffers()) {
    item.value().copy_(state.at(item.key()));
  }
}

TEST(PythonInterop, ScriptedModelRunsForwardAndBackwardInCpp) {
  std::filesystem::path model_path, expected_path;
  ASSERT_TRUE(interop_file("tiny_gpt.pt", kTorchScriptExporter, &model_path));
  ASSERT_TRUE(interop_file("tiny_gpt_expected.pt", kTorchScriptExporter, &expected_path));
  torch::jit::Module model = torch::jit::load(model_path.string());
  const auto expected = load_python_dict(expected_path);

  // The scripted graph calls the op itself, whose C++ autograd kernel runs the backward below.
  const std::shared_ptr<torch::jit::Graph> graph = model.get_method("forward").graph()->copy();
  torch::jit::Inline(*graph);
  EXPECT_NE(graph->toString().find("causal_attention::attention"), std::string::npos);

  const at::Tensor logits = model.forward({expected.at("tokens").toTensor()}).toTensor();
  EXPECT_LE(max_abs_diff(logits, expected.at("logits").toTensor()), 1e-5);
  at::cross_entropy_loss(logits.flatten(0, 1), expected.at("targets").toTensor().flatten())
      .backward();
  int64_t compared = 0;
  for (const auto& parameter : model.named_parameters()) {
    SCOPED_TRACE(parameter.name);
    const at::Tensor expected_grad = expected.at("grad." + parameter.name).toTensor();
    ASSERT_TRUE(parameter.value.grad().defined());
    EXPECT_LE(max_abs_diff(parameter.value.grad(), expected_grad), 1e-6);
    ++compared;
  }
  EXPECT_EQ(compared, std::count_if(expected.begin(), expected.end(), [](const auto& entry) {
              return entry.first.rfind("grad.", 0) == 0;
            }));
}

TEST(PythonInterop, PythonWeightsLoadIntoTheCppModule) {
  std::filesystem::path model_path, expected_path;
  ASSERT_TRUE(interop_file("tiny_gpt.pt", kTorchScriptExporter, &model_path));
  ASSERT_TRUE(interop_file("tiny_gpt_expected.pt", kTorchScriptExporter, &expected_path));
  const auto expected = load_python_dict(expected_path);
  torch::jit::Module model = torch::jit::load(model_path.string());
  std::map<std::string, at::Tensor> state;
  const std::string prefix = "blocks.0.attn.";
  for (const auto& parameter : model.named_parameters()) {
    if (parameter.name.rfind(prefix, 0) == 0) {
      state.emplace(parameter.name.substr(prefix.size()), parameter.value);
    }
  }
  nn::CausalSelfAttention module(options_from(expected, "attention."));
  load_state_dict(*module, state);
  torch::NoGradGuard no_grad;
  EXPECT_LE(max_abs_diff(module(expected.at("attention.x").toTensor()),
                         expected.at("attention.y").toTensor()),
            1e-6);
}

TEST(PythonInterop, PythonWeightsWithScoreOptionsLoadAndBackpropagateAlikeInCpp) {
  std::filesystem::path expected_path;
  ASSERT_TRUE(interop_file("tiny_gpt_expected.pt", kTorchScriptExporter, &expected_path));
  const auto expected = load_python_dict(expected_path);
  const std::string prefix = "options_attention.";
  nn::CausalSelfAttention module(options_from(expected, prefix));
  ASSERT_TRUE(module->sinks.defined() && module->alibi_slopes.defined());
  EXPECT_EQ(module->options.window(), (std::array<int64_t, 2>{5, 0}));
  EXPECT_EQ(module->options.softcap().value_or(0.0), 0.5);
  const auto state = state_dict_from(expected.at(prefix + "state_dict"));
  // Python computes the slopes itself, to the bit.
  EXPECT_TRUE(state.at("alibi_slopes").equal(module->alibi_slopes));
  load_state_dict(*module, state);

  const at::Tensor x = expected.at(prefix + "x").toTensor().detach().requires_grad_(true);
  const at::Tensor y = module(x);
  EXPECT_LE(max_abs_diff(y, expected.at(prefix + "y").toTensor()), 1e-6);
  y.backward(expected.at(prefix + "grad_out").toTensor());
  EXPECT_LE(max_abs_diff(x.grad(), expected.at(prefix + "grad.x").toTensor()), 1e-6);
  for (const auto& parameter : module->named_parameters()) {
    SCOPED_TRACE(parameter.key());
    EXPECT_LE(max_abs_diff(parameter.value().grad(),
                           expected.at(prefix + "grad." + parameter.key()).toTensor()),
              1e-5);
  }
}

TEST(PythonInterop, CppWeightsAreWrittenForPython) {
  std::filesystem::path dir;
  ASSERT_TRUE(interop_dir(&dir));
  nn::CausalSelfAttention module(nn::CausalSelfAttentionOptions(24, 4)
                                     .num_kv_heads(2)
                                     .head_dim(8)
                                     .value_head_dim(5)
                                     .bias(false)
                                     .window({4, 0})
                                     .softcap(0.5)
                                     .sinks(true)
                                     .alibi(true));
  const at::Tensor x = torch::randn({2, 9, 24});
  torch::NoGradGuard no_grad;
  module->sinks.normal_();  // not its zero initialization, so that loading them matters
  c10::Dict<std::string, at::Tensor> state;
  for (const auto& item : module->named_parameters()) {
    state.insert(item.key(), item.value());
  }
  for (const auto& item : module->named_buffers()) {
    state.insert(item.key(), item.value());
  }
  c10::impl::GenericDict written(c10::StringType::get(), c10::AnyType::get());
  const auto& o = module->options;
  written.insert("embed_dim", o.embed_dim());
  written.insert("num_heads", o.num_heads());
  written.insert("num_kv_heads", *o.num_kv_heads());
  written.insert("head_dim", *o.head_dim());
  written.insert("value_head_dim", *o.value_head_dim());
  written.insert("bias", o.bias());
  written.insert("window", c10::List<int64_t>({o.window()[0], o.window()[1]}));
  written.insert("softcap", o.softcap().has_value() ? c10::IValue(*o.softcap()) : c10::IValue());
  written.insert("sinks", o.sinks());
  written.insert("alibi", o.alibi());
  written.insert("state_dict", state);
  written.insert("x", x);
  written.insert("y", module(x));
  const std::vector<char> bytes = torch::pickle_save(written);
  std::filesystem::create_directories(dir);
  std::ofstream(dir / "cpp_attention.pt", std::ios::binary).write(bytes.data(), bytes.size());

  // Read back as tests/python/nn/test_cpp_interop.py does: options, weights, output.
  const auto read = load_python_dict(dir / "cpp_attention.pt");
  nn::CausalSelfAttention reloaded(options_from(read, ""));
  load_state_dict(*reloaded, state_dict_from(read.at("state_dict")));
  EXPECT_TRUE(reloaded->sinks.equal(module->sinks));
  EXPECT_TRUE(reloaded(x).equal(read.at("y").toTensor()));
}

// 8-bit KV caches written by the C++ module, for tests/python/nn/test_cpp_interop.py to store
// the same input with Python's KVCache and decode with Python's module: every format and scale
// layout, their bytes (as uint8) and scales, and the module's output of each decoding step.
TEST(PythonInterop, QuantizedCachesAreWrittenForPython) {
  std::filesystem::path dir;
  ASSERT_TRUE(interop_dir(&dir));
  nn::CausalSelfAttention module(
      nn::CausalSelfAttentionOptions(24, 4).num_kv_heads(2).value_head_dim(5).window({6, 0}));
  module->eval();
  const at::Tensor x = torch::randn({2, 9, 24});
  const std::vector<int64_t> chunks{5, 1, 3};
  torch::NoGradGuard no_grad;
  c10::Dict<std::string, at::Tensor> state;
  for (const auto& item : module->named_parameters()) {
    state.insert(item.key(), item.value());
  }
  c10::impl::GenericDict written(c10::StringType::get(), c10::AnyType::get());
  written.insert("state_dict", state);
  written.insert("x", x);
  written.insert("chunks", c10::List<int64_t>(chunks));
  c10::impl::GenericDict caches(c10::StringType::get(), c10::AnyType::get());
  for (const auto& [format, dtype] :
       std::vector<std::pair<std::string, at::ScalarType>>{{"float8_e4m3fn", at::kFloat8_e4m3fn},
                                                           {"float8_e5m2", at::kFloat8_e5m2},
                                                           {"int8", at::kChar}}) {
    for (const bool per_tensor : {false, true}) {
      // Per tensor, scales small enough that the largest projections saturate.
      nn::KVCache cache =
          per_tensor ? module->make_cache(2, 9, dtype, nn::ScaleLayout::kTensor, 0.004, 0.003)
                     : module->make_cache(2, 9, dtype);
      std::vector<at::Tensor> outputs;
      int64_t start = 0;
      for (const int64_t size : chunks) {
        outputs.push_back(module(x.narrow(1, start, size), &cache));
        start += size;
      }
      c10::Dict<std::string, at::Tensor> entry;
      entry.insert("keys", cache.keys().contiguous().view(at::kByte));
      entry.insert("values", cache.values().contiguous().view(at::kByte));
      entry.insert("key_scales", cache.key_scales()->contiguous());
      entry.insert("value_scales", cache.value_scales()->contiguous());
      entry.insert("y", torch::cat(outputs, 1));
      caches.insert(format + (per_tensor ? "/tensor" : "/token"), entry);
    }
  }
  written.insert("caches", caches);
  const std::vector<char> bytes = torch::pickle_save(written);
  std::filesystem::create_directories(dir);
  std::ofstream(dir / "cpp_quantized_caches.pt", std::ios::binary)
      .write(bytes.data(), bytes.size());
  EXPECT_EQ(load_python_dict(dir / "cpp_quantized_caches.pt").at("caches").toGenericDict().size(),
            6u);
}

TEST(ReadmeExample, CompilesAndRuns) {
  Block block(32, 4);
  const at::Tensor x = torch::randn({2, 7, 32});
  const at::Tensor full = block(x);
  EXPECT_LE(max_abs_diff(decode_step_by_step(block, x), full), 1e-5);

  // Within the window the softcap alone changes the scores: the same as capping them by hand.
  const at::Tensor q = torch::randn({2, 4, 9, 8}, at::kDouble);
  const at::Tensor k = torch::randn({2, 4, 9, 8}, at::kDouble);
  const at::Tensor v = torch::randn({2, 4, 9, 8}, at::kDouble);
  const at::Tensor scores = at::matmul(q, k.transpose(-2, -1)).div(std::sqrt(8.0));
  const at::Tensor capped = scores.div(50.0).tanh().mul(50.0).masked_fill(
      torch::ones({9, 9}, torch::kBool).triu(1), -std::numeric_limits<double>::infinity());
  EXPECT_LE(max_abs_diff(local_attention(q, k, v), at::matmul(capped.softmax(-1), v)), 1e-12);

  std::filesystem::path model_path, expected_path;
  ASSERT_TRUE(interop_file("tiny_gpt.pt", kTorchScriptExporter, &model_path));
  ASSERT_TRUE(interop_file("tiny_gpt_expected.pt", kTorchScriptExporter, &expected_path));
  const auto expected = load_python_dict(expected_path);
  EXPECT_LE(max_abs_diff(run_scripted(model_path.string(), expected.at("tokens").toTensor()),
                         expected.at("logits").toTensor()),
            1e-5);
}

}  // namespace
}  // namespace causal_attention::tests
