// `causal_attention_bench::read_pages`: the sum of every float32 element of the pages a block
// table lists, each page read whole, in the table's order, the table's entries split evenly among
// the threads. `python -m benchmarks.paged` times it on a decode's pools, its pages shuffled and
// in order: what the memory system alone charges for reading pages in random order, beside what
// paged_attention pays for it. A page of 16 rows is 4-8 KiB of one head's keys, and a read that
// jumps to another place every 4-8 KiB defeats the hardware's stream prefetchers.
// With `prefetch_next`, each page's successor is requested into L2 as it is read (the decode
// path does the same a key block ahead); the benchmark keeps the faster of the two reads.
#include <ATen/Parallel.h>
#include <ATen/ops/aminmax.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <numeric>
#include <utility>
#include <vector>

namespace causal_attention::bench {
namespace {

// The sum of page[0, numel): AVX loads into eight accumulators that stay in registers. (This
// library is compiled for no chip in particular, where at::vec's Vectorized<float> is an array
// added through memory: a read of a page that stays in cache then took more than half as long as
// one from memory, so the "bare read" partly timed its own additions.) The read calls check for
// AVX, which every x86 chip seen has.
__attribute__((target("avx"))) double sum_page(const float* page, int64_t numel) {
  constexpr int64_t N = 8, kAccumulators = 8;
  __m256 acc[kAccumulators];
  for (__m256& a : acc) {
    a = _mm256_setzero_ps();
  }
  int64_t e = 0;
  for (; e + kAccumulators * N <= numel; e += kAccumulators * N) {
#pragma GCC unroll 8
    for (int64_t a = 0; a < kAccumulators; ++a) {
      acc[a] = _mm256_add_ps(acc[a], _mm256_loadu_ps(page + e + a * N));
    }
  }
  for (int64_t a = 1; a < kAccumulators; ++a) {
    acc[0] = _mm256_add_ps(acc[0], acc[a]);
  }
  float lanes[N];
  _mm256_storeu_ps(lanes, acc[0]);
  double sum = std::accumulate(lanes, lanes + N, 0.0);
  for (; e < numel; ++e) {
    sum += page[e];
  }
  return sum;
}

// The sum of page[0, numel) with `multiply_adds` multiply-adds on each vector as it is loaded
// (the arithmetic a decode does on the rows it streams in), in as many independent chains as a
// core keeps busy; a tail of fewer than 16 words is added times kMultiplyAdds (the factors pair
// up to 2), so that the result is the page's sum times kMultiplyAdds either way. AVX2 and FMA,
// which every x86 chip seen has (this library is compiled for none in particular, where at::vec
// would be scalar code); the call checks for them.
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
    sum += double(page[e]) * kMultiplyAdds;  // the factors pair up to 2
  }
  return sum;
}

// The pages a probe reads: the float32 words of `cache`'s pages that `block_table` lists.
struct ListedPages {
  const float* data;
  const int32_t* table;
  int64_t page_numel, entries;
  const float* page(int64_t i) const { return data + table[i] * page_numel; }
};

ListedPages checked_pages(const char* name, const at::Tensor& cache,
                          const at::Tensor& block_table) {
  TORCH_CHECK_TYPE(cache.scalar_type() == at::kFloat && block_table.scalar_type() == at::kInt, name,
                   ": cache must be float32 and block_table int32, got ", cache.scalar_type(),
                   " and ", block_table.scalar_type());
  TORCH_CHECK_VALUE(cache.dim() >= 1 && cache.size(0) > 0 && cache.is_contiguous() &&
                        block_table.is_contiguous() && block_table.numel() > 0,
                    name,
                    ": cache must be a contiguous (num_pages, ...) tensor and "
                    "block_table a contiguous non-empty one, got cache ",
                    cache.sizes(), " and block_table ", block_table.sizes());
  TORCH_CHECK(__builtin_cpu_supports("avx"), name, ": needs AVX, which this CPU lacks");
  const auto [least, most] = at::aminmax(block_table);
  TORCH_CHECK_VALUE(least.item<int32_t>() >= 0 && most.item<int32_t>() < cache.size(0), name,
                    ": block_table's pages must lie in [0, ", cache.size(0), "), got ",
                    least.item<int32_t>(), " to ", most.item<int32_t>());
  return {cache.data_ptr<float>(), block_table.data_ptr<int32_t>(), cache.numel() / cache.size(0),
          block_table.numel()};
}

// The sum of read_entries(first, last) over the threads, the table's entries split evenly
// among them.
template <typename ReadEntries>
double split_among_threads(int64_t entries, const ReadEntries& read_entries) {
  const int64_t threads = at::get_num_threads();
  std::vector<double> sums(threads, 0.0);
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      sums[t] = read_entries(entries * t / threads, entries * (t + 1) / threads);
    }
  });
  return std::accumulate(sums.begin(), sums.end(), 0.0);
}

void request_into_l2(const float* words, int64_t numel) {
  const char* bytes = reinterpret_cast<const char*>(words);
  for (int64_t byte = 0; byte < numel * int64_t(sizeof(float)); byte += 64) {
    __builtin_prefetch(bytes + byte, /*rw=*/0, /*locality=*/2);
  }
}

double read_pages(const at::Tensor& cache, const at::Tensor& block_table, bool prefetch_next) {
  const ListedPages pages = checked_pages("read_pages", cache, block_table);
  return split_among_threads(pages.entries, [&](int64_t first, int64_t last) {
    double sum = 0.0;
    for (int64_t i = first; i < last; ++i) {
      if (prefetch_next && i + 1 < last) {
        request_into_l2(pages.page(i + 1), pages.page_numel);
      }
      sum += sum_page(pages.page(i), pages.page_numel);
    }
    return sum;
  });
}

using PageFunction = double (*)(const float*, int64_t);

// The decode's order over pages of `page_rows` tokens of `heads` heads' rows side by side
// (PagedKVCache's layout): a block of kDecodeBlockPages table entries (the decode's key block of
// 64 keys) at a time, head by head, each head's rows of the block's pages in turn (every
// row_numel words apart by heads rows), the same row of the next block requested into L2 as each
// is read (the decode's StreamAhead, register_tiles.h).
constexpr int64_t kDecodeBlockPages = 4;
double read_in_decode_order(const ListedPages& pages, int64_t first, int64_t last, int64_t heads,
                            int64_t page_rows, PageFunction compute) {
  const int64_t row_numel = pages.page_numel / (heads * page_rows);
  double sum = 0.0;
  for (int64_t block = first; block < last; block += kDecodeBlockPages) {
    const int64_t count = std::min(kDecodeBlockPages, last - block);
    const int64_t next_count = std::min(kDecodeBlockPages, last - block - count);
    for (int64_t h = 0; h < heads; ++h) {
      for (int64_t p = 0; p < count; ++p) {
        for (int64_t r = 0; r < page_rows; ++r) {
          const int64_t offset = (r * heads + h) * row_numel;
          if (p < next_count) {
            request_into_l2(pages.page(block + count + p) + offset, row_numel);
          }
          sum += compute(pages.page(block + p) + offset, row_numel);
        }
      }
    }
  }
  return sum;
}

// `causal_attention_bench::read_pages_computing`: read_pages (in order, the hardware's
// prefetchers alone) with `multiply_adds` (0, 4, 8, 16 or 32) multiply-adds on each vector as it
// is loaded; with `heads` > 0, in the decode's order instead (read_in_decode_order: pages of
// `page_rows` tokens of `heads` rows each). Timed against the same arithmetic on pages that stay
// in cache and against the bare read, it says whether the chip's memory system streams pages
// while the core computes on them, in either order (benchmarks/read_overlap.py).
double read_pages_computing(const at::Tensor& cache, const at::Tensor& block_table,
                            int64_t multiply_adds, int64_t heads, int64_t page_rows) {
  const ListedPages pages = checked_pages("read_pages_computing", cache, block_table);
  TORCH_CHECK(
      multiply_adds == 0 || (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")),
      "read_pages_computing: multiply_adds needs AVX2 and FMA, which this CPU lacks");
  TORCH_CHECK_VALUE(
      heads == 0 || (heads > 0 && page_rows > 0 && pages.page_numel % (heads * page_rows) == 0),
      "read_pages_computing: heads and page_rows must divide a page's ", pages.page_numel,
      " words, got ", heads, " and ", page_rows);
  const std::pair<int64_t, PageFunction> functions[] = {{0, sum_page},
                                                        {4, compute_on_page<4>},
                                                        {8, compute_on_page<8>},
                                                        {16, compute_on_page<16>},
                                                        {32, compute_on_page<32>}};
  PageFunction compute = nullptr;
  for (const auto& [count, function] : functions) {
    compute = count == multiply_adds ? function : compute;
  }
  TORCH_CHECK_VALUE(compute != nullptr,
                    "read_pages_computing: multiply_adds must be 0, 4, 8, 16 or 32, got ",
                    multiply_adds);
  return split_among_threads(pages.entries, [&](int64_t first, int64_t last) {
    if (heads > 0) {
      return read_in_decode_order(pages, first, last, heads, page_rows, compute);
    }
    double sum = 0.0;
    for (int64_t i = first; i < last; ++i) {
      sum += compute(pages.page(i), pages.page_numel);
    }
    return sum;
  });
}

}  // namespace
}  // namespace causal_attention::bench

TORCH_LIBRARY_FRAGMENT(causal_attention_bench, m) {
  m.def("read_pages(Tensor cache, Tensor block_table, bool prefetch_next) -> float",
        causal_attention::bench::read_pages);
  m.def(
      "read_pages_computing(Tensor cache, Tensor block_table, int multiply_adds, int heads=0, "
      "int page_rows=0) -> float",
      causal_attention::bench::read_pages_computing);
}
