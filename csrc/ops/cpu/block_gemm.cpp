#include "block_gemm.h"

#include <ATen/Context.h>
#include <ATen/Version.h>
#include <ATen/native/CPUBlas.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <exception>
#include <mutex>
#include <string>
#include <vector>

namespace causal_attention::cpu {
namespace {

template <typename T>
void zero_block(int64_t M, int64_t N, T* C, int64_t ldc) {
  for (int64_t i = 0; i < M; ++i) {
    std::fill_n(C + i * ldc, N, T(0));
  }
}

// Handles the sizes the micro-kernel is not given: returns true when nothing is left to do.
template <typename T>
bool degenerate(int64_t M, int64_t N, int64_t K, T* C, int64_t ldc, bool accumulate) {
  if (M == 0 || N == 0) {
    return true;
  }
  if (K == 0) {
    if (!accumulate) {
      zero_block(M, N, C, ldc);
    }
    return true;
  }
  return false;
}

}  // namespace

// oneDNN's brgemm micro-kernel (libtorch falls back to its own GEMM where oneDNN cannot run);
// deterministic for fixed sizes, which the kernels' bitwise reproducibility relies on.
void block_gemm(int64_t M, int64_t N, int64_t K, const float* A, int64_t lda, const float* B,
                int64_t ldb, float* C, int64_t ldc, bool accumulate) {
  if (degenerate(M, N, K, C, ldc, accumulate)) {
    return;
  }
  at::native::cpublas::brgemm(M, N, K, lda, ldb, ldc, accumulate, A, B, C, /*is_vnni=*/false);
}

// float64 has no micro-kernel in libtorch; a plain i-k-j loop keeps the inner loop contiguous
// so the compiler vectorizes it. float64 is for reference accuracy, not speed.
void block_gemm(int64_t M, int64_t N, int64_t K, const double* A, int64_t lda, const double* B,
                int64_t ldb, double* C, int64_t ldc, bool accumulate) {
  if (!accumulate) {
    zero_block(M, N, C, ldc);
  }
  for (int64_t i = 0; i < M; ++i) {
    double* c_row = C + i * ldc;
    for (int64_t p = 0; p < K; ++p) {
      const double a = A[i * lda + p];
      const double* b_row = B + p * ldb;
      for (int64_t j = 0; j < N; ++j) {
        c_row[j] += a * b_row[j];
      }
    }
  }
}

namespace {

// CAUSAL_ATTENTION_REDUCED_PRODUCTS, read once per process: whether native products may be used.
bool native_products_allowed() {
  static const bool allowed = [] {
    const char* value = std::getenv("CAUSAL_ATTENTION_REDUCED_PRODUCTS");
    const std::string choice = value == nullptr ? "auto" : value;
    TORCH_CHECK_VALUE(choice == "auto" || choice == "widened" || choice.empty(),
                      "CAUSAL_ATTENTION_REDUCED_PRODUCTS must be \"auto\" or \"widened\", got \"",
                      choice, "\"");
    return choice != "widened";
  }();
  return allowed;
}

// Asks oneDNN (through libtorch's brgemm) for the VNNI-layout kernel of T and checks that it
// multiplies a probe block exactly: small integers, whose products and sums float32 holds
// exactly. False where oneDNN cannot generate the kernel (an AVX-512 CPU without avx512_bf16,
// ONEDNN_MAX_CPU_ISA below it, no AMX-FP16 / AVX512-FP16 for float16), which libtorch or oneDNN
// reports by raising (c10::Error, or oneDNN's own std::exception), and where it computes anything
// else.
template <typename T>
bool native_kernel_multiplies_exactly() {
  constexpr int64_t M = 3, N = 16, K = 4;
  T a[M * K];
  T b_vnni[K * N];
  float c[M * N];
  for (int64_t i = 0; i < M * K; ++i) a[i] = T(float(i % 7) - 3.0f);
  for (int64_t i = 0; i < K * N; ++i) b_vnni[i] = T(float(i % 5) - 2.0f);
  try {
    at::native::cpublas::brgemm(M, N, K, K, N, N, /*add_C=*/false, a, b_vnni, c,
                                /*is_vnni=*/true);
    at::native::cpublas::brgemm_release(/*is_vnni=*/true);
  } catch (const std::exception&) {
    return false;
  }
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t n = 0; n < N; ++n) {
      float want = 0;
      for (int64_t k = 0; k < K; ++k) {
        want += float(a[m * K + k]) * float(b_vnni[((k / 2) * N + n) * 2 + k % 2]);
      }
      if (c[m * N + n] != want) {
        return false;
      }
    }
  }
  return true;
}

// Whether this process multiplies T natively (block_gemm.h). The probe needs oneDNN enabled
// (libtorch's brgemm reads the flag): while it is disabled nothing is decided, and the next call
// with it enabled probes.
template <typename T>
bool native_products_of() {
#if defined(CAUSAL_ATTENTION_BASELINE_KERNELS_ONLY)
  return false;  // not x86-64: there is no AVX512 build (CMakeLists.txt)
#else
  enum : int { kUnknown, kNative, kWidened };
  static std::atomic<int> state{kUnknown};
  static std::mutex probing;
  const int known = state.load(std::memory_order_acquire);
  if (known != kUnknown) {
    return known == kNative;
  }
  // Only the AVX512 kernel build multiplies natively: it is the one the kernels' dispatch pairs
  // with these products, and ATEN_CPU_CAPABILITY lowering it must lower them too.
  if (!native_products_allowed() || at::get_cpu_capability() != "AVX512") {
    state.store(kWidened, std::memory_order_release);
    return false;
  }
  if (!at::globalContext().userEnabledMkldnn()) {
    return false;
  }
  std::lock_guard<std::mutex> lock(probing);
  if (state.load(std::memory_order_acquire) == kUnknown) {
    state.store(native_kernel_multiplies_exactly<T>() ? kNative : kWidened,
                std::memory_order_release);
  }
  return state.load(std::memory_order_acquire) == kNative;
#endif
}

// The widened product of VNNI-layout operands: A and B converted to float32 (exactly), then the
// float32 product. Where a native call cannot be made (oneDNN disabled, or disabled by another
// thread between the caller's check and libtorch's), this computes the same values.
template <typename T>
void widened_vnni_product(int64_t M, int64_t N, int64_t K, const T* A, int64_t lda, const T* B_vnni,
                          int64_t ldb, float* C, int64_t ldc, bool accumulate) {
  thread_local std::vector<float> a_wide, b_wide;
  a_wide.resize(M * K);
  b_wide.resize(K * N);
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t k = 0; k < K; ++k) {
      a_wide[m * K + k] = float(A[m * lda + k]);
    }
  }
  for (int64_t k = 0; k < K; ++k) {
    for (int64_t n = 0; n < N; ++n) {
      b_wide[k * N + n] = float(B_vnni[((k / 2) * ldb + n) * 2 + k % 2]);
    }
  }
  at::native::cpublas::brgemm(M, N, K, K, N, ldc, accumulate, a_wide.data(), b_wide.data(), C,
                              /*is_vnni=*/false);
}

template <typename T>
void vnni_product(int64_t M, int64_t N, int64_t K, const T* A, int64_t lda, const T* B_vnni,
                  int64_t ldb, float* C, int64_t ldc, bool accumulate) {
  if (degenerate(M, N, K, C, ldc, accumulate)) {
    return;
  }
  if (native_products_now(c10::CppTypeToScalarType<T>::value)) {
    try {
      at::native::cpublas::brgemm(M, N, K, lda, ldb, ldc, accumulate, A, B_vnni, C,
                                  /*is_vnni=*/true);
      return;
    } catch (const c10::Error&) {
      // oneDNN was disabled after the check above: libtorch refused the call, C is untouched.
    }
  }
  widened_vnni_product(M, N, K, A, lda, B_vnni, ldb, C, ldc, accumulate);
}

}  // namespace

void block_gemm(int64_t M, int64_t N, int64_t K, const c10::BFloat16* A, int64_t lda,
                const c10::BFloat16* B_vnni, int64_t ldb, float* C, int64_t ldc, bool accumulate) {
  vnni_product(M, N, K, A, lda, B_vnni, ldb, C, ldc, accumulate);
}

void block_gemm(int64_t M, int64_t N, int64_t K, const c10::Half* A, int64_t lda,
                const c10::Half* B_vnni, int64_t ldb, float* C, int64_t ldc, bool accumulate) {
  vnni_product(M, N, K, A, lda, B_vnni, ldb, C, ldc, accumulate);
}

bool native_block_products(at::ScalarType dtype) {
  switch (dtype) {
    case at::kBFloat16:
      return native_products_of<c10::BFloat16>();
    case at::kHalf:
      return native_products_of<c10::Half>();
    default:
      return false;
  }
}

bool native_products_now(at::ScalarType dtype) {
  return native_block_products(dtype) && at::globalContext().userEnabledMkldnn();
}

const char* block_products_in_use(at::ScalarType dtype) {
  return native_products_now(dtype) ? "native" : "widened";
}

void block_gemm_release() {
  // Releases the AMX tile state a native product configured; elsewhere it does nothing.
  at::native::cpublas::brgemm_release(/*is_vnni=*/true);
}

}  // namespace causal_attention::cpu
