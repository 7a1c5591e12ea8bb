// Argument validation: the documented C++ exception types (c10::ValueError for shapes and
// scale, c10::TypeError for dtypes) with messages naming the argument, for the public op,
// attention_forward and attention_backward; and the refused double backward.
#include "../attention_test_utils.h"

#include <limits>

namespace causal_attention::tests {
namespace {

at::Tensor rand(std::vector<int64_t> shape, at::ScalarType dtype = at::kFloat) {
  return torch::randn(shape, torch::kDouble).to(dtype);
}

// Every forward entry point: attention with and without scale, attention_forward, and attention
// on inputs that require grad (the Autograd kernel).
template <typename E>
void expect_forward_error(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                          std::initializer_list<const char*> needles) {
  SCOPED_TRACE("attention(q, k, v)");
  expect_error<E>([&] { causal_attention::attention(q, k, v); }, needles);
  SCOPED_TRACE("attention(q, k, v, 0.5)");
  expect_error<E>([&] { causal_attention::attention(q, k, v, 0.5); }, needles);
  SCOPED_TRACE("attention_forward(q, k, v, 0.5)");
  expect_error<E>([&] { causal_attention::attention_forward(q, k, v, 0.5); }, needles);
  if (q.is_floating_point()) {
    SCOPED_TRACE("attention(q.requires_grad_(), k, v)");
    const at::Tensor qg = q.detach().requires_grad_(true);
    expect_error<E>([&] { causal_attention::attention(qg, k, v); }, needles);
  }
}

TEST(Errors, RankBelowTwo) {
  expect_forward_error<c10::ValueError>(rand({8}), rand({8}), rand({8}), {"q.shape", "q must"});
  expect_forward_error<c10::ValueError>(rand({8, 4}), rand({4}), rand({8, 4}), {"k.shape"});
  expect_forward_error<c10::ValueError>(rand({8, 4}), rand({8, 4}), rand({4}), {"v.shape"});
}

TEST(Errors, DifferentRanks) {
  expect_forward_error<c10::ValueError>(rand({2, 8, 4}), rand({1, 2, 8, 4}), rand({1, 2, 8, 4}),
                                        {"number of dimensions", "q.shape", "k.shape"});
  expect_forward_error<c10::ValueError>(rand({2, 8, 4}), rand({2, 8, 4}), rand({8, 4}),
                                        {"number of dimensions", "v.shape"});
}

TEST(Errors, LeadingDimsDiffer) {
  expect_forward_error<c10::ValueError>(rand({2, 2, 8, 4}), rand({3, 2, 8, 4}), rand({3, 2, 8, 4}),
                                        {"leading", "q.shape", "k.shape"});
  expect_forward_error<c10::ValueError>(rand({2, 3, 2, 8, 4}), rand({2, 3, 2, 8, 4}),
                                        rand({2, 1, 2, 8, 4}), {"leading", "v.shape"});
}

TEST(Errors, HeadDimMismatch) {
  expect_forward_error<c10::ValueError>(rand({1, 2, 8, 4}), rand({1, 2, 8, 5}), rand({1, 2, 8, 4}),
                                        {"head dimension", "q.shape"});
}

TEST(Errors, KeyLengthMismatchBetweenKAndV) {
  expect_forward_error<c10::ValueError>(rand({1, 2, 8, 4}), rand({1, 2, 8, 4}), rand({1, 2, 9, 4}),
                                        {"Lk", "k.shape", "v.shape"});
}

TEST(Errors, KvHeadsMismatch) {
  expect_forward_error<c10::ValueError>(rand({1, 2, 8, 4}), rand({1, 2, 8, 4}), rand({1, 1, 8, 4}),
                                        {"heads", "k.shape", "v.shape"});
}

TEST(Errors, QueryHeadsNotMultipleOfKvHeads) {
  expect_forward_error<c10::ValueError>(rand({1, 3, 8, 4}), rand({1, 2, 8, 4}), rand({1, 2, 8, 4}),
                                        {"multiple", "q.shape", "k.shape"});
  expect_forward_error<c10::ValueError>(rand({1, 2, 8, 4}), rand({1, 0, 8, 4}), rand({1, 0, 8, 4}),
                                        {"multiple", "q.shape"});
}

TEST(Errors, ZeroHeadDim) {
  expect_forward_error<c10::ValueError>(rand({1, 2, 8, 0}), rand({1, 2, 8, 0}), rand({1, 2, 8, 4}),
                                        {"head dimension", "q.shape"});
}

TEST(Errors, NonFiniteScale) {
  const at::Tensor q = rand({1, 2, 8, 4});
  for (double scale :
       {std::numeric_limits<double>::quiet_NaN(), std::numeric_limits<double>::infinity(),
        -std::numeric_limits<double>::infinity()}) {
    SCOPED_TRACE(scale);
    expect_error<c10::ValueError>([&] { causal_attention::attention(q, q, q, scale); }, {"scale"});
    expect_error<c10::ValueError>([&] { causal_attention::attention_forward(q, q, q, scale); },
                                  {"scale"});
    auto [out, lse] = causal_attention::attention_forward(q, q, q, 0.5);
    expect_error<c10::ValueError>(
        [&] { causal_attention::attention_backward(out, q, q, q, out, lse, scale); }, {"scale"});
  }
}

TEST(Errors, DtypeMismatch) {
  expect_forward_error<c10::TypeError>(rand({2, 8, 4}), rand({2, 8, 4}, at::kDouble),
                                       rand({2, 8, 4}), {"same dtype", "q.dtype", "k.dtype"});
  expect_forward_error<c10::TypeError>(rand({2, 8, 4}, at::kBFloat16),
                                       rand({2, 8, 4}, at::kBFloat16), rand({2, 8, 4}, at::kHalf),
                                       {"same dtype", "v.dtype"});
}

TEST(Errors, IntegerDtype) {
  const at::Tensor i = torch::ones({2, 8, 4}, torch::kLong);
  expect_forward_error<c10::TypeError>(i, i, i, {"q.dtype"});
  expect_forward_error<c10::TypeError>(rand({2, 8, 4}), i.to(torch::kInt), rand({2, 8, 4}),
                                       {"k.dtype"});
  expect_forward_error<c10::TypeError>(rand({2, 8, 4}), rand({2, 8, 4}),
                                       torch::ones({2, 8, 4}, torch::kBool), {"v.dtype"});
}

class BackwardErrors : public ::testing::Test {
 protected:
  void SetUp() override {
    torch::manual_seed(0);
    q = rand({2, 4, 8, 6});
    k = rand({2, 2, 10, 6});
    v = rand({2, 2, 10, 3});
    std::tie(out, lse) = causal_attention::attention_forward(q, k, v, 0.5);
    grad_out = torch::randn_like(out);
  }

  at::Tensor q, k, v, out, lse, grad_out;
};

TEST_F(BackwardErrors, ValidCallSucceeds) {
  auto [dq, dk, dv] = causal_attention::attention_backward(grad_out, q, k, v, out, lse, 0.5);
  EXPECT_EQ(dq.sizes(), q.sizes());
  EXPECT_EQ(dk.sizes(), k.sizes());
  EXPECT_EQ(dv.sizes(), v.sizes());
}

TEST_F(BackwardErrors, WronglyShapedGradOut) {
  for (const at::Tensor& bad :
       {rand({2, 4, 8, 6}), rand({2, 4, 9, 3}), rand({4, 8, 3}), rand({2, 4, 8, 3}).unsqueeze(0)}) {
    SCOPED_TRACE(bad.sizes());
    expect_error<c10::ValueError>(
        [&] { causal_attention::attention_backward(bad, q, k, v, out, lse, 0.5); },
        {"grad_out.shape"});
  }
}

TEST_F(BackwardErrors, WronglyShapedOut) {
  expect_error<c10::ValueError>(
      [&] {
        causal_attention::attention_backward(grad_out, q, k, v, rand({2, 4, 8, 6}), lse, 0.5);
      },
      {"out.shape"});
}

TEST_F(BackwardErrors, WronglyShapedLse) {
  for (const at::Tensor& bad :
       {rand({2, 4, 9}), rand({2, 4, 8, 1}), rand({8, 8}), rand({2, 2, 8})}) {
    SCOPED_TRACE(bad.sizes());
    expect_error<c10::ValueError>(
        [&] { causal_attention::attention_backward(grad_out, q, k, v, out, bad, 0.5); },
        {"lse.shape"});
  }
}

TEST_F(BackwardErrors, WrongDtypes) {
  expect_error<c10::TypeError>(
      [&] {
        causal_attention::attention_backward(grad_out, q, k, v, out, lse.to(at::kDouble), 0.5);
      },
      {"lse.dtype"});
  expect_error<c10::TypeError>(
      [&] { causal_attention::attention_backward(grad_out.to(at::kHalf), q, k, v, out, lse, 0.5); },
      {"grad_out.dtype"});
  expect_error<c10::TypeError>(
      [&] {
        causal_attention::attention_backward(grad_out, q, k.to(at::kDouble), v, out, lse, 0.5);
      },
      {"k.dtype"});
}

TEST_F(BackwardErrors, InvalidForwardInputs) {
  expect_error<c10::ValueError>(
      [&] {
        causal_attention::attention_backward(grad_out, q, k, v.narrow(-2, 0, 9), out, lse, 0.5);
      },
      {"k.shape", "v.shape"});
}

TEST(DoubleBackward, RaisesNamedError) {
  torch::manual_seed(0);
  const at::Tensor q = rand({2, 3, 12, 8}, at::kDouble).requires_grad_(true);
  const at::Tensor k = rand({2, 3, 12, 8}, at::kDouble).requires_grad_(true);
  const at::Tensor v = rand({2, 3, 12, 8}, at::kDouble).requires_grad_(true);
  const at::Tensor out = causal_attention::attention(q, k, v);
  auto grads = torch::autograd::grad({out}, {q, k, v}, {torch::randn_like(out)},
                                     /*retain_graph=*/true, /*create_graph=*/true);
  ASSERT_EQ(grads.size(), 3u);
  ASSERT_TRUE(grads[0].requires_grad());
  ASSERT_NE(grads[0].grad_fn(), nullptr);
  for (size_t i = 0; i < grads.size(); ++i) {
    SCOPED_TRACE(i);
    expect_error<c10::Error>(
        [&] {
          torch::autograd::grad({grads[i].sum()}, {q, k, v}, {}, /*retain_graph=*/true,
                                /*create_graph=*/false, /*allow_unused=*/true);
        },
        {"double backward"});
  }
}

}  // namespace
}  // namespace causal_attention::tests
