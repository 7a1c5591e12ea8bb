// The bad-input battery, from C++: a table of malformed calls of every public entry point
// (attention, attention_forward, attention_backward, attention_weights; with and without inputs
// that require grad), each of which must throw exactly c10::ValueError, c10::TypeError or
// c10::NotImplementedError with a message naming the offending argument.
// test_attention_errors.cpp checks the messages of the common mistakes in detail; this table is
// about breadth: undefined tensors, every argument position, exotic dtypes, devices, non-finite
// scales (in the accumulation dtype), nested and sparse tensors. scripts/sanitize.sh runs it under
// ASan and UBSan.
#include "../attention_test_utils.h"

#include <ATen/ATen.h>
#include <torch/nested.h>

#include <functional>
#include <limits>
#include <set>
#include <string>

namespace causal_attention::tests {
namespace {

enum class Expect { kValueError, kTypeError, kNotImplementedError };

struct BadCall {
  std::string name;
  Expect expect;
  std::vector<const char*> needles;  // the message contains each (argument names among them)
  std::function<void()> call;
};

at::Tensor on_meta(const at::Tensor& t) {
  return t.to(at::TensorOptions().device(at::kMeta));
}

// t's batch items (dim 0) as a nested tensor, the last one a row shorter: ragged, so it has no
// sizes to report.
at::Tensor nested(const at::Tensor& t) {
  std::vector<at::Tensor> items = t.unbind(0);
  items.back() = items.back().narrow(0, 0, items.back().size(0) - 1);
  return torch::nested::as_nested_tensor(items);
}

// A valid call: q (2, 4, 5, 8), k (2, 2, 6, 8), v (2, 2, 6, 3); out (2, 4, 5, 3), lse (2, 4, 5).
struct Valid {
  at::Tensor q = torch::randn({2, 4, 5, 8}), k = torch::randn({2, 2, 6, 8}),
             v = torch::randn({2, 2, 6, 3});
  at::Tensor out = torch::randn({2, 4, 5, 3}), grad_out = torch::randn({2, 4, 5, 3});
  at::Tensor lse = torch::randn({2, 4, 5});
};

// attention_backward on the valid call with one argument replaced.
std::function<void()> backward_with(const char* argument, at::Tensor replacement,
                                    double scale = 0.5) {
  return [argument, replacement, scale] {
    Valid a;
    const std::string name = argument;
    at::Tensor* slots[] = {&a.grad_out, &a.q, &a.k, &a.v, &a.out, &a.lse};
    const char* names[] = {"grad_out", "q", "k", "v", "out", "lse"};
    for (size_t i = 0; i < 6; ++i) {
      if (name == names[i]) {
        *slots[i] = replacement;
      }
    }
    causal_attention::attention_backward(a.grad_out, a.q, a.k, a.v, a.out, a.lse, scale);
  };
}

std::function<void()> attention(at::Tensor q, at::Tensor k, at::Tensor v,
                                std::optional<double> scale = std::nullopt,
                                std::optional<at::Tensor> key_mask = std::nullopt) {
  return [=] { causal_attention::attention(q, k, v, scale, key_mask); };
}

std::function<void()> forward(at::Tensor q, at::Tensor k, at::Tensor v, double scale = 0.5) {
  return [=] { causal_attention::attention_forward(q, k, v, scale); };
}

// The same call with q requiring grad: the Autograd kernel must check before anything else.
std::function<void()> attention_grad(at::Tensor q, at::Tensor k, at::Tensor v,
                                     std::optional<double> scale = std::nullopt) {
  return [=] {
    const at::Tensor leaf = q.defined() ? q.detach().requires_grad_(true) : q;
    const at::Tensor k_leaf = k.defined() ? k.detach().requires_grad_(true) : k;
    causal_attention::attention(leaf, k_leaf, v, scale);
  };
}

std::vector<BadCall> battery() {
  using E = Expect;
  const at::Tensor none;
  const Valid a;
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const double inf = std::numeric_limits<double>::infinity();
  return {
      // Undefined tensors: TypeError naming the argument.
      {"attention q undefined", E::kTypeError, {"q must be a tensor"}, attention(none, a.k, a.v)},
      {"attention k undefined", E::kTypeError, {"k must be a tensor"}, attention(a.q, none, a.v)},
      {"attention v undefined", E::kTypeError, {"v must be a tensor"}, attention(a.q, a.k, none)},
      {"attention (grad) q undefined",
       E::kTypeError,
       {"q must be a tensor"},
       attention_grad(none, a.k, a.v)},
      {"forward q undefined", E::kTypeError, {"q must be a tensor"}, forward(none, a.k, a.v)},
      {"forward v undefined", E::kTypeError, {"v must be a tensor"}, forward(a.q, a.k, none)},
      {"backward grad_out undefined",
       E::kTypeError,
       {"grad_out must be a tensor"},
       backward_with("grad_out", none)},
      {"backward q undefined", E::kTypeError, {"q must be a tensor"}, backward_with("q", none)},
      {"backward k undefined", E::kTypeError, {"k must be a tensor"}, backward_with("k", none)},
      {"backward v undefined", E::kTypeError, {"v must be a tensor"}, backward_with("v", none)},
      {"backward out undefined",
       E::kTypeError,
       {"out must be a tensor"},
       backward_with("out", none)},
      {"backward lse undefined",
       E::kTypeError,
       {"lse must be a tensor"},
       backward_with("lse", none)},
      {"weights v undefined",
       E::kTypeError,
       {"v must be a tensor"},
       [=] { causal_attention::attention_weights(a.q, a.k, none); }},
      // Dtypes: TypeError naming the argument and the dtype.
      {"q bool",
       E::kTypeError,
       {"q.dtype=Bool"},
       attention(a.q.to(at::kBool), a.k.to(at::kBool), a.v.to(at::kBool))},
      {"k uint8", E::kTypeError, {"k.dtype=Byte"}, attention(a.q, a.k.to(at::kByte), a.v)},
      {"v int16", E::kTypeError, {"v.dtype=Short"}, forward(a.q, a.k, a.v.to(at::kShort))},
      {"q complex128",
       E::kTypeError,
       {"q.dtype=ComplexDouble"},
       attention(a.q.to(at::kComplexDouble), a.k, a.v)},
      {"k float8_e5m2",
       E::kTypeError,
       {"k.dtype=Float8_e5m2"},
       attention(a.q, a.k.to(at::kFloat8_e5m2), a.v)},
      {"q quantized",
       E::kTypeError,
       {"q.dtype=QInt8"},
       attention(at::quantize_per_tensor(a.q, 0.1, 0, at::kQInt8), a.k, a.v)},
      {"half q, bfloat16 k",
       E::kTypeError,
       {"same dtype", "k.dtype=BFloat16"},
       attention(a.q.to(at::kHalf), a.k.to(at::kBFloat16), a.v.to(at::kHalf))},
      {"double q and k, float v",
       E::kTypeError,
       {"same dtype", "v.dtype=Float"},
       attention_grad(a.q.to(at::kDouble), a.k.to(at::kDouble), a.v)},
      {"backward out half",
       E::kTypeError,
       {"out.dtype=Half"},
       backward_with("out", a.out.to(at::kHalf))},
      {"backward grad_out bfloat16",
       E::kTypeError,
       {"grad_out.dtype=BFloat16"},
       backward_with("grad_out", a.grad_out.to(at::kBFloat16))},
      {"backward lse int64",
       E::kTypeError,
       {"lse must have dtype Float", "lse.dtype=Long"},
       backward_with("lse", a.lse.to(at::kLong))},
      // Shapes: ValueError naming the argument and showing the shapes.
      {"q 1-D",
       E::kValueError,
       {"q must have at least 2", "q.shape=[8]"},
       attention(torch::randn({8}), a.k, a.v)},
      {"v 0-D",
       E::kValueError,
       {"v must have at least 2", "v.shape=[]"},
       forward(a.q, a.k, torch::randn({}))},
      {"2-D q, 3-D k",
       E::kValueError,
       {"number of dimensions", "q.shape=[5, 8]"},
       attention(torch::randn({5, 8}), torch::randn({2, 6, 8}), torch::randn({2, 6, 3}))},
      {"6-D inner batch differs",
       E::kValueError,
       {"leading (batch)", "k.shape=[2, 3, 2, 2, 6, 8]"},
       attention(torch::randn({2, 2, 2, 4, 5, 8}), torch::randn({2, 3, 2, 2, 6, 8}),
                 torch::randn({2, 2, 2, 2, 6, 3}))},
      {"2-D head dims differ",
       E::kValueError,
       {"head dimension D", "k.shape=[6, 7]"},
       attention(torch::randn({5, 8}), torch::randn({6, 7}), torch::randn({6, 3}))},
      {"head dim 0 with a scale",
       E::kValueError,
       {"must be positive", "q.shape=[2, 4, 5, 0]"},
       attention(torch::randn({2, 4, 5, 0}), torch::randn({2, 2, 6, 0}), a.v, 0.5)},
      {"k, v lengths differ",
       E::kValueError,
       {"Lk", "v.shape=[2, 2, 7, 3]"},
       attention_grad(a.q, a.k, torch::randn({2, 2, 7, 3}))},
      {"Hq not a multiple of Hkv",
       E::kValueError,
       {"multiple", "q.shape=[2, 3, 5, 8]"},
       forward(torch::randn({2, 3, 5, 8}), a.k, a.v)},
      {"Hkv 0 with Hq 4",
       E::kValueError,
       {"multiple", "k.shape=[2, 0, 6, 8]"},
       attention(a.q, torch::randn({2, 0, 6, 8}), torch::randn({2, 0, 6, 3}))},
      {"k, v heads differ",
       E::kValueError,
       {"same number of heads", "v.shape=[2, 1, 6, 3]"},
       attention(a.q, a.k, torch::randn({2, 1, 6, 3}))},
      {"weights head dims differ",
       E::kValueError,
       {"head dimension D", "k.shape=[2, 2, 6, 9]"},
       [=] {
         causal_attention::attention_weights(a.q, torch::randn({2, 2, 6, 9}), a.v);
       }},
      {"backward grad_out Dv",
       E::kValueError,
       {"grad_out.shape=[2, 4, 5, 8]"},
       backward_with("grad_out", torch::randn({2, 4, 5, 8}))},
      {"backward out Lq",
       E::kValueError,
       {"out.shape=[2, 4, 6, 3]"},
       backward_with("out", torch::randn({2, 4, 6, 3}))},
      {"backward lse keepdim",
       E::kValueError,
       {"lse.shape=[2, 4, 5, 1]"},
       backward_with("lse", torch::randn({2, 4, 5, 1}))},
      {"backward lse kv heads",
       E::kValueError,
       {"lse.shape=[2, 2, 5]"},
       backward_with("lse", torch::randn({2, 2, 5}))},
      {"backward q head dim",
       E::kValueError,
       {"head dimension D", "q.shape=[2, 4, 5, 9]"},
       backward_with("q", torch::randn({2, 4, 5, 9}))},
      // Scale: ValueError.
      {"attention scale NaN",
       E::kValueError,
       {"scale must be finite"},
       attention(a.q, a.k, a.v, nan)},
      {"attention (grad) scale inf",
       E::kValueError,
       {"scale must be finite", "scale=inf"},
       attention_grad(a.q, a.k, a.v, inf)},
      {"forward scale -inf",
       E::kValueError,
       {"scale must be finite", "scale=-inf"},
       forward(a.q, a.k, a.v, -inf)},
      {"backward scale NaN",
       E::kValueError,
       {"scale must be finite"},
       backward_with("q", a.q, nan)},
      // Finite doubles, but inf in float32, where the kernels compute for all but float64.
      {"attention scale 1e39",
       E::kValueError,
       {"scale must be finite in float32, the accumulation dtype of q.dtype=Float", "scale=1e+39"},
       attention(a.q, a.k, a.v, 1e39)},
      {"attention (grad) scale -1e39",
       E::kValueError,
       {"scale must be finite in float32", "scale=-1e+39"},
       attention_grad(a.q, a.k, a.v, -1e39)},
      {"forward bfloat16 scale 4e38",
       E::kValueError,
       {"attention_forward: scale must be finite in float32", "q.dtype=BFloat16"},
       forward(a.q.to(at::kBFloat16), a.k.to(at::kBFloat16), a.v.to(at::kBFloat16), 4e38)},
      {"backward scale 1e39", E::kValueError, {"finite in float32"}, backward_with("q", a.q, 1e39)},
      {"weights half scale 1e39",
       E::kValueError,
       {"attention_weights: scale must be finite in float32", "q.dtype=Half"},
       [=] {
         causal_attention::attention_weights(a.q.to(at::kHalf), a.k.to(at::kHalf),
                                             a.v.to(at::kHalf), 1e39);
       }},
      {"forward float64 scale inf",
       E::kValueError,
       {"scale must be finite in float64, the accumulation dtype of q.dtype=Double"},
       forward(a.q.to(at::kDouble), a.k.to(at::kDouble), a.v.to(at::kDouble), inf)},
      // Nested and sparse tensors: NotImplementedError naming the argument.
      {"attention q nested",
       E::kNotImplementedError,
       {"q must be a dense tensor, got a nested tensor"},
       attention(nested(a.q), a.k, a.v)},
      {"attention (grad) k nested",
       E::kNotImplementedError,
       {"k must be a dense tensor, got a nested tensor"},
       attention_grad(a.q, nested(a.k), a.v)},
      {"attention key_mask nested",
       E::kNotImplementedError,
       {"key_mask must be a dense tensor, got a nested tensor"},
       attention(a.q, a.k, a.v, std::nullopt, nested(torch::ones({2, 6}, torch::kBool)))},
      {"backward grad_out nested",
       E::kNotImplementedError,
       {"attention_backward: grad_out must be a dense tensor"},
       backward_with("grad_out", nested(a.grad_out))},
      {"attention v sparse",
       E::kNotImplementedError,
       {"v must be a dense (strided) tensor, got v.layout=Sparse"},
       attention(a.q, a.k, a.v.to_sparse())},
      {"attention key_mask sparse",
       E::kNotImplementedError,
       {"key_mask.layout=Sparse"},
       attention(a.q, a.k, a.v, std::nullopt, torch::ones({2, 6}, torch::kBool).to_sparse())},
      {"forward q sparse CSR",
       E::kNotImplementedError,
       {"attention_forward: q must be a dense", "q.layout=SparseCsr"},
       forward(a.q.to_sparse_csr(), a.k, a.v)},
      {"backward lse sparse",
       E::kNotImplementedError,
       {"lse.layout=Sparse"},
       backward_with("lse", a.lse.to_sparse())},
      {"weights q mkldnn",
       E::kNotImplementedError,
       {"attention_weights: q must be a dense", "q.layout=Mkldnn"},
       [=] { causal_attention::attention_weights(a.q.to_mkldnn(), a.k, a.v); }},
      // Devices: ValueError naming the devices.
      {"q meta, k and v cpu",
       E::kValueError,
       {"same device", "q.device=meta", "k.device=cpu"},
       attention(on_meta(a.q), a.k, a.v)},
      {"backward lse meta",
       E::kValueError,
       {"lse must be on q's device cpu"},
       backward_with("lse", on_meta(a.lse))},
      {"backward out meta",
       E::kValueError,
       {"out and lse must be on q's device cpu"},
       backward_with("out", on_meta(a.out))},
  };
}

TEST(BadInputs, BatteryIsLargeAndNamesAreUnique) {
  const auto table = battery();
  EXPECT_GE(table.size(), 40u);
  std::set<std::string> names;
  for (const BadCall& c : table) {
    EXPECT_TRUE(names.insert(c.name).second) << "duplicate case " << c.name;
  }
}

TEST(BadInputs, EveryCallThrowsItsDocumentedTypeNamingTheArgument) {
  torch::manual_seed(0);
  for (const BadCall& c : battery()) {
    SCOPED_TRACE(c.name);
    std::vector<const char*> needles = c.needles;
    needles.push_back("causal_attention.");  // and the op
    if (c.expect == Expect::kValueError) {
      expect_error<c10::ValueError>(c.call, needles);
    } else if (c.expect == Expect::kTypeError) {
      expect_error<c10::TypeError>(c.call, needles);
    } else {
      expect_error<c10::NotImplementedError>(c.call, needles);
    }
  }
}

TEST(BadInputs, ValidCallOfTheBatterySucceeds) {
  // The replacements above are what makes each call bad: the base call is fine.
  backward_with("q", Valid().q)();
  attention_grad(Valid().q, Valid().k, Valid().v)();
  forward(Valid().q, Valid().k, Valid().v)();
  attention(Valid().q, Valid().k, Valid().v, std::nullopt, torch::ones({2, 6}, torch::kBool))();
}

TEST(BadInputs, ScalesFiniteInTheAccumulationDtypeAreAccepted) {
  // float64 inputs accumulate in float64, where 1e39 is an ordinary number; float32 takes up
  // to FLT_MAX.
  const at::Tensor zeros = torch::zeros({2, 3, 4}, torch::kDouble);
  const at::Tensor out = causal_attention::attention(zeros, zeros, zeros, 1e39);
  EXPECT_TRUE(out.isfinite().all().item<bool>());
  const double float32_max = std::numeric_limits<float>::max();
  const at::Tensor zeros32 = zeros.to(at::kFloat);
  EXPECT_NO_THROW(causal_attention::attention(zeros32, zeros32, zeros32, float32_max));
}

}  // namespace
}  // namespace causal_attention::tests
