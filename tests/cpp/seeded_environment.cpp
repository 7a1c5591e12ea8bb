// Every test process starts from the same random state, so a tolerance that holds once holds
// in CI too. ctest runs each test in a process of its own (gtest_discover_tests), so each test
// sees seed 0 regardless of which tests ran before it.
#include <gtest/gtest.h>
#include <ATen/Context.h>

namespace {

class SeededEnvironment : public ::testing::Environment {
 public:
  void SetUp() override { at::manual_seed(0); }
};

// Registered before main, as GoogleTest asks when gtest_main provides main.
[[maybe_unused]] ::testing::Environment* const seeded_environment =
    ::testing::AddGlobalTestEnvironment(new SeededEnvironment);

}  // namespace
