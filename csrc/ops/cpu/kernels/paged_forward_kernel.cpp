// CPU forward of a paged KV cache (paged_attention), with K and V rows read in place from their
// pages (PagedRows, forward_kernel.h): no gather of the cache. A sequence's query rows take the
// decode path (decode.h: decode rows, short chunks; key splits over long caches as for a contiguous
// one) up to kMaxDecodeQueryRows of them, else the block path (block_forward.h: prefill chunks,
// whose block products take their keys packed from the pages, as a contiguous call packs its own).
// A call holding both kinds runs each kind's sequences as a call of their own. 8-bit pages are
// widened block by block with their scales (quantized_rows.h), on either path.
#include "dtype_dispatch.h"
#include "forward_kernel.h"
#include "kernel_api.h"
#include "schedule.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>

#include <algorithm>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace causal_attention::cpu::CPU_CAPABILITY {
namespace {

// The forward over pages in q's dtype, read in place (bfloat16 and float16 rows widened in
// registers), or over 8-bit pages (k_scale given) with their scales: read in place by the decode,
// widened a block at a time by the block path (quantized_rows.h). The checks refuse 8-bit caches
// beside a float64 q, the one dtype without a kernel for them.
template <typename scalar_t, typename gemm_t>
class PagedForwardKernel {
 public:
  explicit PagedForwardKernel(const PagedForwardTensors& t) : t_(t) {}

  void run() const {
    if (!t_.k_scale.defined()) {
      kernel<PagedRows<const scalar_t>>().run();
    } else if constexpr (!std::is_same_v<scalar_t, double>) {
      if (!forward_decodes(AttentionDims(t_))) {
        return kernel<QuantizedPagedRows>().run();
      }
      switch (eight_bit_format(t_.k.scalar_type())) {
        case EightBit::kE4M3:  // NaN set apart by the decode (eight_bit_values.h)
          return kernel<ScaledPagedRows<E4M3Over256>>().run();
        case EightBit::kE5M2:
          return kernel<ScaledPagedRows<c10::Float8_e5m2>>().run();
        case EightBit::kInt8:
          return kernel<ScaledPagedRows<int8_t>>().run();
      }
    }
  }

 private:
  template <typename KeyRows>
  ForwardKernel<scalar_t, gemm_t, PagedForwardTensors, KeyRows> kernel() const {
    return {t_, [](const PagedForwardTensors& t, const AttentionDims&) {
              return paged_key_value_rows<KeyRows>(t);
            }};
  }

  const PagedForwardTensors& t_;
};

// The cumulative counts (int32, size + 1) of counts[i] for i in `picked`, and their largest.
std::pair<at::Tensor, int64_t> cumulative(const int32_t* cu, const std::vector<int64_t>& picked) {
  std::vector<int32_t> sums{0};
  int64_t longest = 0;
  for (int64_t b : picked) {
    const int32_t n = cu[b + 1] - cu[b];
    sums.push_back(sums.back() + n);
    longest = std::max<int64_t>(longest, n);
  }
  return {at::from_blob(sums.data(), {int64_t(sums.size())}, at::kInt).clone(), longest};
}

// Runs the call's sequences `picked` as a call of their own: their query rows, table rows,
// ALiBi slopes and spec_mask copied out (the queries, never the cache), their results copied back.
void run_sequences(const PagedForwardTensors& t, const std::vector<int64_t>& picked) {
  const int32_t* cu_q = t.sequences.cu_q.data_ptr<int32_t>();
  std::vector<int64_t> rows;
  for (int64_t b : picked) {
    for (int64_t r = cu_q[b]; r < cu_q[b + 1]; ++r) {
      rows.push_back(r);
    }
  }
  const at::Tensor row_index = at::from_blob(rows.data(), {int64_t(rows.size())}, at::kLong);
  const at::Tensor sequence_index =
      at::from_blob(const_cast<int64_t*>(picked.data()), {int64_t(picked.size())}, at::kLong);
  PagedForwardTensors part(t);
  part.q = t.q.index_select(2, row_index);
  part.out = at::empty({1, t.out.size(1), int64_t(rows.size()), t.out.size(3)}, t.out.options());
  part.lse = at::empty({1, t.lse.size(1), int64_t(rows.size())}, t.lse.options());
  part.block_table = t.block_table.index_select(0, sequence_index);
  std::tie(part.sequences.cu_q, part.sequences.max_len_q) = cumulative(cu_q, picked);
  std::tie(part.sequences.cu_k, part.sequences.max_len_k) =
      cumulative(t.sequences.cu_k.data_ptr<int32_t>(), picked);
  if (t.options.alibi_slopes.defined()) {
    part.options.alibi_slopes = t.options.alibi_slopes.index_select(0, sequence_index);
  }
  if (t.attn_mask.over_new_tokens()) {  // spec_mask, one slice a sequence (kernel_api.h)
    for (at::Tensor KernelAttentionMask::* slice :
         {&KernelAttentionMask::values, &KernelAttentionMask::tiles,
          &KernelAttentionMask::first_new_key}) {
      part.attn_mask.*slice = (t.attn_mask.*slice).index_select(0, sequence_index);
    }
  }
  run_for_dtype<PagedForwardKernel>(part);
  t.out.index_copy_(2, row_index, part.out);
  t.lse.index_copy_(2, row_index, part.lse);
}

void paged_forward_kernel_impl(const PagedForwardTensors& tensors) {
  const int32_t* cu_q = tensors.sequences.cu_q.data_ptr<int32_t>();
  std::vector<int64_t> decoded, in_blocks;
  for (int64_t b = 0; b + 1 < tensors.sequences.cu_q.numel(); ++b) {
    (cu_q[b + 1] - cu_q[b] <= kMaxDecodeQueryRows ? decoded : in_blocks).push_back(b);
  }
  if (decoded.empty() || in_blocks.empty()) {
    run_for_dtype<PagedForwardKernel>(tensors);
    return;
  }
  run_sequences(tensors, decoded);
  run_sequences(tensors, in_blocks);
}

}  // namespace

CAUSAL_ATTENTION_REGISTER_KERNEL(paged_forward_kernel, paged_forward_kernel_impl);

}  // namespace causal_attention::cpu::CPU_CAPABILITY
