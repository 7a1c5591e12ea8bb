// The block products of csrc/ops/cpu/block_gemm.h against at::matmul in float64: every overload
// (float32, float64, and bfloat16 and float16 with B in VNNI layout, on every CPU: native where
// this process has the native products, widened elsewhere), odd and empty K, empty M or N,
// accumulate into a nonzero C, and leading dimensions wider than the blocks. Padding of A and B
// holds NaN (a product that reads it shows NaN), padding of C holds values that must survive.
#include "block_gemm.h"

#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <ATen/Version.h>
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

namespace causal_attention::tests {
namespace {

using cpu::block_gemm;
using cpu::block_gemm_release;
using cpu::block_products_in_use;
using cpu::native_block_products;

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

struct Sizes {
  int64_t m, n, k;
};

// Odd and even K, sizes below, at and above the micro-kernels' register tiles, one-row products
// (decode) and the 64-row blocks of the kernels.
const std::vector<Sizes>& product_sizes() {
  static const std::vector<Sizes> sizes = {
      {1, 1, 1},    {1, 1, 2},    {3, 5, 7},    {4, 16, 8},   {16, 16, 16}, {17, 33, 9}, {2, 3, 63},
      {64, 64, 64}, {64, 48, 63}, {5, 70, 130}, {1, 64, 200}, {31, 1, 17},  {64, 7, 96},
  };
  return sizes;
}

// (lda - K, ldb - N, ldc - N): tight, and wider than the blocks.
struct Padding {
  int64_t a, b, c;
};
const std::vector<Padding>& paddings() {
  static const std::vector<Padding> pads = {{0, 0, 0}, {3, 5, 2}, {1, 0, 7}};
  return pads;
}

// A row-major (rows, ld) buffer whose first `cols` columns hold `values` and whose other
// columns hold `fill`.
at::Tensor padded(const at::Tensor& values, int64_t ld, double fill) {
  at::Tensor storage = at::full({values.size(0), ld}, fill, values.options());
  storage.narrow(1, 0, values.size(1)).copy_(values);
  return storage;
}

// Expects |actual - expected| <= tol * magnitude elementwise, magnitude being the sum of the
// absolute values of the terms (so the bound is the one the accumulation dtype promises,
// however much the sum cancels). All three are float64 (M, N).
void expect_within(const at::Tensor& actual, const at::Tensor& expected,
                   const at::Tensor& magnitude, double tol) {
  ASSERT_EQ(actual.sizes(), expected.sizes());
  if (actual.numel() == 0) {
    return;
  }
  ASSERT_FALSE(actual.isnan().any().item<bool>()) << "NaN in the product (padding read?)";
  const at::Tensor excess = (actual - expected).abs() - tol * magnitude;
  const int64_t worst = excess.argmax().item<int64_t>();
  const double worst_excess = excess.flatten()[worst].item<double>();
  EXPECT_LE(worst_excess, 0.0) << "element " << worst / actual.size(1) << ", "
                               << worst % actual.size(1) << ": got "
                               << actual.flatten()[worst].item<double>() << ", expected "
                               << expected.flatten()[worst].item<double>() << ", allowed error "
                               << tol * magnitude.flatten()[worst].item<double>();
}

std::string describe(const Sizes& s, int64_t lda, int64_t ldb, int64_t ldc, bool accumulate) {
  std::ostringstream os;
  os << "M=" << s.m << " N=" << s.n << " K=" << s.k << " lda=" << lda << " ldb=" << ldb
     << " ldc=" << ldc << " accumulate=" << accumulate;
  return os.str();
}

// Inputs of one product in float64, B row-major (K, N); C0 is the C that block_gemm is given.
struct Operands {
  at::Tensor a, b, c0;  // (M, K), (K, N), (M, ldc): all float64
};

Operands random_operands(const Sizes& s, int64_t ldc, at::ScalarType input_dtype,
                         at::ScalarType c_dtype) {
  // Drawn in float64 and rounded to the dtype block_gemm sees: the float64 reference multiplies
  // exactly the values the kernel multiplies.
  const auto f64 = at::TensorOptions().dtype(at::kDouble);
  Operands o;
  o.a = at::randn({s.m, s.k}, f64).to(input_dtype).to(at::kDouble);
  o.b = at::randn({s.k, s.n}, f64).to(input_dtype).to(at::kDouble);
  o.c0 = at::randn({s.m, ldc}, f64).to(c_dtype).to(at::kDouble);
  return o;
}

// C's expected (M, N) block and the magnitude that scales its rounding error.
std::pair<at::Tensor, at::Tensor> reference(const Operands& o, int64_t n, bool accumulate) {
  at::Tensor expected = at::matmul(o.a, o.b);
  at::Tensor magnitude = at::matmul(o.a.abs(), o.b.abs());
  if (accumulate) {
    const at::Tensor c0 = o.c0.narrow(1, 0, n);
    expected = expected + c0;
    magnitude = magnitude + c0.abs();
  }
  return {expected, magnitude};
}

// What block_gemm must have left in C: the product in the (M, N) block (checked against the
// reference), and C0 bitwise in the padding columns; for K = 0, exactly zero or exactly C0.
void check_result(const at::Tensor& c_storage, const Operands& o, int64_t n, bool accumulate,
                  double tol) {
  const at::Tensor c = c_storage.to(at::kDouble);
  ASSERT_EQ(c.sizes(), o.c0.sizes());
  EXPECT_TRUE(at::equal(c.narrow(1, n, c.size(1) - n), o.c0.narrow(1, n, c.size(1) - n)))
      << "block_gemm wrote outside the (M, N) block";
  const at::Tensor block = c.narrow(1, 0, n);
  if (o.a.size(1) == 0) {
    const at::Tensor want = accumulate ? o.c0.narrow(1, 0, n) : at::zeros_like(block);
    EXPECT_TRUE(at::equal(block, want))
        << (accumulate ? "K = 0 with accumulate must leave C unchanged"
                       : "K = 0 without accumulate must zero C");
    return;
  }
  const auto [expected, magnitude] = reference(o, n, accumulate);
  expect_within(block, expected, magnitude, tol);
}

// float32 and float64: B row-major.
template <typename T>
void check_plain_product(const Sizes& s, const Padding& pad, bool accumulate, double tol) {
  const at::ScalarType dtype = c10::CppTypeToScalarType<T>::value;
  const int64_t lda = s.k + pad.a, ldb = s.n + pad.b, ldc = s.n + pad.c;
  SCOPED_TRACE(describe(s, lda, ldb, ldc, accumulate));
  const Operands o = random_operands(s, ldc, dtype, dtype);
  const at::Tensor a = padded(o.a.to(dtype), lda, kNaN);
  const at::Tensor b = padded(o.b.to(dtype), ldb, kNaN);
  at::Tensor c = o.c0.to(dtype).clone();  // .to() of a float64 tensor would return c0 itself
  block_gemm(s.m, s.n, s.k, a.data_ptr<T>(), lda, b.data_ptr<T>(), ldb, c.data_ptr<T>(), ldc,
             accumulate);
  check_result(c, o, s.n, accumulate, tol);
}

// Relative to the sum of |a||b|: float32 accumulation over K <= 200 terms (a few units of
// 2^-24 times sqrt(K) in practice, K * 2^-24 at worst), and float64 likewise with 2^-53.
constexpr double kFloat32Tol = 1e-5;
constexpr double kFloat64Tol = 1e-12;

template <typename T>
void check_all_plain_products(double tol) {
  for (const Sizes& s : product_sizes()) {
    for (const Padding& pad : paddings()) {
      for (bool accumulate : {false, true}) {
        check_plain_product<T>(s, pad, accumulate, tol);
      }
    }
  }
}

// Empty dimensions: K = 0 (zeroes C, or leaves it, per accumulate), M = 0 or N = 0 (touches
// nothing).
const std::vector<Sizes>& empty_sizes() {
  static const std::vector<Sizes> sizes = {{4, 5, 0}, {1, 1, 0}, {64, 64, 0},
                                           {0, 5, 3}, {4, 0, 3}, {0, 0, 0}};
  return sizes;
}

template <typename T>
void check_all_empty_products() {
  for (const Sizes& s : empty_sizes()) {
    for (const Padding& pad : {Padding{0, 0, 0}, Padding{2, 3, 4}}) {
      for (bool accumulate : {false, true}) {
        check_plain_product<T>(s, pad, accumulate, /*tol=*/0.0);
      }
    }
  }
}

class BlockGemm : public ::testing::Test {
 protected:
  void SetUp() override { at::manual_seed(0); }
  // The header asks each task that used block_gemm to release the micro-kernel state.
  void TearDown() override { block_gemm_release(); }
};

TEST_F(BlockGemm, Float32MatchesFloat64Matmul) {
  check_all_plain_products<float>(kFloat32Tol);
}

TEST_F(BlockGemm, Float64MatchesFloat64Matmul) {
  check_all_plain_products<double>(kFloat64Tol);
}

TEST_F(BlockGemm, Float32EmptyDimensions) {
  check_all_empty_products<float>();
}

TEST_F(BlockGemm, Float64EmptyDimensions) {
  check_all_empty_products<double>();
}

// ---- bfloat16 and float16: B in VNNI layout ----

// B (K, N) in the layout block_gemm.h documents, B_vnni[(p * ldb + n) * 2 + i] = B[2 * p + i][n],
// with an odd K padded by a zero row; entries for n in [N, ldb) hold `fill`. Returns the padded
// K (even) through k_even.
template <typename T = c10::BFloat16>
std::vector<T> pack_vnni(const at::Tensor& b, int64_t ldb, float fill, int64_t* k_even) {
  const int64_t k = b.size(0), n = b.size(1);
  const int64_t pairs = (k + 1) / 2;
  *k_even = 2 * pairs;
  const at::Tensor b_reduced = b.to(c10::CppTypeToScalarType<T>::value).contiguous();
  const T* src = b_reduced.data_ptr<T>();
  std::vector<T> packed(pairs * ldb * 2, T(fill));
  for (int64_t p = 0; p < pairs; ++p) {
    for (int64_t col = 0; col < n; ++col) {
      for (int64_t i = 0; i < 2; ++i) {
        const int64_t row = 2 * p + i;
        packed[(p * ldb + col) * 2 + i] = row < k ? src[row * n + col] : T(0.0f);
      }
    }
  }
  return packed;
}

// The inverse: B (k_even, N) as float64.
at::Tensor unpack_vnni(const std::vector<c10::BFloat16>& packed, int64_t k_even, int64_t n,
                       int64_t ldb) {
  at::Tensor b = at::empty({k_even, n}, at::kDouble);
  auto acc = b.accessor<double, 2>();
  for (int64_t row = 0; row < k_even; ++row) {
    for (int64_t col = 0; col < n; ++col) {
      acc[row][col] = static_cast<float>(packed[((row / 2) * ldb + col) * 2 + row % 2]);
    }
  }
  return b;
}

TEST(BlockGemmVnni, LayoutOfASmallMatrixByHand) {
  // B = [[0, 1, 2], [10, 11, 12], [20, 21, 22], [30, 31, 32]] (K = 4, N = 3), ldb = 4: pairs of
  // rows interleaved column by column, one unused column (-1) per pair.
  const at::Tensor b =
      at::tensor({0., 1., 2., 10., 11., 12., 20., 21., 22., 30., 31., 32.}, at::kDouble)
          .view({4, 3});
  int64_t k_even = 0;
  const std::vector<c10::BFloat16> packed = pack_vnni(b, /*ldb=*/4, /*fill=*/-1.0f, &k_even);
  const std::vector<float> want = {0,  10, 1,  11, 2,  12, -1, -1,   // p = 0: rows 0 and 1
                                   20, 30, 21, 31, 22, 32, -1, -1};  // p = 1: rows 2 and 3
  EXPECT_EQ(k_even, 4);
  ASSERT_EQ(packed.size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) {
    EXPECT_EQ(static_cast<float>(packed[i]), want[i]) << "B_vnni[" << i << "]";
  }
  // K = 3: the missing fourth row is zero.
  const std::vector<c10::BFloat16> odd = pack_vnni(b.narrow(0, 0, 3), 3, -1.0f, &k_even);
  EXPECT_EQ(k_even, 4);
  const std::vector<float> want_odd = {0, 10, 1, 11, 2, 12, 20, 0, 21, 0, 22, 0};
  ASSERT_EQ(odd.size(), want_odd.size());
  for (size_t i = 0; i < want_odd.size(); ++i) {
    EXPECT_EQ(static_cast<float>(odd[i]), want_odd[i]) << "B_vnni[" << i << "] (K = 3)";
  }
}

TEST(BlockGemmVnni, PackThenUnpackGivesBBack) {
  at::manual_seed(0);
  for (const Sizes& s : product_sizes()) {
    for (int64_t pad : {0, 5}) {
      SCOPED_TRACE(describe(s, s.k, s.n + pad, s.n, false));
      const at::Tensor b = at::randn({s.k, s.n}, at::kDouble).to(at::kBFloat16).to(at::kDouble);
      int64_t k_even = 0;
      const auto packed = pack_vnni(b, s.n + pad, std::nanf(""), &k_even);
      EXPECT_EQ(k_even % 2, 0);
      EXPECT_TRUE(k_even == s.k || k_even == s.k + 1);
      const at::Tensor back = unpack_vnni(packed, k_even, s.n, s.n + pad);
      EXPECT_TRUE(at::equal(back.narrow(0, 0, s.k), b));
      EXPECT_TRUE(
          at::equal(back.narrow(0, s.k, k_even - s.k), at::zeros({k_even - s.k, s.n}, at::kDouble)))
          << "the row padding an odd K must be zero";
    }
  }
}

// Which product multiplies T here (the test names it, so a log says which path it checked).
template <typename T>
std::string products_here() {
  const at::ScalarType dtype = c10::CppTypeToScalarType<T>::value;
  std::ostringstream os;
  os << c10::toString(dtype) << " products: " << block_products_in_use(dtype)
     << " (ATen CPU capability " << at::get_cpu_capability() << ")";
  return os.str();
}

template <typename T>
void check_vnni_product(const Sizes& s, const Padding& pad, bool accumulate, double tol) {
  const at::ScalarType dtype = c10::CppTypeToScalarType<T>::value;
  // An odd K is padded: A with a zero column, B with a zero row (what the kernels do).
  const int64_t k_even = s.k + (s.k & 1);
  const int64_t lda = k_even + pad.a, ldb = s.n + pad.b, ldc = s.n + pad.c;
  SCOPED_TRACE(products_here<T>() + ", " + describe(s, lda, ldb, ldc, accumulate) +
               " K padded to " + std::to_string(k_even));
  const Operands o = random_operands(s, ldc, dtype, at::kFloat);
  at::Tensor a_padded = at::zeros({s.m, k_even}, at::kDouble);
  a_padded.narrow(1, 0, s.k).copy_(o.a);
  const at::Tensor a = padded(a_padded.to(dtype), lda, kNaN);
  int64_t packed_k = 0;
  const std::vector<T> b_vnni = pack_vnni<T>(o.b, ldb, std::nanf(""), &packed_k);
  ASSERT_EQ(packed_k, k_even);
  at::Tensor c = o.c0.to(at::kFloat).clone();
  block_gemm(s.m, s.n, k_even, a.data_ptr<T>(), lda, b_vnni.data(), ldb, c.data_ptr<float>(), ldc,
             accumulate);
  check_result(c, o, s.n, accumulate, tol);
}

template <typename T>
void check_all_vnni_products() {
  // bfloat16 and float16 products are exact in float32: the error is float32 accumulation's.
  for (const Sizes& s : product_sizes()) {
    for (const Padding& pad : paddings()) {
      for (bool accumulate : {false, true}) {
        check_vnni_product<T>(s, pad, accumulate, kFloat32Tol);
      }
    }
  }
  for (const Sizes& s : empty_sizes()) {
    for (const Padding& pad : {Padding{0, 0, 0}, Padding{2, 3, 4}}) {
      for (bool accumulate : {false, true}) {
        check_vnni_product<T>(s, pad, accumulate, /*tol=*/0.0);
      }
    }
  }
}

TEST_F(BlockGemm, BFloat16VnniMatchesFloat64Matmul) {
  check_all_vnni_products<c10::BFloat16>();
}

TEST_F(BlockGemm, Float16VnniMatchesFloat64Matmul) {
  check_all_vnni_products<c10::Half>();
}

// With oneDNN disabled, the VNNI overloads still multiply, widened (libtorch's native call would
// raise): what a call sees when another thread disables oneDNN while it runs.
TEST_F(BlockGemm, VnniProductsWithOneDnnDisabled) {
  const bool mkldnn = at::globalContext().userEnabledMkldnn();
  at::globalContext().setUserEnabledMkldnn(false);
  EXPECT_STREQ(block_products_in_use(at::kBFloat16), "widened");
  for (const Sizes& s : {Sizes{3, 5, 7}, Sizes{64, 64, 64}}) {
    check_vnni_product<c10::BFloat16>(s, Padding{1, 2, 3}, /*accumulate=*/true, kFloat32Tol);
    check_vnni_product<c10::Half>(s, Padding{0, 0, 0}, /*accumulate=*/false, kFloat32Tol);
  }
  at::globalContext().setUserEnabledMkldnn(mkldnn);
}

// One instruction-set truth: native products only under the ATen capability that selects the
// AVX-512 kernels, never for float32 or float64, and in use only while oneDNN is enabled. CMake
// also runs this test under ATEN_CPU_CAPABILITY=default, where they must be off on any CPU.
TEST(BlockGemmAvailability, FollowsTheAtenCapabilityAndOneDnn) {
  for (const at::ScalarType dtype : {at::kBFloat16, at::kHalf}) {
    SCOPED_TRACE(c10::toString(dtype));
    const bool native = native_block_products(dtype);
    if (at::get_cpu_capability() != "AVX512") {
      EXPECT_FALSE(native) << "ATen capability " << at::get_cpu_capability()
                           << " runs no AVX-512 kernel";
    }
    const bool mkldnn = at::globalContext().userEnabledMkldnn();
    EXPECT_STREQ(block_products_in_use(dtype), native && mkldnn ? "native" : "widened");
    at::globalContext().setUserEnabledMkldnn(false);
    EXPECT_STREQ(block_products_in_use(dtype), "widened") << "oneDNN disabled";
    at::globalContext().setUserEnabledMkldnn(mkldnn);
    EXPECT_EQ(native_block_products(dtype), native) << "decided once per process";
  }
  EXPECT_FALSE(native_block_products(at::kFloat));
  EXPECT_FALSE(native_block_products(at::kDouble));
}

}  // namespace
}  // namespace causal_attention::tests
