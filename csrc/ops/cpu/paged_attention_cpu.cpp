// The CPU entry of paged_attention: checks the block table and the sequences' lengths where it
// reads them, views q and the caches as the kernels take them and runs the paged forward
// (kernels/paged_forward_kernel.cpp), with an 8-bit cache's scales checked and viewed as the
// kernels read them.
#include "../paged_checks.h"
#include "../schema_adapters.h"
#include "../shapes.h"
#include "../tensor_checks.h"
#include "kernel_call.h"
#include "kernels/kernel_api.h"

#include <ATen/Parallel.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace causal_attention::cpu {
namespace {

// What paged_attention's checks leave to the host (paged_checks.h), read here: each sequence's keys
// fit the pages its row of the table holds and every one of those pages lies in the pool.
// Returns the sequences as the kernels read them: cu_q (given,
// or Lq each for a dense q) and cu_k, the running count of the keys.
PackedSequences paged_sequences(const detail::PagedCall& call, const at::Tensor& table) {
  constexpr const char* op = "causal_attention.paged_attention";
  const at::Tensor seqlens = call.cache_seqlens.contiguous();
  const int64_t batch = seqlens.size(0), width = table.size(1);
  const int64_t pages = call.k_cache.size(0), page_size = call.k_cache.size(1);
  PackedSequences sequences;
  if (call.packed()) {
    sequences.cu_q = call.cu_seqlens_q->contiguous();
    sequences.max_len_q =
        detail::check_cumulative_lengths(op, "cu_seqlens_q", sequences.cu_q, call.q.size(0),
                                         "max_seqlen_q", call.max_seqlen_q->expect_int());
  } else {
    sequences.max_len_q = call.q.size(1);
    sequences.cu_q = at::arange(batch + 1, seqlens.options()).mul_(sequences.max_len_q);
  }
  sequences.cu_k = at::zeros({batch + 1}, seqlens.options());
  const int32_t* lengths = seqlens.data_ptr<int32_t>();
  const int32_t* rows = table.data_ptr<int32_t>();
  int32_t* cu_k = sequences.cu_k.data_ptr<int32_t>();
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t keys = lengths[b];
    TORCH_CHECK_VALUE(keys >= 0 && keys <= width * page_size, op, ": cache_seqlens[", b, "]=", keys,
                      " must lie in [0, ", width * page_size,
                      "], the keys block_table's row holds (max_pages * page_size = ", width, " * ",
                      page_size, ")");
    for (int64_t j = 0; j < (keys + page_size - 1) / page_size; ++j) {
      const int64_t page = rows[b * width + j];
      TORCH_CHECK_VALUE(page >= 0 && page < pages, op, ": block_table[", b, "][", j, "]=", page,
                        " names no page of the pool (k_cache.shape[0]=", pages, "); sequence ", b,
                        "'s ", keys, " keys lie on its first ", (keys + page_size - 1) / page_size,
                        " entries");
    }
    // The kernels count keys in int32 (cu_k): a table naming one page many times can say more.
    TORCH_CHECK_VALUE(cu_k[b] + keys <= std::numeric_limits<int32_t>::max(), op,
                      ": the sequences hold more than 2^31 - 1 keys in all (cache_seqlens sums to ",
                      cu_k[b] + keys, " by sequence ", b, ")");
    cu_k[b + 1] = static_cast<int32_t>(cu_k[b] + keys);
    sequences.max_len_k = std::max(sequences.max_len_k, keys);
  }
  return sequences;
}

// Whether the `count` scales from `first` are all positive and finite: those whose bits, read as
// an unsigned integer, lie in [1, 0x7F800000) (the sign clear, not zero, the exponent not all
// ones). Integer compares and no early exit, so that the compiler vectorizes the loop (float
// compares it kept scalar): a decode checks every scale it reads, B x keys x Hkv of them.
bool all_positive_finite(const float* first, int64_t count) {
  constexpr uint32_t kPositiveFinite = 0x7F7FFFFFu;  // the count of positive finite bit patterns
  uint32_t bad = 0;
  for (int64_t i = 0; i < count; ++i) {
    uint32_t bits;
    std::memcpy(&bits, first + i, sizeof(bits));
    bad |= static_cast<uint32_t>(bits - 1u >= kPositiveFinite);
  }
  return bad == 0;
}

// Whether every scale the sequences read is positive and finite, where a page's rows of scales lie
// side by side ((num_pages, page_size, Hkv) with its last two dims contiguous, as
// paged_cache_append writes them): each page's read rows checked at once, the sequences split
// among the threads. Checked serially, element by element, per-token scales made the 8-bit
// decode about 10 % slower than one scale per tensor (docs/benchmarks, "8-bit KV caches").
bool read_scales_valid(const at::Tensor& scales, const at::Tensor& table,
                       const at::Tensor& cache_seqlens, int64_t page_size) {
  const int64_t heads = scales.size(2), page_stride = scales.stride(0);
  const int64_t batch = table.size(0), width = table.size(1);
  const float* data = scales.data_ptr<float>();
  const int32_t* lengths = cache_seqlens.data_ptr<int32_t>();
  const int32_t* rows = table.data_ptr<int32_t>();
  std::vector<uint8_t> valid(batch, 1);
  at::parallel_for(0, batch, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      for (int64_t key = 0; key < lengths[b]; key += page_size) {
        const int64_t read_rows = std::min<int64_t>(page_size, lengths[b] - key);
        const float* page = data + rows[b * width + key / page_size] * page_stride;
        valid[b] &= all_positive_finite(page, read_rows * heads);
      }
    }
  });
  return std::all_of(valid.begin(), valid.end(), [](uint8_t v) { return v != 0; });
}

// The dequantization scale `name` of an 8-bit cache as the kernels read it (kernel_api.h): float32
// (num_pages, Hkv, page_size), one per tensor expanded along every dim, 1 where not given. Each
// scale the sequences read (the first cache_seqlens[b] rows of their pages) must be positive and
// finite: a scale of a page or slot no sequence reads yet is never looked at. Where a page's scales
// lie side by side they are checked at once (read_scales_valid), and read one by one only to name
// the first bad one.
at::Tensor kernel_scale(const char* name, const std::optional<at::Tensor>& given,
                        const at::Tensor& cache, const at::Tensor& table,
                        const at::Tensor& cache_seqlens) {
  constexpr const char* op = "causal_attention.paged_attention";
  const int64_t pages = cache.size(0), page_size = cache.size(1), heads = cache.size(2);
  if (!given.has_value() || given->numel() == 1) {
    const double value = given.has_value() ? given->item<double>() : 1.0;
    const float single = static_cast<float>(value);
    TORCH_CHECK_VALUE(single > 0 && std::isfinite(single), op, ": ", name,
                      " must be positive and finite (in float32), got ", value);
    return at::full({1, 1, 1}, single, at::kFloat).expand({pages, heads, page_size});
  }
  if (given->stride(2) == 1 && given->stride(1) == heads &&
      read_scales_valid(*given, table, cache_seqlens, page_size)) {
    return given->permute({0, 2, 1});
  }
  const auto scales = given->accessor<float, 3>();
  const int32_t* lengths = cache_seqlens.data_ptr<int32_t>();
  const int32_t* rows = table.data_ptr<int32_t>();
  for (int64_t b = 0; b < table.size(0); ++b) {
    for (int64_t key = 0; key < lengths[b]; ++key) {
      const int64_t page = rows[b * table.size(1) + key / page_size];
      for (int64_t h = 0; h < heads; ++h) {
        const float s = scales[page][key % page_size][h];
        TORCH_CHECK_VALUE(s > 0 && std::isfinite(s), op, ": ", name,
                          " must be positive and finite where the sequences read it, got ", name,
                          "[", page, "][", key % page_size, "][", h, "]=", s, " (sequence ", b,
                          "'s key ", key, ", block_table[", b, "][", key / page_size, "])");
      }
    }
  }
  return given->permute({0, 2, 1});
}

// spec_mask as the kernels read it (kernel_api.h's KernelAttentionMask over new tokens): each
// row's bits and padded bools over its sequence's new tokens, and each sequence's first new key.
// O(B * Lq^2), never proportional to the cache. Each row must see itself.
KernelAttentionMask new_token_mask(const detail::PagedCall& call,
                                   const PackedSequences& sequences) {
  constexpr const char* op = "causal_attention.paged_attention";
  constexpr int64_t pad = KernelAttentionMask::kNewTokenPad;
  const int64_t batch = sequences.cu_q.size(0) - 1, rows = sequences.max_len_q;
  const at::Tensor spec = call.spec_mask->contiguous();
  const bool* given = spec.data_ptr<bool>();
  const int32_t* cu_q = sequences.cu_q.data_ptr<int32_t>();
  const int32_t* cu_k = sequences.cu_k.data_ptr<int32_t>();
  KernelAttentionMask mask;
  mask.values = at::ones({batch, rows, pad + rows}, at::kBool);
  mask.tiles = at::zeros({batch, rows}, at::kLong);
  mask.first_new_key = at::empty({batch}, at::kLong);
  bool* bools = mask.values.data_ptr<bool>();
  int64_t* words = mask.tiles.data_ptr<int64_t>();
  int64_t* first = mask.first_new_key.data_ptr<int64_t>();
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t len_q = cu_q[b + 1] - cu_q[b];
    first[b] = (cu_k[b + 1] - cu_k[b]) - len_q;
    for (int64_t r = 0; r < len_q; ++r) {
      // Packed: row cu_q[b] + r of (total_q, max_seqlen_q); dense: (b, r) of (B, Lq, Lq).
      const bool* row =
          given + (call.packed() ? cu_q[b] + r : b * spec.size(1) + r) * spec.size(-1);
      TORCH_CHECK_VALUE(row[r], op,
                        ": spec_mask must let each query row see its own token, got spec_mask[",
                        call.packed() ? cu_q[b] + r : b, "]",
                        call.packed() ? std::string() : c10::str("[", r, "]"), "[", r,
                        "]=False (row ", r, " of sequence ", b, ")");
      uint64_t word = 0;
      for (int64_t j = 0; j < len_q; ++j) {
        bools[(b * rows + r) * (pad + rows) + pad + j] = row[j];
        word |= uint64_t(row[j]) << j;
      }
      words[b * rows + r] = static_cast<int64_t>(word);
    }
  }
  return mask;
}

// paged_attention: every sequence's query rows, one after the other as packed q's, against its
// keys read in place through the block table (kernels/paged_forward_kernel.cpp).
std::tuple<at::Tensor, at::Tensor> paged_attention_cpu(const detail::PagedCall& call) {
  const double scale = detail::check_paged_call(call);
  const bool packed = call.packed();
  const at::Tensor table = call.block_table.contiguous();
  const int64_t batch = table.size(0), heads_q = call.q.size(-2);
  const int64_t total_q = packed ? call.q.size(0) : call.q.size(0) * call.q.size(1);
  const auto kernel_rows = [](const at::Tensor& rows) {  // (total, H, D) as (1, H, total, D)
    return as_batch_heads_rows(rows.transpose(0, 1).unsqueeze(0));
  };
  // The caches as (num_pages, Hkv, page_size, D): views, but for a cache whose last dim is
  // strided.
  const auto kernel_cache = [](const at::Tensor& cache) {
    return (cache.stride(3) == 1 ? cache : cache.contiguous()).permute({0, 2, 1, 3});
  };
  PagedForwardTensors t(
      ForwardTensors::of(kernel_rows(call.q.reshape({total_q, heads_q, call.q.size(-1)})),
                         kernel_cache(call.k_cache), kernel_cache(call.v_cache)));
  t.block_table = table;
  t.scale = scale;
  t.sequences = paged_sequences(call, table);
  if (detail::is_eight_bit_cache(call.k_cache.scalar_type())) {
    const at::Tensor seqlens = call.cache_seqlens.contiguous();
    t.k_scale = kernel_scale("k_scale", call.k_scale, call.k_cache, table, seqlens);
    t.v_scale = kernel_scale("v_scale", call.v_scale, call.v_cache, table, seqlens);
  }
  t.options = kernel_options(t, call.options);
  if (call.spec_mask.has_value()) {
    t.attn_mask = new_token_mask(call, t.sequences);
  }
  const int64_t value_dim = call.v_cache.size(3);
  at::Tensor out = at::empty({total_q, heads_q, value_dim}, call.q.options());
  at::Tensor lse = at::empty({heads_q, total_q}, detail::lse_options(call.q));
  t.out = kernel_rows(out);
  t.lse = lse.unsqueeze(0);
  if (total_q > 0 && batch > 0) {
    run_kernel(paged_forward_kernel, std::move(t));
  }
  if (packed) {
    return {out, lse};
  }
  // flash-attn's dense layout: out (B, Lq, Hq, Dv), lse (B, Hq, Lq).
  const int64_t len_q = call.q.size(1);
  return {out.view({batch, len_q, heads_q, value_dim}),
          lse.view({heads_q, batch, len_q}).permute({1, 0, 2}).contiguous()};
}

}  // namespace
}  // namespace causal_attention::cpu

TORCH_LIBRARY_IMPL(causal_attention, CPU, m) {
  using namespace causal_attention;
  m.impl("paged_attention", detail::paged_from_schema<cpu::paged_attention_cpu>);
}
