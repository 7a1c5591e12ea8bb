// The one interface through which the CPU kernels multiply blocks (Q_i K_j^T, P V_j and the
// backward's products). Swapping the micro-kernel behind it is a change to block_gemm.cpp.
#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>

namespace causal_attention::cpu {

// C[M, N] = (accumulate ? C : 0) + A[M, K] * B[K, N]. A and C are row-major with leading
// dimensions lda, ldc. Any of M, N, K may be zero.
//
// float32 and float64: B is row-major with leading dimension ldb.
void block_gemm(int64_t M, int64_t N, int64_t K, const float* A, int64_t lda, const float* B,
                int64_t ldb, float* C, int64_t ldc, bool accumulate);
void block_gemm(int64_t M, int64_t N, int64_t K, const double* A, int64_t lda, const double* B,
                int64_t ldb, double* C, int64_t ldc, bool accumulate);
// bfloat16 with float32 accumulation: K must be even and B is in VNNI layout, pairs of
// consecutive k interleaved: B_vnni[(p * ldb + n) * 2 + i] = B[2 * p + i][n], ldb >= N.
// Only where bf16_block_gemm_available().
void block_gemm(int64_t M, int64_t N, int64_t K, const c10::BFloat16* A, int64_t lda,
                const c10::BFloat16* B_vnni, int64_t ldb, float* C, int64_t ldc, bool accumulate);

// Whether the bfloat16 micro-kernel is in use: an AVX-512 CPU, the AVX512 ATen CPU capability
// selected (at::get_cpu_capability(), which ATEN_CPU_CAPABILITY can lower: the kernels follow
// it) and oneDNN enabled (checked at each call). Elsewhere the kernels convert bfloat16 tiles
// to float32 instead.
bool bf16_block_gemm_available();

// Releases per-thread micro-kernel state; call once at the end of each task that used
// block_gemm.
void block_gemm_release();

}  // namespace causal_attention::cpu
