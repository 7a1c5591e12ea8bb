// CPU kernels through the public C++ API and C++ autograd: values and gradients against
// at::scaled_dot_product_attention, lse, rows with no visible key, determinism across thread
// counts, and grad modes.
#include "../attention_test_utils.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Parallel.h>
#include <c10/core/InferenceMode.h>
#include <omp.h>

#include <limits>
#include <mutex>
#include <ostream>
#include <set>
#include <thread>

namespace causal_attention::tests {
namespace {

struct Shapes {
  const char* name;
  std::vector<int64_t> q, k, v;
  bool transposed = false;
  std::optional<double> scale = std::nullopt;
};

std::ostream& operator<<(std::ostream& os, const Shapes& s) {
  return os << s.name;
}

const std::vector<Shapes>& all_shapes() {
  static const std::vector<Shapes> shapes = {
      // Lq == Lk, more than one 64-row block.
      {"MultiHeadSquare", {2, 3, 70, 16}, {2, 3, 70, 16}, {2, 3, 70, 16}},
      {"GroupedQuery", {2, 6, 65, 8}, {2, 2, 65, 8}, {2, 2, 65, 8}},
      {"ShorterQueries", {1, 2, 37, 16}, {1, 2, 130, 16}, {1, 2, 130, 16}},
      {"GroupedShorterQueries", {2, 4, 20, 8}, {2, 1, 90, 8}, {2, 1, 90, 8}},
      {"ValueDimDiffers", {2, 2, 50, 24}, {2, 2, 50, 24}, {2, 2, 50, 10}},
      {"TwoDim", {45, 16}, {45, 16}, {45, 16}},
      {"TwoDimShorterQueries", {20, 16}, {77, 16}, {77, 12}},
      {"FiveDimGrouped", {2, 2, 4, 33, 8}, {2, 2, 2, 33, 8}, {2, 2, 2, 33, 8}},
      {"TransposedViews", {2, 3, 67, 16}, {2, 3, 67, 16}, {2, 3, 67, 16}, /*transposed=*/true},
      {"TransposedGroupedShorter", {2, 4, 30, 16}, {2, 2, 80, 16}, {2, 2, 80, 8}, true},
      {"ExplicitScale", {1, 2, 40, 16}, {1, 2, 40, 16}, {1, 2, 40, 16}, false, 0.37},
  };
  return shapes;
}

struct Inputs {
  at::Tensor q, k, v, grad_out;
};

Inputs make_inputs(const Shapes& s) {
  torch::manual_seed(0);
  Inputs in;
  in.q = make_input(s.q, s.transposed);
  in.k = make_input(s.k, s.transposed);
  in.v = make_input(s.v, s.transposed);
  std::vector<int64_t> out_shape = s.q;
  out_shape.back() = s.v.back();
  in.grad_out = torch::randn(out_shape, torch::kDouble);
  return in;
}

Inputs cast(const Inputs& in, at::ScalarType dtype) {
  return {cast_keep_layout(in.q, dtype), cast_keep_layout(in.k, dtype),
          cast_keep_layout(in.v, dtype), in.grad_out.to(dtype)};
}

ForwardBackward ours(const Inputs& in, std::optional<double> scale) {
  return tests::ours(in.q, in.k, in.v, in.grad_out, scale);
}

ForwardBackward reference(const Inputs& in, std::optional<double> scale) {
  return tests::reference(in.q, in.k, in.v, in.grad_out, scale);
}

class AgainstSdpa : public ::testing::TestWithParam<Shapes> {};

TEST_P(AgainstSdpa, Float64MatchesTightly) {
  const Shapes& s = GetParam();
  const Inputs in = make_inputs(s);
  if (s.transposed) {
    ASSERT_FALSE(in.q.is_contiguous());
  }
  const ForwardBackward got = ours(in, s.scale);
  const ForwardBackward ref = reference(in, s.scale);
  ASSERT_EQ(got.out.scalar_type(), at::kDouble);
  ASSERT_EQ(got.out.sizes(), ref.out.sizes());
  ASSERT_EQ(got.dq.sizes(), in.q.sizes());
  ASSERT_EQ(got.dk.sizes(), in.k.sizes());
  ASSERT_EQ(got.dv.sizes(), in.v.sizes());
  EXPECT_LE(max_abs_diff(got.out, ref.out), 1e-10);
  EXPECT_LE(max_abs_diff(got.dq, ref.dq), 1e-10);
  EXPECT_LE(max_abs_diff(got.dk, ref.dk), 1e-10);
  EXPECT_LE(max_abs_diff(got.dv, ref.dv), 1e-10);
  // The comparison is not vacuous.
  EXPECT_GT(max_abs(ref.dq), 1e-3);
  EXPECT_GT(max_abs(ref.dk), 1e-3);
}

TEST_P(AgainstSdpa, Float32WithinTwiceSdpaError) {
  const Shapes& s = GetParam();
  const Inputs in64 = make_inputs(s);
  const Inputs in32 = cast(in64, at::kFloat);
  if (s.transposed) {
    ASSERT_FALSE(in32.q.is_contiguous());
  }
  const ForwardBackward got = ours(in32, s.scale);
  const ForwardBackward sdpa32 = reference(in32, s.scale);
  const ForwardBackward ref = reference(in64, s.scale);
  ASSERT_EQ(got.out.scalar_type(), at::kFloat);
  ASSERT_EQ(got.dq.scalar_type(), at::kFloat);
  struct Compared {
    const char* name;
    at::Tensor got, sdpa32, ref64;
  };
  const Compared cases[] = {
      {"out", got.out, sdpa32.out, ref.out},
      {"dq", got.dq, sdpa32.dq, ref.dq},
      {"dk", got.dk, sdpa32.dk, ref.dk},
      {"dv", got.dv, sdpa32.dv, ref.dv},
  };
  for (const Compared& c : cases) {
    const double ours_err = max_abs_diff(c.got, c.ref64);
    const double sdpa_err = max_abs_diff(c.sdpa32, c.ref64);
    EXPECT_LE(ours_err, 2 * sdpa_err + 1e-6) << c.name << ": sdpa float32 error " << sdpa_err;
    // The float32 computation really differs from the float64 one (the bound is not vacuous).
    EXPECT_GT(ours_err, 0.0) << c.name;
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, AgainstSdpa, ::testing::ValuesIn(all_shapes()),
                         [](const ::testing::TestParamInfo<Shapes>& info) {
                           return std::string(info.param.name);
                         });

// bfloat16 and float16: float32 accumulation, so the error is the input and output rounding.
class ReducedPrecision : public ::testing::TestWithParam<at::ScalarType> {};

TEST_P(ReducedPrecision, MatchesFloat64ReferenceLoosely) {
  const at::ScalarType dtype = GetParam();
  for (const Shapes& s : {all_shapes()[1], all_shapes()[3], all_shapes()[9]}) {
    SCOPED_TRACE(s.name);
    const Inputs in64 = make_inputs(s);
    const Inputs low = cast(in64, dtype);
    // Reference on the rounded inputs, so that only the op's own error is measured.
    const ForwardBackward ref = reference(cast(low, at::kDouble), s.scale);
    const ForwardBackward got = ours(low, s.scale);
    ASSERT_EQ(got.out.scalar_type(), dtype);
    ASSERT_EQ(got.dq.scalar_type(), dtype);
    ASSERT_EQ(got.dk.scalar_type(), dtype);
    ASSERT_EQ(got.dv.scalar_type(), dtype);
    EXPECT_LE(max_abs_diff(got.out, ref.out), 2e-2 * std::max(1.0, max_abs(ref.out)));
    EXPECT_LE(max_abs_diff(got.dq, ref.dq), 2e-2 * std::max(1.0, max_abs(ref.dq)));
    EXPECT_LE(max_abs_diff(got.dk, ref.dk), 2e-2 * std::max(1.0, max_abs(ref.dk)));
    EXPECT_LE(max_abs_diff(got.dv, ref.dv), 2e-2 * std::max(1.0, max_abs(ref.dv)));
  }
}

INSTANTIATE_TEST_SUITE_P(Dtypes, ReducedPrecision, ::testing::Values(at::kBFloat16, at::kHalf),
                         [](const ::testing::TestParamInfo<at::ScalarType>& info) {
                           return std::string(c10::toString(info.param));
                         });

// `.backward()` on a sum: grad_out is an expanded (stride 0) tensor, and the inputs are
// transposed views of leaves, so the gradients flow through the views.
TEST(Backward, DotBackwardThroughViewsOfLeaves) {
  torch::manual_seed(1);
  const at::Tensor qb = torch::randn({2, 70, 4, 16}, torch::kDouble).requires_grad_(true);
  const at::Tensor kb = torch::randn({2, 70, 2, 16}, torch::kDouble).requires_grad_(true);
  const at::Tensor vb = torch::randn({2, 70, 2, 16}, torch::kDouble).requires_grad_(true);
  at::Tensor out =
      causal_attention::attention(qb.transpose(1, 2), kb.transpose(1, 2), vb.transpose(1, 2));
  ASSERT_NE(out.grad_fn(), nullptr);
  (out * out).sum().backward();
  ASSERT_TRUE(qb.grad().defined());
  ASSERT_TRUE(kb.grad().defined());
  ASSERT_TRUE(vb.grad().defined());

  const at::Tensor q = qb.detach().requires_grad_(true);
  const at::Tensor k = kb.detach().requires_grad_(true);
  const at::Tensor v = vb.detach().requires_grad_(true);
  at::Tensor ref = sdpa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), std::nullopt);
  (ref * ref).sum().backward();
  EXPECT_LE(max_abs_diff(out.detach(), ref.detach()), 1e-10);
  EXPECT_LE(max_abs_diff(qb.grad(), q.grad()), 1e-10);
  EXPECT_LE(max_abs_diff(kb.grad(), k.grad()), 1e-10);
  EXPECT_LE(max_abs_diff(vb.grad(), v.grad()), 1e-10);

  // A plain sum: grad_out is ones expanded with all strides zero.
  qb.mutable_grad().reset();
  causal_attention::attention(qb.transpose(1, 2), kb.transpose(1, 2), vb.transpose(1, 2))
      .sum()
      .backward();
  q.mutable_grad().reset();
  sdpa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), std::nullopt).sum().backward();
  EXPECT_LE(max_abs_diff(qb.grad(), q.grad()), 1e-10);
}

// attention_forward + attention_backward called directly give what autograd gives.
TEST(Backward, ExplicitOpsMatchAutograd) {
  const Shapes& s = all_shapes()[3];  // GroupedShorterQueries
  const Inputs in = make_inputs(s);
  const double scale = default_scale(in.q);
  auto [out, lse] = causal_attention::attention_forward(in.q, in.k, in.v, scale);
  auto [dq, dk, dv, dsinks] =
      causal_attention::attention_backward(in.grad_out, in.q, in.k, in.v, out, lse, scale);
  const ForwardBackward autograd = ours(in, std::nullopt);
  EXPECT_TRUE(torch::equal(out, autograd.out));
  EXPECT_TRUE(torch::equal(dq, autograd.dq));
  EXPECT_TRUE(torch::equal(dk, autograd.dk));
  EXPECT_TRUE(torch::equal(dv, autograd.dv));
  EXPECT_EQ(dsinks.numel(), 0);  // no sinks
  const ForwardBackward ref = reference(in, std::nullopt);
  EXPECT_LE(max_abs_diff(dq, ref.dq), 1e-10);
  EXPECT_LE(max_abs_diff(dk, ref.dk), 1e-10);
  EXPECT_LE(max_abs_diff(dv, ref.dv), 1e-10);
}

// Every score option at once through C++ autograd (no Python anywhere): out and the gradients of
// q, k, v and the sinks match the materialized attention_weights (its own composite autograd) in
// float64, with the same dropout mask from the same generator state, on the block path (L = 100)
// and the decode path (Lq = 3 against a cache); a C++ program trains a sink.
TEST(ScoreOptions, EveryOptionMatchesTheWeightsThroughCppAutograd) {
  torch::manual_seed(0);
  const auto opts = torch::TensorOptions().dtype(torch::kDouble);
  for (const int64_t len_q : {100, 3}) {
    SCOPED_TRACE(len_q);
    const at::Tensor q = torch::randn({2, 4, len_q, 16}, opts).requires_grad_(true);
    const at::Tensor k = torch::randn({2, 2, 100, 16}, opts).requires_grad_(true);
    const at::Tensor v = torch::randn({2, 2, 100, 8}, opts).requires_grad_(true);
    const at::Tensor sinks = torch::randn({4}, opts).requires_grad_(true);
    const at::Tensor slopes = torch::rand({2, 4});
    const auto options = [&] {
      return causal_attention::AttentionOptions()
          .window({30, 2})
          .softcap(4.0)
          .alibi_slopes(slopes)
          .sinks(sinks)
          .dropout_p(0.25)
          .generator(at::make_generator<at::CPUGeneratorImpl>(7));
    };
    const at::Tensor out = causal_attention::attention(q, k, v, options());
    const at::Tensor weights = causal_attention::attention_weights(q, k, v, options());
    const at::Tensor reference = at::matmul(weights, v.repeat_interleave(2, 1));
    const at::Tensor grad_out = torch::randn_like(out);
    const auto ours = torch::autograd::grad({out}, {q, k, v, sinks}, {grad_out});
    const auto theirs = torch::autograd::grad({reference}, {q, k, v, sinks}, {grad_out});
    EXPECT_LE(max_abs_diff(out, reference), 1e-12);
    for (size_t i = 0; i < ours.size(); ++i) {
      SCOPED_TRACE(i);
      EXPECT_LE(max_abs_diff(ours[i], theirs[i]), 1e-11);
    }
    EXPECT_GT(ours[3].abs().max().item<double>(), 1e-3);  // the sinks do get a gradient
  }
}

TEST(Lse, MatchesNaiveLogsumexp) {
  for (const Shapes& s : all_shapes()) {
    SCOPED_TRACE(s.name);
    const Inputs in = make_inputs(s);
    const double scale = s.scale.value_or(default_scale(in.q));
    const at::Tensor expected = naive_lse(in.q, in.k, scale);
    {
      auto [out, lse] = causal_attention::attention_forward(in.q, in.k, in.v, scale);
      ASSERT_EQ(lse.scalar_type(), at::kDouble);
      ASSERT_EQ(lse.sizes(), expected.sizes());
      EXPECT_LE(max_abs_diff(lse, expected), 1e-12);
      EXPECT_TRUE(torch::equal(
          out, causal_attention::attention(in.q, in.k, in.v, AttentionOptions().scale(s.scale))));
    }
    {
      const Inputs in32 = cast(in, at::kFloat);
      auto [out, lse] = causal_attention::attention_forward(in32.q, in32.k, in32.v, scale);
      ASSERT_EQ(lse.scalar_type(), at::kFloat);
      EXPECT_LE(max_abs_diff(lse, expected), 1e-4);
    }
    {
      const Inputs in16 = cast(in, at::kBFloat16);
      auto [out, lse] = causal_attention::attention_forward(in16.q, in16.k, in16.v, scale);
      ASSERT_EQ(lse.scalar_type(), at::kFloat);
      EXPECT_LE(max_abs_diff(lse, naive_lse(in16.q, in16.k, scale)), 1e-4);
    }
  }
}

// Lq > Lk: query rows i < Lq - Lk see no key.
TEST(EmptyRows, ZeroOutputMinusInfLseZeroGradient) {
  for (at::ScalarType dtype : {at::kDouble, at::kFloat, at::kBFloat16}) {
    SCOPED_TRACE(c10::toString(dtype));
    torch::manual_seed(2);
    const int64_t len_q = 80, len_k = 7, empty = len_q - len_k;
    const at::Tensor q = torch::randn({2, 4, len_q, 8}, torch::kDouble).to(dtype);
    const at::Tensor k = torch::randn({2, 2, len_k, 8}, torch::kDouble).to(dtype);
    const at::Tensor v = torch::randn({2, 2, len_k, 8}, torch::kDouble).to(dtype);
    const at::Tensor grad_out = torch::randn({2, 4, len_q, 8}, torch::kDouble).to(dtype);
    const double scale = default_scale(q);

    auto [out, lse] = causal_attention::attention_forward(q, k, v, scale);
    const at::Tensor empty_out = out.narrow(-2, 0, empty);
    const at::Tensor empty_lse = lse.narrow(-1, 0, empty);
    EXPECT_TRUE(torch::equal(empty_out, torch::zeros_like(empty_out)));
    EXPECT_TRUE(at::all(at::isneginf(empty_lse)).item<bool>());
    EXPECT_TRUE(at::all(at::isfinite(lse.narrow(-1, empty, len_k))).item<bool>());
    EXPECT_TRUE(at::all(at::isfinite(out)).item<bool>());

    const ForwardBackward got = tests::ours(q, k, v, grad_out, std::nullopt);
    EXPECT_TRUE(at::all(at::isfinite(got.dq)).item<bool>());
    EXPECT_TRUE(at::all(at::isfinite(got.dk)).item<bool>());
    EXPECT_TRUE(at::all(at::isfinite(got.dv)).item<bool>());
    const at::Tensor empty_dq = got.dq.narrow(-2, 0, empty);
    EXPECT_TRUE(torch::equal(empty_dq, torch::zeros_like(empty_dq)));

    // The rows that see keys form an ordinary Lk x Lk causal problem.
    const at::Tensor q_seen = q.narrow(-2, empty, len_k).to(at::kDouble);
    const ForwardBackward ref =
        tests::reference(q_seen, k.to(at::kDouble), v.to(at::kDouble),
                         grad_out.narrow(-2, empty, len_k).to(at::kDouble), scale);
    const double tol = dtype == at::kDouble ? 1e-10 : dtype == at::kFloat ? 1e-5 : 5e-2;
    EXPECT_LE(max_abs_diff(got.out.narrow(-2, empty, len_k), ref.out), tol);
    EXPECT_LE(max_abs_diff(got.dq.narrow(-2, empty, len_k), ref.dq), tol);
    EXPECT_LE(max_abs_diff(got.dk, ref.dk), tol * std::max(1.0, max_abs(ref.dk)));
    EXPECT_LE(max_abs_diff(got.dv, ref.dv), tol * std::max(1.0, max_abs(ref.dv)));
  }
}

// Lk == 0: every row is empty. Lq == 0: nothing to compute, and dk, dv are zero.
TEST(EmptyRows, ZeroLengthSequences) {
  torch::manual_seed(3);
  {
    const at::Tensor q = torch::randn({2, 3, 5, 4}, torch::kDouble);
    const at::Tensor kv = torch::randn({2, 3, 0, 4}, torch::kDouble);
    auto [out, lse] = causal_attention::attention_forward(q, kv, kv, 0.5);
    EXPECT_EQ(out.sizes(), q.sizes());
    EXPECT_TRUE(torch::equal(out, torch::zeros_like(out)));
    EXPECT_TRUE(at::all(at::isneginf(lse)).item<bool>());
    const ForwardBackward got = tests::ours(q, kv, kv, torch::randn_like(q), std::nullopt);
    EXPECT_TRUE(torch::equal(got.dq, torch::zeros_like(q)));
    EXPECT_EQ(got.dk.sizes(), kv.sizes());
    EXPECT_EQ(got.dv.sizes(), kv.sizes());
  }
  {
    const at::Tensor q = torch::randn({2, 3, 0, 4}, torch::kDouble);
    const at::Tensor k = torch::randn({2, 3, 6, 4}, torch::kDouble);
    const at::Tensor v = torch::randn({2, 3, 6, 5}, torch::kDouble);
    auto [out, lse] = causal_attention::attention_forward(q, k, v, 0.5);
    EXPECT_EQ(out.sizes(), (std::vector<int64_t>{2, 3, 0, 5}));
    EXPECT_EQ(lse.sizes(), (std::vector<int64_t>{2, 3, 0}));
    const ForwardBackward got =
        tests::ours(q, k, v, torch::randn({2, 3, 0, 5}, torch::kDouble), std::nullopt);
    EXPECT_EQ(got.dq.sizes(), q.sizes());
    EXPECT_TRUE(torch::equal(got.dk, torch::zeros_like(k)));
    EXPECT_TRUE(torch::equal(got.dv, torch::zeros_like(v)));
  }
}

// Every output element is produced by one task in a fixed order, so the thread count must not
// change a single bit.
TEST(Determinism, BitwiseEqualAcrossThreadCounts) {
  NumThreadsGuard restore;
  for (at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
    for (const Shapes& s : {Shapes{"Grouped", {2, 4, 150, 32}, {2, 2, 150, 32}, {2, 2, 150, 32}},
                            Shapes{"Shorter", {1, 4, 70, 16}, {1, 4, 200, 16}, {1, 4, 200, 24}}}) {
      SCOPED_TRACE(std::string(s.name) + " " + c10::toString(dtype));
      const Inputs in = cast(make_inputs(s), dtype);
      const double scale = default_scale(in.q);
      std::vector<std::vector<at::Tensor>> runs;
      for (int threads : {1, 2, 2}) {
        at::set_num_threads(threads);
        ASSERT_EQ(at::get_num_threads(), threads);
        auto [out, lse] = causal_attention::attention_forward(in.q, in.k, in.v, scale);
        const ForwardBackward fb = ours(in, std::nullopt);
        runs.push_back({out, lse, fb.out, fb.dq, fb.dk, fb.dv});
      }
      for (size_t r = 1; r < runs.size(); ++r) {
        for (size_t i = 0; i < runs[0].size(); ++i) {
          EXPECT_TRUE(torch::equal(runs[0][i], runs[r][i])) << "run " << r << " tensor " << i;
        }
      }
    }
  }
}

// The binary is built with OpenMP, so at::parallel_for really runs on the threads asked for.
TEST(Determinism, ParallelForUsesTwoThreads) {
  NumThreadsGuard restore;
  at::set_num_threads(2);
  ASSERT_EQ(at::get_num_threads(), 2);
  std::mutex mutex;
  std::set<int> omp_ids;
  std::set<std::thread::id> thread_ids;
  at::parallel_for(0, 64, 1, [&](int64_t begin, int64_t end) {
    std::lock_guard<std::mutex> lock(mutex);
    omp_ids.insert(omp_get_thread_num());
    thread_ids.insert(std::this_thread::get_id());
  });
  EXPECT_EQ(omp_ids.size(), 2u);
  EXPECT_EQ(thread_ids.size(), 2u);
}

TEST(GradMode, NoGradGuardGivesNoGraph) {
  const Inputs in = make_inputs(all_shapes()[1]);
  const at::Tensor q = in.q.detach().requires_grad_(true);
  const at::Tensor expected = causal_attention::attention(in.q, in.k, in.v);
  {
    torch::NoGradGuard no_grad;
    const at::Tensor out = causal_attention::attention(q, in.k, in.v);
    EXPECT_EQ(out.grad_fn(), nullptr);
    EXPECT_FALSE(out.requires_grad());
    EXPECT_TRUE(torch::equal(out, expected));
    auto [out2, lse] = causal_attention::attention_forward(q, in.k, in.v, default_scale(q));
    EXPECT_EQ(out2.grad_fn(), nullptr);
    EXPECT_TRUE(torch::equal(out2, expected));
  }
  const at::Tensor out = causal_attention::attention(q, in.k, in.v);
  EXPECT_NE(out.grad_fn(), nullptr);
  EXPECT_TRUE(out.requires_grad());
}

TEST(GradMode, InferenceModeRuns) {
  const Inputs in = make_inputs(all_shapes()[3]);
  const at::Tensor expected = causal_attention::attention(in.q, in.k, in.v);
  c10::InferenceMode guard;
  const at::Tensor q = in.q.clone();
  ASSERT_TRUE(q.is_inference());
  const at::Tensor out = causal_attention::attention(q, in.k, in.v);
  EXPECT_TRUE(out.is_inference());
  EXPECT_FALSE(out.requires_grad());
  EXPECT_TRUE(torch::equal(out, expected));
  auto [out2, lse] = causal_attention::attention_forward(q, in.k, in.v, default_scale(q));
  EXPECT_TRUE(torch::equal(out2, expected));
  EXPECT_EQ(lse.sizes(), (std::vector<int64_t>{2, 4, 20}));
}

}  // namespace
}  // namespace causal_attention::tests
