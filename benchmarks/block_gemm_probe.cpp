// `causal_attention_bench::block_gemm_gflops`: the throughput of the block-product micro-kernel
// behind block_gemm.h on cache-resident blocks, every thread multiplying its own blocks at once.
// `python -m benchmarks.bench` uses it as the practical limit ("share of the limit") that the
// attention kernels are held to. It lives in a library of its own (CMake option
// CAUSAL_ATTENTION_BUILD_BENCH_PROBE), so that torch.ops.causal_attention holds only the product.
// For bfloat16 and float16 it measures what the kernels' calls use now (block_gemm.h): the
// native micro-kernel where this process has it, else the float32 one (the widened products).
#include "block_gemm.h"

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <c10/util/irange.h>
#include <torch/library.h>

#include <chrono>
#include <string>
#include <vector>

namespace causal_attention::cpu {
namespace {

template <typename T>
double run_blocks(int64_t m, int64_t n, int64_t k, int64_t iterations) {
  const int64_t threads = at::get_num_threads();
  std::vector<double> seconds(threads, 0.0);
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      std::vector<T> a(m * k, T(1) / T(3)), b(k * n, T(1) / T(7));
      std::vector<float> c(m * n, 0.0f);
      block_gemm(m, n, k, a.data(), k, b.data(), n, c.data(), n, false);  // warm-up
      const auto start = std::chrono::steady_clock::now();
      for (int64_t i = 0; i < iterations; ++i) {
        block_gemm(m, n, k, a.data(), k, b.data(), n, c.data(), n, true);
      }
      seconds[t] = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      block_gemm_release();
    }
  });
  double slowest = 0.0;
  for (double s : seconds) slowest = std::max(slowest, s);
  return 2.0 * m * n * k * iterations * threads / slowest / 1e9;
}

double block_gemm_gflops(at::ScalarType dtype, int64_t m, int64_t n, int64_t k,
                         int64_t iterations) {
  TORCH_CHECK_VALUE(m > 0 && n > 0 && k > 0 && iterations > 0,
                    "block_gemm_gflops: m, n, k and iterations must be positive, got m=", m,
                    ", n=", n, ", k=", k, ", iterations=", iterations);
  TORCH_CHECK_TYPE(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf,
                   "block_gemm_gflops: dtype must be float32, bfloat16 or float16, got ", dtype);
  const bool native = std::string(block_products_in_use(dtype)) == "native";
  const int64_t k_even = k + (k & 1);
  if (native && dtype == at::kBFloat16) {
    return run_blocks<at::BFloat16>(m, n, k_even, iterations);
  }
  if (native && dtype == at::kHalf) {
    return run_blocks<at::Half>(m, n, k_even, iterations);
  }
  return run_blocks<float>(m, n, k, iterations);
}

}  // namespace
}  // namespace causal_attention::cpu

TORCH_LIBRARY(causal_attention_bench, m) {
  m.def("block_gemm_gflops(ScalarType dtype, int m, int n, int k, int iterations) -> float",
        causal_attention::cpu::block_gemm_gflops);
}
