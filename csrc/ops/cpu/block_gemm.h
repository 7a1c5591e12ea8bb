// The one interface through which the CPU kernels multiply blocks (Q_i K_j^T, P V_j and the
// backward's products). Swapping the micro-kernel behind it is a change to block_gemm.cpp.
#pragma once

#include <c10/core/ScalarType.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

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
// bfloat16 or float16 with float32 accumulation: K must be even and B is in VNNI layout, pairs
// of consecutive k interleaved: B_vnni[(p * ldb + n) * 2 + i] = B[2 * p + i][n], ldb >= N.
// Native where native_products_now(dtype), else widened here (exactly the same values, up to the
// order of float32 sums): so they multiply on every CPU.
void block_gemm(int64_t M, int64_t N, int64_t K, const c10::BFloat16* A, int64_t lda,
                const c10::BFloat16* B_vnni, int64_t ldb, float* C, int64_t ldc, bool accumulate);
void block_gemm(int64_t M, int64_t N, int64_t K, const c10::Half* A, int64_t lda,
                const c10::Half* B_vnni, int64_t ldb, float* C, int64_t ldc, bool accumulate);

// How bfloat16/float16 inputs are multiplied. The algorithm is the same on every CPU: the
// products of two inputs (S = Q K^T, dP = dO V^T) take them in their own dtype; every product
// with P or dS takes those at float32 grade (kernels/backward_block_pair.h says why): bfloat16 as
// (hi, lo) bfloat16 pairs (kernels/operands.h: one bfloat16 product where native, hi + lo in
// float32 where widened; paged and 8-bit caches keep the forward's P in float32), float16 in
// float32 with the input widened to float32. Only the products of two inputs follow the CPU:
//   - native: the overloads above, oneDNN's bf16/f16 dot products (AVX-512 BF16, AMX,
//     AVX512-FP16);
//   - widened: the inputs converted to float32 tiles and multiplied by the float32 product
//     (bf16 x bf16 and f16 x f16 products are exact in float32, the sums float32's), so any x86
//     CPU computes what a native one does, up to the order of float32 sums.
// native_block_products(dtype) is true where the process uses native products for `dtype`
// (bfloat16 or float16; false for any other): the AVX512 kernel build is selected
// (at::get_cpu_capability(), which ATEN_CPU_CAPABILITY can lower), oneDNN really builds the
// kernel and it multiplies a probe block exactly (asked once per process, so ONEDNN_MAX_CPU_ISA
// is honoured), and the environment variable CAUSAL_ATTENTION_REDUCED_PRODUCTS is not
// "widened" (it is "auto", the default, or "widened"; read once per process). A call uses native
// products only if torch.backends.mkldnn is also enabled, which each call reads once.
bool native_block_products(at::ScalarType dtype);

// Whether a call of `dtype` made now multiplies natively: native_block_products(dtype) and oneDNN
// enabled now. The op boundary reads it once per call.
bool native_products_now(at::ScalarType dtype);

// The same as a word: "native" or "widened".
const char* block_products_in_use(at::ScalarType dtype);

// Releases per-thread micro-kernel state; call once at the end of each task that used
// block_gemm.
void block_gemm_release();

}  // namespace causal_attention::cpu
