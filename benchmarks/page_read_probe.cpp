// `causal_attention_bench::read_pages`: the sum of every float32 element of the pages a block
// table lists, each page read whole, in the table's order, the table's entries split evenly among
// the threads. `python -m benchmarks.paged` times it on a decode's pools, its pages shuffled and
// in order: what the memory system alone charges for reading pages in random order, beside what
// paged_attention pays for it. A page of 16 rows is 4-8 KiB of one head's keys, and a read that
// jumps to another place every 4-8 KiB defeats the hardware's stream prefetchers.
// With `prefetch_next`, each page's successor is requested into L2 as it is read (the decode
// path does the same a key block ahead); the benchmark keeps the faster of the two reads.
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/ops/aminmax.h>
#include <torch/library.h>

#include <immintrin.h>

#include <numeric>
#include <vector>

namespace causal_attention::bench {
namespace {

double sum_page(const float* page, int64_t numel) {
  using Vec = at::vec::Vectorized<float>;
  constexpr int64_t N = Vec::size(), kAccumulators = 4;
  Vec acc[kAccumulators] = {Vec(0.0f), Vec(0.0f), Vec(0.0f), Vec(0.0f)};
  int64_t e = 0;
  for (; e + kAccumulators * N <= numel; e += kAccumulators * N) {
    for (int64_t a = 0; a < kAccumulators; ++a) {
      acc[a] = acc[a] + Vec::loadu(page + e + a * N);
    }
  }
  float lanes[N];
  (acc[0] + acc[1] + acc[2] + acc[3]).store(lanes);
  double sum = std::accumulate(lanes, lanes + N, 0.0);
  for (; e < numel; ++e) {
    sum += page[e];
  }
  return sum;
}

// The sum of page[0, numel) with `multiply_adds` multiply-adds on each vector as it is loaded
// (the arithmetic a decode does on the rows it streams in), in as many independent chains as a
// core keeps busy. AVX2 and FMA, which every x86 chip seen has (this library is compiled for
// none in particular, where at::vec would be scalar code); the call checks for them.
template <int kMultiplyAdds>
__attribute__((target("avx2,fma"))) double compute_on_page(const float* page, int64_t numel) {
  constexpr int64_t N = 8, kChains = 8;
  __m256 acc[kChains];
  for (__m256& a : acc) {
    a = _mm256_setzero_ps();
  }
  const __m256 factors[2] = {_mm256_set1_ps(1.0001f), _mm256_set1_ps(0.9999f)};
  int64_t e = 0;
  for (; e + 2 * N <= numel; e += 2 * N) {
    const __m256 x = _mm256_loadu_ps(page + e), y = _mm256_loadu_ps(page + e + N);
    // Unrolled, so that the chains live in registers.
#pragma GCC unroll 32
    for (int m = 0; m < kMultiplyAdds; ++m) {
      acc[(2 * m) % kChains] = _mm256_fmadd_ps(x, factors[m % 2], acc[(2 * m) % kChains]);
      acc[(2 * m + 1) % kChains] = _mm256_fmadd_ps(y, factors[m % 2], acc[(2 * m + 1) % kChains]);
    }
  }
  __m256 total = _mm256_setzero_ps();
  for (const __m256& a : acc) {
    total = _mm256_add_ps(total, a);
  }
  float lanes[N];
  _mm256_storeu_ps(lanes, total);
  double sum = std::accumulate(lanes, lanes + N, 0.0);
  for (; e < numel; ++e) {
    sum += page[e];
  }
  return sum;
}

// Checks the arguments of the probes and runs read_page(page, numel, next page or null) on every
// page the table lists, in its order, the entries split evenly among the threads; returns the
// sum of what it returned.
template <typename ReadPage>
double for_each_page(const char* name, const at::Tensor& cache, const at::Tensor& block_table,
                     const ReadPage& read_page) {
  TORCH_CHECK_TYPE(cache.scalar_type() == at::kFloat && block_table.scalar_type() == at::kInt, name,
                   ": cache must be float32 and block_table int32, got ", cache.scalar_type(),
                   " and ", block_table.scalar_type());
  TORCH_CHECK_VALUE(cache.dim() >= 1 && cache.size(0) > 0 && cache.is_contiguous() &&
                        block_table.is_contiguous() && block_table.numel() > 0,
                    name,
                    ": cache must be a contiguous (num_pages, ...) tensor and "
                    "block_table a contiguous non-empty one, got cache ",
                    cache.sizes(), " and block_table ", block_table.sizes());
  const auto [least, most] = at::aminmax(block_table);
  TORCH_CHECK_VALUE(least.item<int32_t>() >= 0 && most.item<int32_t>() < cache.size(0), name,
                    ": block_table's pages must lie in [0, ", cache.size(0), "), got ",
                    least.item<int32_t>(), " to ", most.item<int32_t>());
  const float* data = cache.data_ptr<float>();
  const int32_t* table = block_table.data_ptr<int32_t>();
  const int64_t page_numel = cache.numel() / cache.size(0), entries = block_table.numel();
  const int64_t threads = at::get_num_threads();
  std::vector<double> sums(threads, 0.0);
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t first = entries * t / threads, last = entries * (t + 1) / threads;
      for (int64_t i = first; i < last; ++i) {
        const float* next = i + 1 < last ? data + table[i + 1] * page_numel : nullptr;
        sums[t] += read_page(data + table[i] * page_numel, page_numel, next);
      }
    }
  });
  double total = 0.0;
  for (double s : sums) total += s;
  return total;
}

double read_pages(const at::Tensor& cache, const at::Tensor& block_table, bool prefetch_next) {
  return for_each_page(
      "read_pages", cache, block_table, [&](const float* page, int64_t numel, const float* next) {
        if (prefetch_next && next != nullptr) {
          const char* bytes = reinterpret_cast<const char*>(next);
          for (int64_t byte = 0; byte < numel * int64_t(sizeof(float)); byte += 64) {
            __builtin_prefetch(bytes + byte, /*rw=*/0, /*locality=*/2);
          }
        }
        return sum_page(page, numel);
      });
}

// `causal_attention_bench::read_pages_computing`: read_pages (in order, the hardware's
// prefetchers alone) with `multiply_adds` (0, 4, 8, 16 or 32) multiply-adds on each vector as it
// is loaded. Timed against the same arithmetic on pages that stay in cache and against the bare
// read, it says whether the chip's memory system streams pages while the core computes on them
// (benchmarks/read_overlap.py).
double read_pages_computing(const at::Tensor& cache, const at::Tensor& block_table,
                            int64_t multiply_adds) {
  TORCH_CHECK(
      multiply_adds == 0 || (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")),
      "read_pages_computing: multiply_adds needs AVX2 and FMA, which this CPU lacks");
  using PageFunction = double (*)(const float*, int64_t);
  PageFunction compute = nullptr;
  switch (multiply_adds) {
    case 0:
      compute = sum_page;
      break;
    case 4:
      compute = compute_on_page<4>;
      break;
    case 8:
      compute = compute_on_page<8>;
      break;
    case 16:
      compute = compute_on_page<16>;
      break;
    case 32:
      compute = compute_on_page<32>;
      break;
    default:
      TORCH_CHECK_VALUE(false,
                        "read_pages_computing: multiply_adds must be 0, 4, 8, 16 or 32, got ",
                        multiply_adds);
  }
  return for_each_page(
      "read_pages_computing", cache, block_table,
      [&](const float* page, int64_t numel, const float*) { return compute(page, numel); });
}

}  // namespace
}  // namespace causal_attention::bench

TORCH_LIBRARY_FRAGMENT(causal_attention_bench, m) {
  m.def("read_pages(Tensor cache, Tensor block_table, bool prefetch_next) -> float",
        causal_attention::bench::read_pages);
  m.def("read_pages_computing(Tensor cache, Tensor block_table, int multiply_adds) -> float",
        causal_attention::bench::read_pages_computing);
}
