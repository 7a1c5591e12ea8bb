#include "block_gemm.h"

#include <ATen/Context.h>
#include <ATen/Version.h>
#include <ATen/native/CPUBlas.h>

#include <algorithm>

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

void block_gemm(int64_t M, int64_t N, int64_t K, const c10::BFloat16* A, int64_t lda,
                const c10::BFloat16* B_vnni, int64_t ldb, float* C, int64_t ldc, bool accumulate) {
  if (degenerate(M, N, K, C, ldc, accumulate)) {
    return;
  }
  at::native::cpublas::brgemm(M, N, K, lda, ldb, ldc, accumulate, A, B_vnni, C,
                              /*is_vnni=*/true);
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

bool bf16_block_gemm_available() {
  // The CPU must be one on which libtorch's brgemm takes the oneDNN path for bfloat16 (ISA at
  // least avx512_core; elsewhere a VNNI-layout call would raise), and the ATen capability that
  // selects the kernels (attention_cpu.cpp; ATEN_CPU_CAPABILITY can lower it) must be AVX512,
  // the only build that uses the bfloat16 micro-kernel. Both are fixed for the process.
#if defined(CAUSAL_ATTENTION_BASELINE_KERNELS_ONLY)
  return false;  // not x86-64: there is no AVX512 build (CMakeLists.txt)
#else
  static const bool avx512_selected =
      __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
      at::get_cpu_capability() == "AVX512";
  return avx512_selected && at::globalContext().userEnabledMkldnn();
#endif
}

void block_gemm_release() {
  at::native::cpublas::brgemm_release(/*is_vnni=*/false);
  if (bf16_block_gemm_available()) {
    at::native::cpublas::brgemm_release(/*is_vnni=*/true);
  }
}

}  // namespace causal_attention::cpu
