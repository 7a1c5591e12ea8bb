// The directory of files crossing between Python and C++: $CAUSAL_ATTENTION_INTEROP_DIR, which
// scripts/test.sh sets to build/interop and fills before ctest by running the exporters in
// tests/fixtures/ (the TorchScript model, the AOTInductor packages and their expected outputs).
// A missing directory or file fails the test that needs it, saying how to make it.
#pragma once

#include <gtest/gtest.h>
#include <torch/serialize.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <string>
#include <vector>

namespace causal_attention::tests {

inline constexpr const char* kInteropDirVariable = "CAUSAL_ATTENTION_INTEROP_DIR";

// The interop directory, or a failure saying how to make it.
inline ::testing::AssertionResult interop_dir(std::filesystem::path* dir) {
  const char* value = std::getenv(kInteropDirVariable);
  if (value == nullptr || *value == '\0') {
    return ::testing::AssertionFailure()
           << "$" << kInteropDirVariable
           << " is not set: run scripts/test.sh, or the exporters of tests/fixtures/ with a "
              "directory DIR and set "
           << kInteropDirVariable << "=DIR";
  }
  *dir = value;
  return ::testing::AssertionSuccess();
}

// The file `name` of the interop directory, or a failure naming what is missing and which
// exporter of tests/fixtures/ writes it.
inline ::testing::AssertionResult interop_file(const std::string& name, const std::string& exporter,
                                               std::filesystem::path* path) {
  std::filesystem::path dir;
  if (auto found = interop_dir(&dir); !found) {
    return found;
  }
  *path = dir / name;
  if (!std::filesystem::exists(*path)) {
    return ::testing::AssertionFailure() << *path << " is missing: tests/fixtures/" << exporter
                                         << " writes it (scripts/test.sh runs it before ctest)";
  }
  return ::testing::AssertionSuccess();
}

// What Python's torch.save wrote (a dict of str keys), as a map.
inline std::map<std::string, c10::IValue> load_python_dict(const std::filesystem::path& path) {
  std::ifstream file(path, std::ios::binary);
  const std::vector<char> bytes{std::istreambuf_iterator<char>(file),
                                std::istreambuf_iterator<char>()};
  std::map<std::string, c10::IValue> entries;
  for (const auto& entry : torch::pickle_load(bytes).toGenericDict()) {
    entries.emplace(entry.key().toStringRef(), entry.value());
  }
  return entries;
}

}  // namespace causal_attention::tests
