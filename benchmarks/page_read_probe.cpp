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

double read_pages(const at::Tensor& cache, const at::Tensor& block_table, bool prefetch_next) {
  TORCH_CHECK_TYPE(cache.scalar_type() == at::kFloat && block_table.scalar_type() == at::kInt,
                   "read_pages: cache must be float32 and block_table int32, got ",
                   cache.scalar_type(), " and ", block_table.scalar_type());
  TORCH_CHECK_VALUE(cache.dim() >= 1 && cache.size(0) > 0 && cache.is_contiguous() &&
                        block_table.is_contiguous() && block_table.numel() > 0,
                    "read_pages: cache must be a contiguous (num_pages, ...) tensor and "
                    "block_table a contiguous non-empty one, got cache ",
                    cache.sizes(), " and block_table ", block_table.sizes());
  const auto [least, most] = at::aminmax(block_table);
  TORCH_CHECK_VALUE(least.item<int32_t>() >= 0 && most.item<int32_t>() < cache.size(0),
                    "read_pages: block_table's pages must lie in [0, ", cache.size(0), "), got ",
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
        if (prefetch_next && i + 1 < last) {
          const char* next = reinterpret_cast<const char*>(data + table[i + 1] * page_numel);
          for (int64_t byte = 0; byte < page_numel * int64_t(sizeof(float)); byte += 64) {
            __builtin_prefetch(next + byte, /*rw=*/0, /*locality=*/2);
          }
        }
        sums[t] += sum_page(data + table[i] * page_numel, page_numel);
      }
    }
  });
  double total = 0.0;
  for (double s : sums) total += s;
  return total;
}

}  // namespace
}  // namespace causal_attention::bench

TORCH_LIBRARY_FRAGMENT(causal_attention_bench, m) {
  m.def("read_pages(Tensor cache, Tensor block_table, bool prefetch_next) -> float",
        causal_attention::bench::read_pages);
}
