// The dropout keep mask materialized (the op dropout_keep_mask, for attention_weights): the very
// hash the attention kernels apply block by block (dropout_hash.h), row by row in parallel.
#include "dropout_hash.h"
#include "kernel_api.h"

#include <ATen/Parallel.h>

#include <algorithm>

namespace causal_attention::cpu::CPU_CAPABILITY {
namespace {

void dropout_keep_mask_impl(const KeepMaskTensors& t) {
  const int64_t len_k = t.mask.size(-1);
  const int64_t rows = t.mask.numel() / std::max<int64_t>(len_k, 1);
  const int64_t len_q = std::max<int64_t>(t.len_q, 1);
  const DropoutHash hash(t.dropout_p, t.dropout_seed, t.dropout_offset);
  bool* out = t.mask.data_ptr<bool>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const int64_t bh = row / len_q;
      const uint32_t row_key = hash.row_key(bh / t.heads, bh % t.heads, row % len_q);
      for (int64_t key = 0; key < len_k; ++key) {
        out[row * len_k + key] = hash.kept(row_key, key);
      }
    }
  });
}

}  // namespace

CAUSAL_ATTENTION_REGISTER_KERNEL(dropout_keep_mask_kernel, dropout_keep_mask_impl);

}  // namespace causal_attention::cpu::CPU_CAPABILITY
