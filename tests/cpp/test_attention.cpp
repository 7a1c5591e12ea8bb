#include <gtest/gtest.h>
#include "causal_attention/ops.h"
#include <torch/torch.h>
TEST(Smoke, Runs) {
  auto q = torch::randn({2, 4, 33, 16});
  auto out = causal_attention::attention(q, q, q);
  auto ref = at::scaled_dot_product_attention(q, q, q, {}, 0.0, true);
  EXPECT_TRUE(torch::allclose(out, ref, 1e-5, 1e-5));
}
