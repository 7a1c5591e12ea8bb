// AOTInductor packages with our ops inside, run from C++ with no Python: the packages that
// tests/fixtures/export_aoti_packages.py compiled (scripts/test.sh runs it before ctest) load
// with torch::inductor::AOTIModelPackageLoader and reproduce the eager model's outputs at two
// (batch, length) shapes, neither the one they were exported with. The package calls
// causal_attention::attention_forward through torch's proxy executor, which finds the op in the
// dispatcher: this binary links the library (--no-as-needed), so its ops are registered.
#include "../attention_test_utils.h"
#include "interop_files.h"

#include <torch/csrc/inductor/aoti_package/model_package_loader.h>

#include <filesystem>
#include <map>
#include <string>
#include <vector>

namespace causal_attention::tests {
namespace {

constexpr const char* kAotiExporter = "export_aoti_packages.py";

// Runs package `name` at every saved shape and compares with the eager outputs saved beside it.
void expect_package_reproduces_eager(const std::string& name, int64_t inputs_per_call) {
  std::filesystem::path package_path, expected_path;
  ASSERT_TRUE(interop_file(name + ".pt2", kAotiExporter, &package_path));
  ASSERT_TRUE(interop_file("aoti_expected.pt", kAotiExporter, &expected_path));
  const auto expected = load_python_dict(expected_path);
  torch::inductor::AOTIModelPackageLoader loader(package_path.string());
  const auto lengths = expected.at("lengths").toList();
  ASSERT_EQ(lengths.size(), 2u);
  for (const c10::IValue& length : lengths) {
    const std::string prefix = name + "." + std::to_string(length.toInt()) + ".";
    SCOPED_TRACE(prefix);
    std::vector<at::Tensor> inputs;
    for (int64_t i = 0; i < inputs_per_call; ++i) {
      inputs.push_back(expected.at(prefix + "input" + std::to_string(i)).toTensor());
    }
    const std::vector<at::Tensor> outputs = loader.run(inputs);
    ASSERT_EQ(outputs.size(), 1u);
    const at::Tensor eager = expected.at(prefix + "output").toTensor();
    ASSERT_EQ(outputs[0].sizes(), eager.sizes());
    EXPECT_LE(max_abs_diff(outputs[0], eager), 1e-5);
  }
}

TEST(AotiPackage, TinyGptRunsAtTwoLengthsAsInEager) {
  expect_package_reproduces_eager("tiny_gpt", 1);
}

TEST(AotiPackage, KeyMaskSurvivesThePackage) {
  expect_package_reproduces_eager("masked_attention", 2);
}

}  // namespace
}  // namespace causal_attention::tests
