// Concurrency from C++: many std::threads calling forward and backward at once, also while
// another thread keeps changing the intra-op thread count. Every call must give bitwise the result
// of the same call made serially (the kernels keep no shared mutable state), and all threads must
// finish.
#include "../attention_test_utils.h"

#include <ATen/Parallel.h>

#include <atomic>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>

namespace causal_attention::tests {
namespace {

constexpr int kThreads = 16;
constexpr int kCallsPerThread = 50;

struct Call {
  at::Tensor q, k, v, grad_out;
  ForwardBackward expected;
};

// Small, different inputs for every (thread, call): lengths, head dim, GQA ratio and dtype vary.
Call make_call(int seed) {
  static const at::ScalarType dtypes[] = {at::kDouble, at::kFloat, at::kBFloat16, at::kHalf};
  torch::manual_seed(seed);
  const at::ScalarType dtype = dtypes[seed % 4];
  const int64_t len_q = 1 + seed % 37, len_k = len_q + (seed / 7) % 11;
  const int64_t dim = seed % 2 == 0 ? 8 : 16, heads_kv = 1 + (seed / 3) % 2;
  Call call;
  call.q = torch::randn({2, 2 * heads_kv, len_q, dim}).to(dtype);
  call.k = torch::randn({2, heads_kv, len_k, dim}).to(dtype);
  call.v = torch::randn({2, heads_kv, len_k, dim}).to(dtype);
  call.grad_out = torch::randn({2, 2 * heads_kv, len_q, dim}).to(dtype);
  return call;
}

ForwardBackward run(const Call& call) {
  return tests::ours(call.q, call.k, call.v, call.grad_out, std::nullopt);
}

bool bitwise_equal(const ForwardBackward& a, const ForwardBackward& b) {
  return torch::equal(a.out, b.out) && torch::equal(a.dq, b.dq) && torch::equal(a.dk, b.dk) &&
         torch::equal(a.dv, b.dv);
}

// Inputs and serial results (computed on one intra-op thread) of every call of every thread.
const std::vector<std::vector<Call>>& calls() {
  static const std::vector<std::vector<Call>> table = [] {
    NumThreadsGuard guard;
    at::set_num_threads(1);
    std::vector<std::vector<Call>> t(kThreads);
    for (int thread = 0; thread < kThreads; ++thread) {
      for (int i = 0; i < kCallsPerThread; ++i) {
        Call call = make_call(thread * kCallsPerThread + i);
        call.expected = run(call);
        t[thread].push_back(std::move(call));
      }
    }
    return t;
  }();
  return table;
}

// Runs the calls of threads 0..count-1, each list on its own std::thread, calling
// before_each_call(seed) before each; returns how many results differed from the serial ones, and
// rethrows the first exception a thread raised.
int run_threads(int count, const std::function<void(int)>& before_each_call) {
  std::atomic<int> mismatches{0};
  std::mutex error_mutex;
  std::exception_ptr error;
  std::vector<std::thread> threads;
  for (int thread = 0; thread < count; ++thread) {
    threads.emplace_back([&, thread] {
      try {
        for (int i = 0; i < kCallsPerThread; ++i) {
          before_each_call(thread * kCallsPerThread + i);
          const Call& call = calls()[thread][i];
          if (!bitwise_equal(run(call), call.expected)) {
            ++mismatches;
          }
        }
      } catch (...) {
        std::lock_guard<std::mutex> lock(error_mutex);
        error = std::current_exception();
      }
    });
  }
  for (std::thread& t : threads) {
    t.join();
  }
  if (error) {
    std::rethrow_exception(error);
  }
  return mismatches.load();
}

TEST(Concurrency, SixteenThreadsEqualTheirSerialResults) {
  const auto& table = calls();
  ASSERT_EQ(table.size(), static_cast<size_t>(kThreads));
  EXPECT_EQ(run_threads(kThreads, [](int) {}), 0);
}

TEST(Concurrency, CallsWhileAnotherThreadChangesTheThreadCount) {
  calls();  // the serial results, before any thread count changes
  NumThreadsGuard guard;
  std::atomic<bool> stop{false};
  std::atomic<int> changes{0};
  std::thread changer([&] {
    int n = 0;
    do {
      at::set_num_threads(1 + n++ % 4);
      ++changes;
      std::this_thread::yield();
    } while (!stop.load());
  });
  // Each caller also changes its own thread count between calls.
  const int mismatches = run_threads(4, [](int seed) { at::set_num_threads(1 + seed % 3); });
  stop = true;
  changer.join();
  EXPECT_EQ(mismatches, 0);
  EXPECT_GT(changes.load(), 1);  // more than the first change: some while the calls ran
}

}  // namespace
}  // namespace causal_attention::tests
