// The shape of the kernels' block pairs: query rows and keys per block, chosen per chip from its
// caches and the instruction set its block products run on. Only the shapes depend on the chip:
// every block pair is computed the same way whatever its shape, and no choice depends on the
// thread count, so results stay bitwise identical at any thread count (a chip choosing other
// shapes sums its online softmax over other key blocks, within the same accuracy).
#pragma once

#include <c10/core/ScalarType.h>

#include <cstdint>

namespace causal_attention::cpu {

struct BlockSizes {
  int64_t query_rows;
  int64_t keys;
};

// The size of a CPU cache as the OS reports it (a sysconf name such as _SC_LEVEL2_CACHE_SIZE), or
// `fallback` where it does not.
int64_t cache_bytes(int name, int64_t fallback);

// Whether the chip multiplies `products` on AMX tiles: bfloat16 where it has amx_bf16 (native
// products of bfloat16 are oneDNN's, which takes the tiles where the chip has them). Read once.
bool products_on_tiles(at::ScalarType products);

// The block shape of a call whose products of two inputs (S = Q K^T, dP = dO V^T) take
// `products` (the input dtype where they are native, else float32 or float64: block_gemm.h), with
// head and value dims as given, whose query rows each see at most `keys_seen` keys (the longest
// sequence's keys, or a sliding window's span where that is shorter: `windowed`). The environment
// variable CAUSAL_ATTENTION_BLOCK_SHAPE, read once per process, is "auto" (the default: the rule
// in block_shapes.cpp) or "QxK", query rows and keys each a multiple of 16 from 16 to 1024, which
// every call then takes: it lets a chip run, and its tests check, the shapes another chip
// chooses.
BlockSizes block_sizes(int64_t head_dim, int64_t value_dim, int64_t keys_seen, bool windowed,
                       at::ScalarType products);

// The bytes of packed K and V copies (kernels/packed_kv.h) that stay in cache while the tasks
// reading them run: half of the L3 a core shares (sysfs's, else sysconf's; 8 MiB where neither
// says). The environment variable CAUSAL_ATTENTION_PACKING_BYTES, read once per process, sets
// another (a positive number of bytes): it lets a test cut calls into packing groups on any chip.
// The budget changes when K and V are packed, never a sum.
int64_t packing_budget();

}  // namespace causal_attention::cpu
