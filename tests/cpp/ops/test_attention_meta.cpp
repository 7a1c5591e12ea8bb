// Meta kernels: shapes, dtypes and validation without data, for all three ops, directly and
// through C++ autograd.
#include "../attention_test_utils.h"

namespace causal_attention::tests {
namespace {

at::TensorOptions meta(at::ScalarType dtype) {
  return torch::TensorOptions().device(torch::kMeta).dtype(dtype);
}

at::ScalarType lse_dtype(at::ScalarType dtype) {
  return dtype == at::kDouble ? at::kDouble : at::kFloat;
}

struct MetaShapes {
  std::vector<int64_t> q, k, v, out, lse;
};

const MetaShapes kShapes[] = {
    {{2, 8, 100, 64}, {2, 8, 100, 64}, {2, 8, 100, 64}, {2, 8, 100, 64}, {2, 8, 100}},
    {{3, 8, 17, 32}, {3, 2, 40, 32}, {3, 2, 40, 48}, {3, 8, 17, 48}, {3, 8, 17}},
    {{12, 5}, {30, 5}, {30, 7}, {12, 7}, {12}},
    {{6, 20, 16}, {3, 9, 16}, {3, 9, 16}, {6, 20, 16}, {6, 20}},
    {{2, 3, 4, 11, 8}, {2, 3, 1, 11, 8}, {2, 3, 1, 11, 4}, {2, 3, 4, 11, 4}, {2, 3, 4, 11}},
};

class Meta : public ::testing::TestWithParam<at::ScalarType> {};

TEST_P(Meta, AttentionShapeAndDtype) {
  const at::ScalarType dtype = GetParam();
  for (const MetaShapes& s : kShapes) {
    const at::Tensor out =
        causal_attention::attention(torch::empty(s.q, meta(dtype)), torch::empty(s.k, meta(dtype)),
                                    torch::empty(s.v, meta(dtype)));
    EXPECT_TRUE(out.is_meta());
    EXPECT_EQ(out.sizes(), s.out);
    EXPECT_EQ(out.scalar_type(), dtype);
    const at::Tensor scaled = causal_attention::attention(
        torch::empty(s.q, meta(dtype)), torch::empty(s.k, meta(dtype)),
        torch::empty(s.v, meta(dtype)), causal_attention::AttentionOptions().scale(0.25));
    EXPECT_EQ(scaled.sizes(), s.out);
  }
}

TEST_P(Meta, ForwardShapesAndLseDtype) {
  const at::ScalarType dtype = GetParam();
  for (const MetaShapes& s : kShapes) {
    auto [out, lse] = causal_attention::attention_forward(torch::empty(s.q, meta(dtype)),
                                                          torch::empty(s.k, meta(dtype)),
                                                          torch::empty(s.v, meta(dtype)), 0.125);
    EXPECT_TRUE(out.is_meta());
    EXPECT_TRUE(lse.is_meta());
    EXPECT_EQ(out.sizes(), s.out);
    EXPECT_EQ(out.scalar_type(), dtype);
    EXPECT_EQ(lse.sizes(), s.lse);
    EXPECT_EQ(lse.scalar_type(), lse_dtype(dtype));
  }
}

TEST_P(Meta, BackwardShapesAndDtypes) {
  const at::ScalarType dtype = GetParam();
  for (const MetaShapes& s : kShapes) {
    const at::Tensor q = torch::empty(s.q, meta(dtype));
    const at::Tensor k = torch::empty(s.k, meta(dtype));
    const at::Tensor v = torch::empty(s.v, meta(dtype));
    auto [dq, dk, dv, dsinks] = causal_attention::attention_backward(
        torch::empty(s.out, meta(dtype)), q, k, v, torch::empty(s.out, meta(dtype)),
        torch::empty(s.lse, meta(lse_dtype(dtype))), 0.125);
    EXPECT_TRUE(dq.is_meta());
    EXPECT_EQ(dq.sizes(), s.q);
    EXPECT_EQ(dk.sizes(), s.k);
    EXPECT_EQ(dv.sizes(), s.v);
    EXPECT_EQ(dsinks.numel(), 0);  // no sinks
    EXPECT_EQ(dq.scalar_type(), dtype);
    EXPECT_EQ(dk.scalar_type(), dtype);
    EXPECT_EQ(dv.scalar_type(), dtype);
  }
}

// C++ autograd over Meta tensors: forward and backward both reach the Meta kernels.
TEST_P(Meta, AutogradThroughMeta) {
  const at::ScalarType dtype = GetParam();
  const MetaShapes& s = kShapes[1];
  const at::Tensor q = torch::empty(s.q, meta(dtype).requires_grad(true));
  const at::Tensor k = torch::empty(s.k, meta(dtype).requires_grad(true));
  const at::Tensor v = torch::empty(s.v, meta(dtype).requires_grad(true));
  const at::Tensor out = causal_attention::attention(q, k, v);
  ASSERT_NE(out.grad_fn(), nullptr);
  auto grads = torch::autograd::grad({out}, {q, k, v}, {torch::empty(s.out, meta(dtype))});
  ASSERT_EQ(grads.size(), 3u);
  EXPECT_TRUE(grads[0].is_meta());
  EXPECT_EQ(grads[0].sizes(), s.q);
  EXPECT_EQ(grads[1].sizes(), s.k);
  EXPECT_EQ(grads[2].sizes(), s.v);
  EXPECT_EQ(grads[2].scalar_type(), dtype);
}

INSTANTIATE_TEST_SUITE_P(Dtypes, Meta,
                         ::testing::Values(at::kDouble, at::kFloat, at::kBFloat16, at::kHalf),
                         [](const ::testing::TestParamInfo<at::ScalarType>& info) {
                           return std::string(c10::toString(info.param));
                         });

// The Meta kernels validate exactly like the CPU ones.
TEST(MetaErrors, SameErrorsAsCpu) {
  const auto opts = meta(at::kFloat);
  expect_error<c10::ValueError>(
      [&] {
        causal_attention::attention(torch::empty({1, 2, 8, 4}, opts),
                                    torch::empty({1, 2, 8, 5}, opts),
                                    torch::empty({1, 2, 8, 4}, opts));
      },
      {"q.shape", "k.shape"});
  expect_error<c10::ValueError>(
      [&] {
        causal_attention::attention_forward(torch::empty({1, 3, 8, 4}, opts),
                                            torch::empty({1, 2, 8, 4}, opts),
                                            torch::empty({1, 2, 8, 4}, opts), 1.0);
      },
      {"q.shape", "k.shape"});
  expect_error<c10::TypeError>(
      [&] {
        causal_attention::attention(torch::empty({8, 4}, opts),
                                    torch::empty({8, 4}, meta(at::kHalf)),
                                    torch::empty({8, 4}, opts));
      },
      {"k.dtype"});
  expect_error<c10::ValueError>(
      [&] {
        causal_attention::attention_backward(
            torch::empty({2, 8, 4}, opts), torch::empty({2, 8, 4}, opts),
            torch::empty({2, 8, 4}, opts), torch::empty({2, 8, 4}, opts),
            torch::empty({2, 8, 4}, opts), torch::empty({2, 9}, opts), 0.5);
      },
      {"lse.shape"});
}

}  // namespace
}  // namespace causal_attention::tests
