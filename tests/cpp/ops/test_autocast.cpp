// The autocast kernels from C++: inside an autocast region (here set by hand, as
// torch.autocast("cpu") does), float32 inputs, mixed dtypes included, run as the call with inputs
// cast to the region's dtype, and gradients reach the float32 leaves in float32.
#include <causal_attention/ops.h>

#include <ATen/autocast_mode.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

namespace {

// Enables CPU autocast in `dtype` for its lifetime.
class CpuAutocast {
 public:
  explicit CpuAutocast(at::ScalarType dtype)
      : was_enabled_(at::autocast::is_autocast_enabled(at::kCPU)),
        previous_dtype_(at::autocast::get_autocast_dtype(at::kCPU)) {
    at::autocast::set_autocast_enabled(at::kCPU, true);
    at::autocast::set_autocast_dtype(at::kCPU, dtype);
  }
  ~CpuAutocast() {
    at::autocast::set_autocast_enabled(at::kCPU, was_enabled_);
    at::autocast::set_autocast_dtype(at::kCPU, previous_dtype_);
    at::autocast::clear_cache();
  }

 private:
  bool was_enabled_;
  at::ScalarType previous_dtype_;
};

TEST(Autocast, CastsFloat32AndMixedInputsToTheRegionsDtype) {
  torch::manual_seed(0);
  const at::Tensor q = torch::randn({2, 4, 30, 16}).requires_grad_();
  const at::Tensor k = torch::randn({2, 2, 30, 16}).requires_grad_();
  const at::Tensor v = torch::randn({2, 2, 30, 8}, torch::kBFloat16).requires_grad_();
  EXPECT_THROW(causal_attention::attention(q, k, v), c10::TypeError);
  at::Tensor out;
  {
    CpuAutocast region(at::kBFloat16);
    out = causal_attention::attention(q, k, v);
  }
  EXPECT_EQ(out.scalar_type(), at::kBFloat16);
  const at::Tensor expected =
      causal_attention::attention(q.to(at::kBFloat16), k.to(at::kBFloat16), v);
  EXPECT_TRUE(torch::equal(out, expected));
  const auto grads = torch::autograd::grad({out.to(at::kFloat).sum()}, {q, k, v});
  EXPECT_EQ(grads[0].scalar_type(), at::kFloat);
  EXPECT_EQ(grads[1].scalar_type(), at::kFloat);
  EXPECT_EQ(grads[2].scalar_type(), at::kBFloat16);
}

}  // namespace
