// The one interface through which the CPU kernels multiply blocks (Q_i K_j^T, P V_j and the
// backward's four products). Swapping the micro-kernel behind it is a change to block_gemm.cpp.
#pragma once

#include <cstdint>

namespace causal_attention::cpu {

// C[M, N] = (accumulate ? C : 0) + A[M, K] * B[K, N]. All three are row-major with the given
// leading dimensions. Any of M, N, K may be zero.
void block_gemm(int64_t M, int64_t N, int64_t K, const float* A, int64_t lda, const float* B,
                int64_t ldb, float* C, int64_t ldc, bool accumulate);
void block_gemm(int64_t M, int64_t N, int64_t K, const double* A, int64_t lda, const double* B,
                int64_t ldb, double* C, int64_t ldc, bool accumulate);

// Releases per-thread micro-kernel state; call once at the end of each task that used
// block_gemm.
void block_gemm_release();

}  // namespace causal_attention::cpu
