// Bad input, from C++: one table of malformed calls of every public entry point (attention,
// attention_forward, attention_backward, attention_weights, varlen_attention for the score
// options; with and without inputs that require grad), a GoogleTest case per row. Each must throw
// exactly the documented c10::ValueError (shapes, devices, scale), c10::TypeError (undefined
// tensors, dtypes) or c10::NotImplementedError (nested and sparse tensors) with a message naming
// the op and the offending argument and showing what was seen. Then what is not a row: the valid
// call the table spoils, scales finite in the accumulation dtype, and the refused double backward.
// scripts/sanitize.sh runs it under ASan and UBSan.
#include "../attention_test_utils.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <torch/nested.h>

#include <cctype>
#include <functional>
#include <limits>
#include <ostream>
#include <set>
#include <string>

namespace causal_attention::tests {
namespace {

enum class Expect { kValueError, kTypeError, kNotImplementedError };

// A row: the case's name, the exception type, what the message contains (argument names among
// them), and the call.
struct BadCall {
  std::string name;
  Expect expect;
  std::vector<const char*> needles;
  std::function<void()> call;
};

void PrintTo(const BadCall& c, std::ostream* os) {
  *os << c.name;
}

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

// The valid call: q (2, 4, 5, 8), k (2, 2, 6, 8), v (2, 2, 6, 3); out (2, 4, 5, 3), lse (2, 4, 5).
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
  return [=] {
    causal_attention::attention(q, k, v, AttentionOptions().scale(scale).key_mask(key_mask));
  };
}

std::function<void()> forward(at::Tensor q, at::Tensor k, at::Tensor v, double scale = 0.5) {
  return [=] { causal_attention::attention_forward(q, k, v, scale); };
}

// The same call with q and k requiring grad (where they are floating-point tensors): the
// Autograd kernel must check before anything else.
std::function<void()> attention_grad(at::Tensor q, at::Tensor k, at::Tensor v,
                                     std::optional<double> scale = std::nullopt) {
  return [=] {
    const auto leaf = [](const at::Tensor& t) {
      return t.defined() && t.is_floating_point() ? t.detach().requires_grad_(true) : t;
    };
    causal_attention::attention(leaf(q), leaf(k), v, AttentionOptions().scale(scale));
  };
}

// A bad q, k, v through every forward entry point: attention without and with a scale,
// attention_forward, and attention on inputs that require grad (floating-point ones).
void add_forward_rows(std::vector<BadCall>& rows, const std::string& name, Expect expect,
                      std::vector<const char*> needles, at::Tensor q, at::Tensor k, at::Tensor v) {
  rows.push_back({name + " attention", expect, needles, attention(q, k, v)});
  rows.push_back({name + " attention scale 0.5", expect, needles, attention(q, k, v, 0.5)});
  rows.push_back({name + " forward", expect, needles, forward(q, k, v)});
  if (q.is_floating_point()) {
    rows.push_back({name + " attention (grad)", expect, needles, attention_grad(q, k, v)});
  }
}

at::Tensor rand(std::vector<int64_t> shape, at::ScalarType dtype = at::kFloat) {
  return torch::randn(shape, torch::kDouble).to(dtype);
}

// The options of one call (options.h), defaults unless a row spoils one, and the kernel ops'
// dropout seed.
struct Options {
  AttentionOptions options;
  std::optional<at::Tensor> dropout_seed = torch::zeros({2}, torch::kLong);
};

// The valid call with `o` through every entry point that takes score options: attention (and
// with inputs that require grad), attention_forward, attention_backward, attention_weights, and
// varlen_attention on the valid call's rows packed as two sequences of 5 queries and 6 keys.
void add_option_rows(std::vector<BadCall>& rows, const std::string& name, Expect expect,
                     std::vector<const char*> needles, const Options& o) {
  const Valid a;
  const auto leaf = [](const at::Tensor& t) { return t.detach().requires_grad_(true); };
  const auto packed = [](const at::Tensor& t) { return t.transpose(1, 2).flatten(0, 1); };
  const at::Tensor cu_q = torch::tensor({0, 5, 10}, torch::kInt);
  const at::Tensor cu_k = torch::tensor({0, 6, 12}, torch::kInt);
  const std::pair<const char*, std::function<void()>> calls[] = {
      {"attention", [=] { causal_attention::attention(a.q, a.k, a.v, o.options); }},
      {"attention (grad)",
       [=] { causal_attention::attention(leaf(a.q), leaf(a.k), a.v, o.options); }},
      {"forward",
       [=] { causal_attention::attention_forward(a.q, a.k, a.v, 0.5, o.options, o.dropout_seed); }},
      {"backward",
       [=] {
         causal_attention::attention_backward(a.grad_out, a.q, a.k, a.v, a.out, a.lse, 0.5,
                                              o.options, o.dropout_seed);
       }},
      {"weights", [=] { causal_attention::attention_weights(a.q, a.k, a.v, o.options); }},
      {"varlen",
       [=] {
         // Per-sequence slopes are (N, Hq): a (batch, Hq) tensor of the dense call fits.
         causal_attention::varlen_attention(packed(a.q), packed(a.k), packed(a.v), cu_q, cu_k, 5, 6,
                                            o.options);
       }},
  };
  for (const auto& [entry, call] : calls) {
    rows.push_back({name + " " + entry, expect, needles, call});
  }
}

void add_score_option_rows(std::vector<BadCall>& rows) {
  using E = Expect;
  const auto with = [](auto change) {
    Options o;
    change(o);
    return o;
  };
  // A window of other than two entries cannot be written in C++ (Window is std::array<int64_t,
  // 2>); the Python tests refuse it.
  add_option_rows(rows, "window below -1", E::kValueError, {"window", ">= -1", "[-2, 0]"},
                  with([](Options& o) { o.options.window({-2, 0}); }));
  add_option_rows(rows, "softcap 0", E::kValueError, {"softcap", "> 0", "softcap=0"},
                  with([](Options& o) { o.options.softcap(0.0); }));
  add_option_rows(rows, "softcap inf in float32", E::kValueError,
                  {"softcap must be finite and > 0 in float32", "softcap=1e+39"},
                  with([](Options& o) { o.options.softcap(1e39); }));
  add_option_rows(rows, "softcap 0 in float32", E::kValueError,
                  {"softcap must be finite and > 0 in float32", "softcap=1e-46"},
                  with([](Options& o) { o.options.softcap(1e-46); }));
  add_option_rows(
      rows, "softcap inf", E::kValueError, {"softcap", "finite", "softcap=inf"},
      with([](Options& o) { o.options.softcap(std::numeric_limits<double>::infinity()); }));
  add_option_rows(
      rows, "slopes double", E::kTypeError, {"alibi_slopes", "float32", "Double"},
      with([](Options& o) { o.options.alibi_slopes(torch::ones({4}, torch::kDouble)); }));
  add_option_rows(rows, "slopes 3 heads", E::kValueError, {"alibi_slopes.shape=[3]", "(Hq,)"},
                  with([](Options& o) { o.options.alibi_slopes(torch::ones({3})); }));
  add_option_rows(rows, "slopes meta", E::kValueError, {"alibi_slopes", "device"},
                  with([](Options& o) { o.options.alibi_slopes(on_meta(torch::ones({4}))); }));
  add_option_rows(rows, "sinks int64", E::kTypeError, {"sinks", "sinks.dtype=Long"},
                  with([](Options& o) { o.options.sinks(torch::ones({4}, torch::kLong)); }));
  add_option_rows(rows, "sinks 2-D", E::kValueError, {"sinks.shape=[1, 4]", "(Hq,)"},
                  with([](Options& o) { o.options.sinks(torch::ones({1, 4})); }));
  add_option_rows(rows, "sinks meta", E::kValueError, {"sinks", "device"},
                  with([](Options& o) { o.options.sinks(on_meta(torch::ones({4}))); }));
  add_option_rows(rows, "dropout_p 1", E::kValueError, {"dropout_p", "[0, 1)", "dropout_p=1"},
                  with([](Options& o) { o.options.dropout_p(1.0); }));
  add_option_rows(rows, "dropout_p negative", E::kValueError, {"dropout_p", "dropout_p=-0.1"},
                  with([](Options& o) { o.options.dropout_p(-0.1); }));
}

std::vector<BadCall> table() {
  using E = Expect;
  const at::Tensor none;
  const Valid a;
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const double inf = std::numeric_limits<double>::infinity();
  std::vector<BadCall> rows = {
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
      {"backward grad_out half",
       E::kTypeError,
       {"grad_out.dtype"},
       backward_with("grad_out", a.grad_out.to(at::kHalf))},
      {"backward lse int64",
       E::kTypeError,
       {"lse must have dtype Float", "lse.dtype=Long"},
       backward_with("lse", a.lse.to(at::kLong))},
      {"backward lse double",
       E::kTypeError,
       {"lse.dtype"},
       backward_with("lse", a.lse.to(at::kDouble))},
      {"backward k double", E::kTypeError, {"k.dtype"}, backward_with("k", a.k.to(at::kDouble))},
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
       [=] { causal_attention::attention_weights(a.q, torch::randn({2, 2, 6, 9}), a.v); }},
      {"backward grad_out Dv",
       E::kValueError,
       {"grad_out.shape=[2, 4, 5, 8]"},
       backward_with("grad_out", torch::randn({2, 4, 5, 8}))},
      {"backward grad_out Lq",
       E::kValueError,
       {"grad_out.shape"},
       backward_with("grad_out", torch::randn({2, 4, 6, 3}))},
      {"backward grad_out 3-D",
       E::kValueError,
       {"grad_out.shape"},
       backward_with("grad_out", torch::randn({4, 5, 3}))},
      {"backward grad_out 5-D",
       E::kValueError,
       {"grad_out.shape"},
       backward_with("grad_out", torch::randn({2, 4, 5, 3}).unsqueeze(0))},
      {"backward out Lq",
       E::kValueError,
       {"out.shape=[2, 4, 6, 3]"},
       backward_with("out", torch::randn({2, 4, 6, 3}))},
      {"backward out D",
       E::kValueError,
       {"out.shape"},
       backward_with("out", torch::randn({2, 4, 5, 8}))},
      {"backward lse keepdim",
       E::kValueError,
       {"lse.shape=[2, 4, 5, 1]"},
       backward_with("lse", torch::randn({2, 4, 5, 1}))},
      {"backward lse kv heads",
       E::kValueError,
       {"lse.shape=[2, 2, 5]"},
       backward_with("lse", torch::randn({2, 2, 5}))},
      {"backward lse Lq",
       E::kValueError,
       {"lse.shape"},
       backward_with("lse", torch::randn({2, 4, 6}))},
      {"backward lse 2-D",
       E::kValueError,
       {"lse.shape"},
       backward_with("lse", torch::randn({5, 5}))},
      {"backward q head dim",
       E::kValueError,
       {"head dimension D", "q.shape=[2, 4, 5, 9]"},
       backward_with("q", torch::randn({2, 4, 5, 9}))},
      {"backward k, v lengths differ",
       E::kValueError,
       {"k.shape", "v.shape"},
       backward_with("v", a.v.narrow(-2, 0, 5))},
      // Scale: ValueError showing it (a non-finite one through each op: after this list).
      {"attention (grad) scale inf",
       E::kValueError,
       {"scale must be finite", "scale=inf"},
       attention_grad(a.q, a.k, a.v, inf)},
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
                                             a.v.to(at::kHalf), AttentionOptions().scale(1e39));
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
  // Non-finite scales through each op, as the message shows them (C++ may print a NaN as "nan"
  // or "-nan").
  struct NonFinite {
    const char* name;
    const char* shown;
    double scale;
  };
  for (const NonFinite& bad :
       {NonFinite{" scale nan", "nan", nan}, NonFinite{" scale inf", "scale=inf", inf},
        NonFinite{" scale -inf", "scale=-inf", -inf}}) {
    const std::vector<const char*> needles = {"scale must be finite", bad.shown};
    const double scale = bad.scale;
    rows.push_back({std::string("attention") + bad.name, E::kValueError, needles,
                    attention(a.q, a.k, a.v, scale)});
    rows.push_back({std::string("forward") + bad.name, E::kValueError, needles,
                    forward(a.q, a.k, a.v, scale)});
    rows.push_back({std::string("backward") + bad.name, E::kValueError, needles,
                    backward_with("q", a.q, scale)});
  }
  // q, k and v wrong together, through every forward entry point.
  const at::Tensor ints = torch::ones({2, 8, 4}, torch::kLong);
  add_forward_rows(rows, "q, k, v 1-D", E::kValueError, {"q.shape", "q must"}, rand({8}), rand({8}),
                   rand({8}));
  add_forward_rows(rows, "k 1-D", E::kValueError, {"k.shape"}, rand({8, 4}), rand({4}),
                   rand({8, 4}));
  add_forward_rows(rows, "v 1-D", E::kValueError, {"v.shape"}, rand({8, 4}), rand({8, 4}),
                   rand({4}));
  add_forward_rows(rows, "3-D q, 4-D k", E::kValueError,
                   {"number of dimensions", "q.shape", "k.shape"}, rand({2, 8, 4}),
                   rand({1, 2, 8, 4}), rand({1, 2, 8, 4}));
  add_forward_rows(rows, "3-D q and k, 2-D v", E::kValueError, {"number of dimensions", "v.shape"},
                   rand({2, 8, 4}), rand({2, 8, 4}), rand({8, 4}));
  add_forward_rows(rows, "batch differs", E::kValueError, {"leading", "q.shape", "k.shape"},
                   rand({2, 2, 8, 4}), rand({3, 2, 8, 4}), rand({3, 2, 8, 4}));
  add_forward_rows(rows, "5-D v inner batch differs", E::kValueError, {"leading", "v.shape"},
                   rand({2, 3, 2, 8, 4}), rand({2, 3, 2, 8, 4}), rand({2, 1, 2, 8, 4}));
  add_forward_rows(rows, "head dims differ", E::kValueError, {"head dimension", "q.shape"},
                   rand({1, 2, 8, 4}), rand({1, 2, 8, 5}), rand({1, 2, 8, 4}));
  add_forward_rows(rows, "v lengths differ", E::kValueError, {"Lk", "k.shape", "v.shape"},
                   rand({1, 2, 8, 4}), rand({1, 2, 8, 4}), rand({1, 2, 9, 4}));
  add_forward_rows(rows, "v heads differ", E::kValueError, {"heads", "k.shape", "v.shape"},
                   rand({1, 2, 8, 4}), rand({1, 2, 8, 4}), rand({1, 1, 8, 4}));
  add_forward_rows(rows, "Hq 3, Hkv 2", E::kValueError, {"multiple", "q.shape", "k.shape"},
                   rand({1, 3, 8, 4}), rand({1, 2, 8, 4}), rand({1, 2, 8, 4}));
  add_forward_rows(rows, "Hkv 0", E::kValueError, {"multiple", "q.shape"}, rand({1, 2, 8, 4}),
                   rand({1, 0, 8, 4}), rand({1, 0, 8, 4}));
  add_forward_rows(rows, "head dim 0", E::kValueError, {"head dimension", "q.shape"},
                   rand({1, 2, 8, 0}), rand({1, 2, 8, 0}), rand({1, 2, 8, 4}));
  add_forward_rows(rows, "double k", E::kTypeError, {"same dtype", "q.dtype", "k.dtype"},
                   rand({2, 8, 4}), rand({2, 8, 4}, at::kDouble), rand({2, 8, 4}));
  add_forward_rows(rows, "bfloat16 q and k, half v", E::kTypeError, {"same dtype", "v.dtype"},
                   rand({2, 8, 4}, at::kBFloat16), rand({2, 8, 4}, at::kBFloat16),
                   rand({2, 8, 4}, at::kHalf));
  add_forward_rows(rows, "int64 q, k, v", E::kTypeError, {"q.dtype"}, ints, ints, ints);
  add_forward_rows(rows, "int32 k", E::kTypeError, {"k.dtype"}, rand({2, 8, 4}),
                   ints.to(torch::kInt), rand({2, 8, 4}));
  add_forward_rows(rows, "bool v", E::kTypeError, {"v.dtype"}, rand({2, 8, 4}), rand({2, 8, 4}),
                   torch::ones({2, 8, 4}, torch::kBool));
  add_score_option_rows(rows);
  // The kernel ops' own dropout seed.
  const auto forward_with_seed = [a](std::optional<at::Tensor> seed) {
    return [a, seed] {
      causal_attention::attention_forward(a.q, a.k, a.v, 0.5, AttentionOptions().dropout_p(0.1),
                                          seed);
    };
  };
  rows.push_back({"forward dropout without seed",
                  E::kValueError,
                  {"dropout_seed", "dropout_seed=None"},
                  forward_with_seed(std::nullopt)});
  rows.push_back({"forward dropout seed int32",
                  E::kTypeError,
                  {"dropout_seed.dtype=Int"},
                  forward_with_seed(torch::zeros({2}, torch::kInt))});
  // The C++ API's options: the kernel ops take the scale as an argument and a seed, not a
  // generator; packed sequences take no key mask.
  rows.push_back({"forward options scale",
                  E::kValueError,
                  {"attention_forward: the kernel ops take the scale as an argument"},
                  [a] {
                    causal_attention::attention_forward(a.q, a.k, a.v, 0.5,
                                                        AttentionOptions().scale(0.5));
                  }});
  rows.push_back({"backward options generator",
                  E::kValueError,
                  {"attention_backward: the kernel ops take", "::generator"},
                  [a] {
                    causal_attention::attention_backward(
                        a.grad_out, a.q, a.k, a.v, a.out, a.lse, 0.5,
                        AttentionOptions().generator(at::make_generator<at::CPUGeneratorImpl>(1)));
                  }});
  // Masks are for dense calls.
  const auto varlen_with = [a](const AttentionOptions& options) {
    return [a, options] {
      const at::Tensor cu = torch::tensor({0, 5, 10}, torch::kInt);
      const at::Tensor q = a.q.transpose(1, 2).flatten(0, 1);
      causal_attention::varlen_attention(q, q, q, cu, cu, 5, 5, options);
    };
  };
  rows.push_back({"varlen options key_mask",
                  E::kValueError,
                  {"varlen_attention: key_mask and attn_mask are for dense calls"},
                  varlen_with(AttentionOptions().key_mask(torch::ones({10}, torch::kBool)))});
  rows.push_back({"varlen options attn_mask",
                  E::kValueError,
                  {"varlen_attention: key_mask and attn_mask are for dense calls"},
                  varlen_with(AttentionOptions().attn_mask(torch::ones({5, 5}, torch::kBool)))});
  rows.push_back({"attn_mask int dtype",
                  E::kTypeError,
                  {"attention: attn_mask must be bool", "attn_mask.dtype=Long"},
                  [a] {
                    causal_attention::attention(
                        a.q, a.k, a.v,
                        AttentionOptions().attn_mask(torch::zeros({1}, torch::kLong)));
                  }});
  rows.push_back(
      {"attn_mask not broadcastable",
       E::kValueError,
       {"attention: attn_mask must be broadcastable to the scores", "attn_mask.shape=[3]"},
       [a] {
         causal_attention::attention(a.q, a.k, a.v,
                                     AttentionOptions().attn_mask(torch::zeros({3}, torch::kBool)));
       }});
  rows.push_back({"attention_gradients attn_mask_grad of a bool mask",
                  E::kValueError,
                  {"attention_gradients: attn_mask_grad=True asks for the gradient of a floating"},
                  [a] {
                    const auto [out, lse] = causal_attention::attention_forward(a.q, a.k, a.v, 0.5);
                    causal_attention::attention_gradients(
                        out, a.q, a.k, a.v, out, lse, 0.5,
                        AttentionOptions().attn_mask(torch::ones({1}, torch::kBool)), std::nullopt,
                        /*attn_mask_grad=*/true);
                  }});
  rows.push_back({"forward dropout seed on meta",
                  E::kValueError,
                  {"dropout_seed must be a CPU tensor", "on meta"},
                  forward_with_seed(
                      torch::zeros({2}, torch::TensorOptions(torch::kLong).device(torch::kMeta)))});
  rows.push_back({"forward dropout seed 3 entries",
                  E::kValueError,
                  {"dropout_seed.shape=[3]"},
                  forward_with_seed(torch::zeros({3}, torch::kLong))});
  return rows;
}

// gtest's test names: the row's name with every character but letters and digits as '_'.
std::string row_name(const ::testing::TestParamInfo<BadCall>& info) {
  std::string name = info.param.name;
  for (char& c : name) {
    if (!std::isalnum(static_cast<unsigned char>(c))) {
      c = '_';
    }
  }
  return name;
}

class BadInput : public ::testing::TestWithParam<BadCall> {};

TEST_P(BadInput, ThrowsItsDocumentedTypeNamingTheArgument) {
  const BadCall& c = GetParam();
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

INSTANTIATE_TEST_SUITE_P(Table, BadInput, ::testing::ValuesIn(table()), row_name);

TEST(BadInputTable, IsLargeAndNamesAreUnique) {
  const auto rows = table();
  EXPECT_GE(rows.size(), 40u);
  std::set<std::string> names;
  for (const BadCall& c : rows) {
    EXPECT_TRUE(names.insert(row_name({c, 0})).second) << "duplicate case " << c.name;
  }
}

TEST(BadInputTable, TheValidCallItSpoilsSucceeds) {
  // The replacements above are what makes each call bad: the base call is fine.
  const Valid a;
  auto [dq, dk, dv, dsinks] =
      causal_attention::attention_backward(a.grad_out, a.q, a.k, a.v, a.out, a.lse, 0.5);
  EXPECT_EQ(dq.sizes(), a.q.sizes());
  EXPECT_EQ(dk.sizes(), a.k.sizes());
  EXPECT_EQ(dv.sizes(), a.v.sizes());
  EXPECT_EQ(dsinks.numel(), 0);  // no sinks
  attention_grad(a.q, a.k, a.v)();
  forward(a.q, a.k, a.v)();
  attention(a.q, a.k, a.v, std::nullopt, torch::ones({2, 6}, torch::kBool))();
  // And with every score option at valid values.
  causal_attention::attention(a.q, a.k, a.v,
                              AttentionOptions()
                                  .window({3, 1})
                                  .softcap(5.0)
                                  .alibi_slopes(torch::ones({2, 4}))
                                  .sinks(torch::zeros({4}))
                                  .dropout_p(0.2));
}

TEST(BadInputTable, ScalesFiniteInTheAccumulationDtypeAreAccepted) {
  // float64 inputs accumulate in float64, where 1e39 is an ordinary number; float32 takes up
  // to FLT_MAX.
  const at::Tensor zeros = torch::zeros({2, 3, 4}, torch::kDouble);
  const at::Tensor out =
      causal_attention::attention(zeros, zeros, zeros, AttentionOptions().scale(1e39));
  EXPECT_TRUE(out.isfinite().all().item<bool>());
  const double float32_max = std::numeric_limits<float>::max();
  const at::Tensor zeros32 = zeros.to(at::kFloat);
  EXPECT_NO_THROW(causal_attention::attention(zeros32, zeros32, zeros32,
                                              AttentionOptions().scale(float32_max)));
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
