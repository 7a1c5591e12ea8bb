// The forward of one call: few query rows against a long cache take the decode path (decode.h),
// the others the block path (block_forward.h), both on K/V rows that the call's tensors say where
// to read: a tensor's (HeadRows, attention_forward_kernel.cpp) or a paged cache's through its
// block table (PagedRows, paged_forward_kernel.cpp), or an 8-bit one's: read in place with their
// scales by the decode (ScaledPagedRows), widened with them by the block path (QuantizedPagedRows).
#pragma once

#include "block_forward.h"
#include "decode.h"
#include "geometry.h"
#include "kernel_api.h"
#include "quantized_rows.h"
#include "row_sources.h"
#include "schedule.h"
#include "split_combine.h"

#include <ATen/OpMathType.h>

#include <utility>

namespace causal_attention::cpu::CPU_CAPABILITY {

// The K and V rows of a call: its tensors', row r of a sequence from cu_k where it packs them.
template <typename scalar_t>
std::pair<HeadRows<const scalar_t>, HeadRows<const scalar_t>> key_value_rows(
    const ForwardTensors& t, const AttentionDims& d) {
  return {HeadRows<const scalar_t>(t.k, d.cu_k), HeadRows<const scalar_t>(t.v, d.cu_k)};
}
// A paged cache's, found through the block table: in q's dtype, or 8-bit with their scales.
template <typename KeyRows>
std::pair<KeyRows, KeyRows> paged_key_value_rows(const PagedForwardTensors& t) {
  if constexpr (KeyRows::kWidens || has_row_scales_v<KeyRows>) {
    return {KeyRows(t.k, t.k_scale, t.block_table), KeyRows(t.v, t.v_scale, t.block_table)};
  } else {
    return {KeyRows(t.k, t.block_table), KeyRows(t.v, t.block_table)};
  }
}
template <typename scalar_t>
std::pair<PagedRows<const scalar_t>, PagedRows<const scalar_t>> key_value_rows(
    const PagedForwardTensors& t, const AttentionDims& /*d*/) {
  return paged_key_value_rows<PagedRows<const scalar_t>>(t);
}

// KeyRows: where the call's K and V rows lie, key_value_rows' by default.
template <typename scalar_t, typename gemm_t, typename Tensors,
          typename KeyRows = typename decltype(key_value_rows<scalar_t>(
              std::declval<const Tensors&>(), std::declval<const AttentionDims&>()))::first_type>
class ForwardKernel {
  using acc_t = at::opmath_type<scalar_t>;

 public:
  explicit ForwardKernel(const Tensors& t)
      : ForwardKernel(t, [](const Tensors& tensors, const AttentionDims& d) {
          return key_value_rows<scalar_t>(tensors, d);
        }) {}
  // The K and V rows given by rows_of(t, dims).
  template <typename RowsOf>
  ForwardKernel(const Tensors& t, const RowsOf& rows_of)
      : dims_(t),
        q_(t.q, dims_.cu_q),
        kv_(rows_of(t, dims_)),
        modifiers_(t),
        output_{HeadRows<scalar_t>(t.out, dims_.cu_q), HeadRows<acc_t>(t.lse, dims_.cu_q),
                dims_.heads_q, dims_.value_dim, modifiers_} {}

  // The call on its path. An 8-bit cache's rows serve one path each: those of the decode
  // (ScaledPagedRows) and those of the block path (QuantizedPagedRows); the caller picks by
  // forward_decodes.
  void run() const {
    const auto& [k, v] = kv_;
    if (forward_decodes(dims_)) {
      if constexpr (!KeyRows::kWidens) {
        DecodeForward<scalar_t, KeyRows>(dims_, q_, k, v, output_, modifiers_).run();
        return;
      }
    } else if constexpr (!has_row_scales_v<KeyRows>) {
      BlockForward<scalar_t, gemm_t, KeyRows>(dims_, q_, k, v, output_, modifiers_).run();
      return;
    }
    TORCH_INTERNAL_ASSERT(false, "ForwardKernel: these K/V rows serve the other path");
  }

 private:
  const AttentionDims dims_;
  const HeadRows<const scalar_t> q_;
  const std::pair<KeyRows, KeyRows> kv_;
  const ScoreModifiers<acc_t> modifiers_;
  const OutputRows<scalar_t, acc_t> output_;
};

}  // namespace causal_attention::cpu::CPU_CAPABILITY
