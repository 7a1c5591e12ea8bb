// Key masks, attention masks and packed sequences through the C++ API, with C++ autograd only: a
// key mask against SDPA with the equivalent boolean mask, a document mask and a learned bias (its
// gradient included) against SDPA with the same attn_mask, packed sequences against separate
// calls per sequence, and the typed errors of bad cumulative lengths.
#include "../attention_test_utils.h"

#include <causal_attention/ops.h>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <vector>

namespace {

using causal_attention::tests::bottom_right_mask;
using causal_attention::tests::expect_error;
using causal_attention::tests::max_abs_diff;
using causal_attention::tests::run_with_grad;

// Right padding for batch 0 and left padding for batch 1, plus holes in batch 2.
at::Tensor ragged_key_mask(int64_t batch, int64_t len_k) {
  at::Tensor mask = torch::ones({batch, len_k}, torch::kBool);
  mask[0].narrow(0, len_k / 2, len_k - len_k / 2).fill_(false);
  mask[1].narrow(0, 0, len_k / 3).fill_(false);
  mask[2].slice(0, 0, len_k, 3).fill_(false);
  return mask;
}

TEST(KeyMask, MatchesSdpaWithTheBooleanMaskForwardAndBackward) {
  torch::manual_seed(0);
  for (const int64_t len : {20, 200}) {
    const at::Tensor q = torch::randn({3, 4, len, 16}, torch::kDouble);
    const at::Tensor k = torch::randn({3, 2, len, 16}, torch::kDouble);
    const at::Tensor v = torch::randn({3, 2, len, 8}, torch::kDouble);
    const at::Tensor grad_out = torch::randn({3, 4, len, 8}, torch::kDouble);
    const at::Tensor key_mask = ragged_key_mask(3, len);
    const auto ours = run_with_grad(q, k, v, grad_out, [&](auto a, auto b, auto c) {
      return causal_attention::attention(a, b, c,
                                         causal_attention::AttentionOptions().key_mask(key_mask));
    });
    // Every row sees its own key or an earlier kept one except where the mask hides all, which
    // does not happen for these masks past row len / 3 of batch 1: compare from there on.
    const at::Tensor allowed =
        bottom_right_mask(len, len).unsqueeze(0).unsqueeze(0) & key_mask.unsqueeze(1).unsqueeze(1);
    const auto sdpa = run_with_grad(q, k, v, grad_out, [&](auto a, auto b, auto c) {
      return at::scaled_dot_product_attention(a, b, c, allowed, 0.0, false, std::nullopt, true);
    });
    const int64_t seen_from = len / 3;
    EXPECT_LT(max_abs_diff(ours.out.narrow(2, seen_from, len - seen_from),
                           sdpa.out.narrow(2, seen_from, len - seen_from)),
              1e-12);
    // Rows of batch 1 that see no key are zeros (SDPA gives NaN there).
    EXPECT_EQ(ours.out[1].narrow(1, 0, seen_from).abs().max().item<double>(), 0.0);
    // Hidden keys get exactly zero gradient.
    EXPECT_EQ(ours.dk.masked_select(key_mask.logical_not().unsqueeze(1).unsqueeze(-1))
                  .abs()
                  .max()
                  .item<double>(),
              0.0);
    const at::Tensor rows = torch::arange(seen_from, len);
    EXPECT_LT(max_abs_diff(ours.dq.index_select(2, rows), sdpa.dq.index_select(2, rows)), 1e-12);
  }
}

TEST(AttnMask, BoolAndLearnedBiasMatchSdpaForwardAndBackwardWithCppAutograd) {
  torch::manual_seed(0);
  const int64_t len = 150;
  const at::Tensor q = torch::randn({2, 4, len, 16}, torch::kDouble);
  const at::Tensor k = torch::randn({2, 2, len, 16}, torch::kDouble);
  const at::Tensor v = torch::randn({2, 2, len, 8}, torch::kDouble);
  const at::Tensor grad_out = torch::randn({2, 4, len, 8}, torch::kDouble);
  const at::Tensor document = torch::arange(len).div(50, "floor");
  const at::Tensor documents = document.unsqueeze(1).eq(document.unsqueeze(0));
  const auto ours = run_with_grad(q, k, v, grad_out, [&](auto a, auto b, auto c) {
    return causal_attention::attention(a, b, c,
                                       causal_attention::AttentionOptions().attn_mask(documents));
  });
  const auto sdpa = run_with_grad(q, k, v, grad_out, [&](auto a, auto b, auto c) {
    return at::scaled_dot_product_attention(a, b, c, documents & bottom_right_mask(len, len), 0.0,
                                            false, std::nullopt, true);
  });
  EXPECT_LT(max_abs_diff(ours.out, sdpa.out), 1e-12);
  EXPECT_LT(max_abs_diff(ours.dq, sdpa.dq), 1e-12);
  EXPECT_LT(max_abs_diff(ours.dk, sdpa.dk), 1e-12);
  EXPECT_LT(max_abs_diff(ours.dv, sdpa.dv), 1e-12);

  // A (1, H, L, L) bias trained through the op: its gradient is summed over the batch.
  const at::Tensor bias = torch::randn({1, 4, len, len}, torch::kDouble).requires_grad_();
  const at::Tensor ours_out = causal_attention::attention(
      q, k, v, causal_attention::AttentionOptions().attn_mask(bias).window({-1, -1}));
  const at::Tensor ours_grad = torch::autograd::grad({ours_out}, {bias}, {grad_out})[0];
  const at::Tensor sdpa_out =
      at::scaled_dot_product_attention(q, k, v, bias, 0.0, false, std::nullopt, true);
  const at::Tensor sdpa_grad = torch::autograd::grad({sdpa_out}, {bias}, {grad_out})[0];
  EXPECT_LT(max_abs_diff(ours_out, sdpa_out), 1e-12);
  EXPECT_EQ(ours_grad.sizes(), bias.sizes());
  EXPECT_LT(max_abs_diff(ours_grad, sdpa_grad), 1e-12);
}

TEST(VarlenAttention, MatchesSeparateCallsPerSequenceWithCppAutograd) {
  torch::manual_seed(1);
  const std::vector<int64_t> lengths_q{5, 0, 70, 1, 130}, lengths_k{5, 3, 70, 40, 90};
  std::vector<int32_t> cu_q{0}, cu_k{0};
  for (size_t i = 0; i < lengths_q.size(); ++i) {
    cu_q.push_back(cu_q.back() + lengths_q[i]);
    cu_k.push_back(cu_k.back() + lengths_k[i]);
  }
  const at::Tensor cu_seqlens_q = torch::tensor(cu_q, torch::kInt);
  const at::Tensor cu_seqlens_k = torch::tensor(cu_k, torch::kInt);
  const at::Tensor q = torch::randn({cu_q.back(), 4, 16}, torch::kDouble);
  const at::Tensor k = torch::randn({cu_k.back(), 2, 16}, torch::kDouble);
  const at::Tensor v = torch::randn({cu_k.back(), 2, 8}, torch::kDouble);
  const at::Tensor grad_out = torch::randn({cu_q.back(), 4, 8}, torch::kDouble);
  const auto packed = run_with_grad(q, k, v, grad_out, [&](auto a, auto b, auto c) {
    return causal_attention::varlen_attention(a, b, c, cu_seqlens_q, cu_seqlens_k, 130, 90);
  });
  for (size_t i = 0; i < lengths_q.size(); ++i) {
    const auto rows_q = [&](const at::Tensor& t) {
      return t.narrow(0, cu_q[i], lengths_q[i]).transpose(0, 1);
    };
    const auto rows_k = [&](const at::Tensor& t) {
      return t.narrow(0, cu_k[i], lengths_k[i]).transpose(0, 1);
    };
    const auto alone =
        run_with_grad(rows_q(q), rows_k(k), rows_k(v), rows_q(grad_out),
                      [](auto a, auto b, auto c) { return causal_attention::attention(a, b, c); });
    EXPECT_LT(max_abs_diff(rows_q(packed.out), alone.out), 1e-13) << "sequence " << i;
    EXPECT_LT(max_abs_diff(rows_q(packed.dq), alone.dq), 1e-13) << "sequence " << i;
    EXPECT_LT(max_abs_diff(rows_k(packed.dk), alone.dk), 1e-13) << "sequence " << i;
    EXPECT_LT(max_abs_diff(rows_k(packed.dv), alone.dv), 1e-13) << "sequence " << i;
  }
}

TEST(VarlenAttention, BadCumulativeLengthsRaiseTypedErrorsNamingThem) {
  const at::Tensor q = torch::randn({6, 2, 8});
  const auto call = [&](const at::Tensor& cu, int64_t max_seqlen) {
    return causal_attention::varlen_attention(q, q, q, cu, cu, max_seqlen, max_seqlen);
  };
  expect_error<c10::TypeError>([&] { call(torch::tensor({0, 6}, torch::kLong), 6); },
                               {"cu_seqlens_q", "int32"});
  expect_error<c10::ValueError>([&] { call(torch::tensor({1, 6}, torch::kInt), 6); },
                                {"cu_seqlens_q", "start at 0"});
  expect_error<c10::ValueError>([&] { call(torch::tensor({0, 4, 2, 6}, torch::kInt), 6); },
                                {"non-decreasing"});
  expect_error<c10::ValueError>([&] { call(torch::tensor({0, 5}, torch::kInt), 6); },
                                {"last entry", "6"});
  expect_error<c10::ValueError>([&] { call(torch::tensor({0, 6}, torch::kInt), 4); },
                                {"max_seqlen_q=4"});
  expect_error<c10::ValueError>(
      [&] {
        causal_attention::varlen_attention(q[0], q, q, torch::tensor({0, 6}, torch::kInt),
                                           torch::tensor({0, 6}, torch::kInt), 6, 6);
      },
      {"q must have 3 dimensions"});
}

}  // namespace
