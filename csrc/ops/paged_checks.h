// The checks of a paged_attention call (op_arguments.h's PagedCall), shared by its CPU and Meta
// kernels: c10::ValueError or c10::TypeError naming the argument, as the other calls' (checks.h).
// Written against sym_sizes() so that the Meta kernel runs them under symbolic shapes.
#pragma once

#include "op_arguments.h"

namespace causal_attention::detail {

// Everything paged_attention checks of its arguments' shapes, dtypes and devices (op_arguments.h
// says what they are: the caches of one floating dtype with q, or 8-bit with their scales' shapes,
// block_table and cache_seqlens int32 on the CPU, Hq % Hkv == 0, the score options as
// attention's, spec_mask bool on the CPU in its layout's shape); returns the scale. What their
// values must be (cache_seqlens within the table's pages, every page a sequence reads in the pool,
// cu_seqlens_q a running count of q's rows, the scales it reads positive and finite, each row of
// spec_mask seeing itself) the CPU kernel checks, where it reads them.
double check_paged_call(const PagedCall& call);

// The most new tokens a sequence may have in a call with spec_mask (each row's mask over them is
// one 64-bit word in the kernels).
constexpr int64_t kMaxSpecTokens = 64;

// Whether a cache of this dtype is 8-bit (float8_e4m3fn, float8_e5m2, int8), read with scales.
bool is_eight_bit_cache(at::ScalarType dtype);

}  // namespace causal_attention::detail
