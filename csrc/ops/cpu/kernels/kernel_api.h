// The entry points of the CPU kernels. The kernel sources are compiled once per instruction set
// (DEFAULT, AVX2, AVX512: see CMakeLists.txt) into namespaces of those names, as ATen does with
// CPU_CAPABILITY, and each build registers itself in its kernel's stub (ATen's DispatchStub):
// declared here once, it calls the build for this CPU's instruction set (kernel_stubs.cpp), so
// the library runs on any x86-64 CPU and uses AVX-512 where there is one.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <utility>

namespace causal_attention::cpu {

// Packed sequences (varlen): int32 cumulative lengths (sequences + 1) of the query rows and
// keys, and the longest of each. Undefined for a dense batch.
struct PackedSequences {
  at::Tensor cu_q, cu_k;
  int64_t max_len_q = 0, max_len_k = 0;
  bool packed() const { return cu_q.defined(); }
};

// The score options as the kernels read them, resolved from the op's (op_arguments.h) by
// kernel_call.h, applied in FlashAttention's order: scale -> softcap -> ALiBi -> visibility
// -> softmax with sinks -> dropout. Query row i sees key j iff
// i + off - window_left <= j <= i + off + window_right (off = len_k - len_q of its sequence, or
// ForwardTensors::query_offset), -1 meaning unbounded on that side. softcap 0 is off. alibi_slopes:
// contiguous float32 (batch, heads_q), sinks: contiguous (heads_q,) in the accumulation dtype, each
// undefined when not used. dropout_p 0 is off; else the counter-based mask of dropout_hash.h keyed
// by (dropout_seed, dropout_offset, batch, head, row, key).
struct KernelScoreOptions {
  int64_t window_left = -1, window_right = 0;
  double softcap = 0;
  at::Tensor alibi_slopes, sinks;
  double dropout_p = 0;
  uint64_t dropout_seed = 0, dropout_offset = 0;
};

// attn_mask as the kernels read it (op_arguments.h says what it means). values: (batch, heads_q,
// len_q, len_k), bool or floating in the accumulation dtype, a view with stride 0 along the dims
// the mask is broadcast along and stride 0 or 1 along keys. tiles: uint8 (batch, heads, query
// tiles, key tiles) over the mask's own dims (size 1 where it is broadcast), one MaskTile per
// kTileRows x kTileKeys entries, from whose bytes a block pair learns whether the mask hides it
// (skipped), leaves it as it is (nothing to read) or must be read entry by entry, without
// reading the mask. Tiles smaller than a block let a block pair leave out the rows and keys its
// tiles hide (where a document ends or starts inside a block). Undefined without a mask.
//
// Or, where first_new_key is defined, a mask over each sequence's new tokens (paged_attention's
// spec_mask): sequence b's keys before first_new_key[b] (int64 (batch,): its keys less its query
// rows) are visible to every row; new token j (key first_new_key[b] + j) is visible to row r where
// bit j of tiles[b][r] (int64 (batch, max rows)) is set, and values (bool (batch, max rows,
// kNewTokenPad + max rows)) holds the same row as bools from kNewTokenPad on, after kNewTokenPad
// true ones: so a block that starts up to kNewTokenPad keys before the first new key (no kernel's
// block holds more keys) reads its row from one pointer.
enum MaskTile : uint8_t { kTileHidden = 0, kTileVisible = 1, kTileMixed = 2 };
struct KernelAttentionMask {
  static constexpr int64_t kTileRows = 4, kTileKeys = 16;
  static constexpr int64_t kNewTokenPad = 128;
  at::Tensor values, tiles;
  at::Tensor first_new_key;
  bool defined() const { return values.defined(); }
  bool over_new_tokens() const { return first_new_key.defined(); }
};

// q, k, v, out: (batch, heads, rows, dim) with unit stride along dim; lse: (batch, heads_q,
// len_q) with unit stride along rows, in the accumulation dtype. Packed sequences: batch 1, the
// rows of every sequence one after the other, lse (1, heads_q, total rows). key_mask: contiguous
// bool (batch, len_k), kept_keys_before its int32 running count (batch, len_k + 1) from 0;
// both undefined without a mask.
struct ForwardTensors {
  at::Tensor q, k, v, out, lse;
  double scale = 0;
  at::Tensor key_mask, kept_keys_before;
  KernelAttentionMask attn_mask;
  PackedSequences sequences;
  KernelScoreOptions options;
  // A dense call's key position of query row 0 where the call gave it (op_arguments.h), else
  // len_k - len_q.
  std::optional<int64_t> query_offset;
  // bfloat16/float16: whether the block products are native (block_gemm.h), decided once per
  // call at the op boundary so that every product of the call agrees.
  bool native_products = false;

  // The inputs of a call in the kernels' layout; the outputs, the key mask and the options are
  // set after.
  static ForwardTensors of(at::Tensor q, at::Tensor k, at::Tensor v) {
    ForwardTensors t;
    t.q = std::move(q);
    t.k = std::move(k);
    t.v = std::move(v);
    return t;
  }
};

// The forward of a paged KV cache (paged_attention): q, out and lse as ForwardTensors' packed
// sequences (every sequence's query rows one after the other, cu_q; its keys counted by cu_k,
// their pages found through block_table), and k, v the cache itself viewed as (num_pages,
// heads_kv, page_size, dim) with unit stride along dim. block_table: contiguous int32
// (sequences, table_width), every page a sequence's keys lie on checked in range. k and v may
// instead be 8-bit (float8_e4m3fn, float8_e5m2, int8; both of one dtype) beside a floating q, with
// k_scale and v_scale their dequantization scales (stored value x scale = key or value): float32
// viewed as (num_pages, heads_kv, page_size), stride 0 along every dim for one per tensor;
// undefined for caches in q's dtype.
struct PagedForwardTensors : ForwardTensors {
  at::Tensor block_table;
  at::Tensor k_scale, v_scale;

  explicit PagedForwardTensors(ForwardTensors forward) : ForwardTensors(std::move(forward)) {}
};

// As ForwardTensors, plus grad_out shaped like out and dq, dk, dv shaped like q, k, v, with sinks
// dsinks (heads_q,) in the accumulation dtype, and where a floating attn_mask's gradient is asked
// for dattn_mask: zeros (batch, heads_q, len_q, len_k) in the accumulation dtype, contiguous, into
// which the kernel writes dS at every pair it computes (the caller sums it over broadcast dims).
// delta, where the call gives it, is rowsum(dO o O) laid out as lse: the rows' statistics over
// keys of which the call holds only some, taken as they are (backward_row_statistics.h).
struct BackwardTensors : ForwardTensors {
  at::Tensor grad_out, dq, dk, dv, dsinks, dattn_mask, delta;

  explicit BackwardTensors(ForwardTensors forward) : ForwardTensors(std::move(forward)) {}
};

// The dropout keep mask of scores (..., heads, len_q, len_k) as bool, contiguous: row r of the
// flat (rows, len_k) view is query row r % len_q of head (r / len_q) % heads of batch
// r / (len_q * heads), as the attention kernels index the mask.
struct KeepMaskTensors {
  at::Tensor mask;
  int64_t heads = 1, len_q = 1;
  double dropout_p = 0;
  uint64_t dropout_seed = 0, dropout_offset = 0;
};

// One kernel's builds, one per instruction set, and the call of the build for this CPU: the one
// at::get_cpu_capability() names (which ATEN_CPU_CAPABILITY can lower), or the next one below it
// that was built.
template <typename Tensors>
struct KernelStub {
  using Build = void (*)(const Tensors&);
  Build avx512 = nullptr, avx2 = nullptr, baseline = nullptr;

  void operator()(const Tensors& tensors) const;
};

extern KernelStub<ForwardTensors> forward_kernel;
extern KernelStub<BackwardTensors> backward_kernel;
extern KernelStub<KeepMaskTensors> dropout_keep_mask_kernel;
extern KernelStub<PagedForwardTensors> paged_forward_kernel;

// In a kernel source (compiled with CPU_CAPABILITY), registers `build` as its instruction set's
// build of `stub`, when the library loads.
#if defined(CPU_CAPABILITY_AVX512)
#define CAUSAL_ATTENTION_KERNEL_BUILD avx512
#elif defined(CPU_CAPABILITY_AVX2)
#define CAUSAL_ATTENTION_KERNEL_BUILD avx2
#else
#define CAUSAL_ATTENTION_KERNEL_BUILD baseline
#endif
#define CAUSAL_ATTENTION_REGISTER_KERNEL(stub, build)    \
  [[maybe_unused]] static const bool stub##_registered = \
      (::causal_attention::cpu::stub.CAUSAL_ATTENTION_KERNEL_BUILD = &build, true)

}  // namespace causal_attention::cpu
