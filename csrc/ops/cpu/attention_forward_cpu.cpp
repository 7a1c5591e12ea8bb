// CPU forward: FlashAttention-2 online softmax. One task owns one (batch, query head, query
// block) and walks the visible key blocks in order, keeping a running max, sum and output per
// row; nothing of size Lq x Lk is ever allocated.
#include "../checks.h"
#include "attention_tiles.h"
#include "block_gemm.h"

#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cmath>
#include <limits>
#include <vector>

namespace causal_attention::cpu {
namespace {

template <typename scalar_t>
void forward_kernel(const at::Tensor& q4, const at::Tensor& k4, const at::Tensor& v4,
                    const at::Tensor& out4, const at::Tensor& lse3, double scale_double) {
  using acc_t = at::opmath_type<scalar_t>;
  const AttentionDims dims = dims_of(q4, k4, v4);
  const HeadRows<const scalar_t> q(q4), k(k4), v(v4);
  const HeadRows<scalar_t> out(out4);
  acc_t* const lse = lse3.data_ptr<acc_t>();
  const acc_t scale = static_cast<acc_t>(scale_double);
  const int64_t D = dims.head_dim, Dv = dims.value_dim;
  const int64_t num_qblocks = ceil_div(dims.len_q, kQueryBlock);
  const acc_t neg_inf = -std::numeric_limits<acc_t>::infinity();

  at::parallel_for(0, dims.batch * dims.heads_q * num_qblocks, 1, [&](int64_t begin, int64_t end) {
    std::vector<acc_t> q_tile(kQueryBlock * D), k_t(D * kKeyBlock), v_tile(kKeyBlock * Dv);
    std::vector<acc_t> scores(kQueryBlock * kKeyBlock), acc(kQueryBlock * Dv);
    std::vector<acc_t> row_max(kQueryBlock), row_sum(kQueryBlock);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t bh = item / num_qblocks;
      const int64_t b = bh / dims.heads_q, h = bh % dims.heads_q;
      const int64_t h_kv = h / dims.group();
      const int64_t q0 = balanced_block(item % num_qblocks, num_qblocks) * kQueryBlock;
      const int64_t rows = std::min(kQueryBlock, dims.len_q - q0);
      const int64_t key_end = dims.visible_keys(q0 + rows - 1);

      int64_t ldq = 0;
      const acc_t* q_rows =
          rows_as<acc_t>(q.row(b, h, q0), rows, D, q.row_stride, q_tile.data(), &ldq);
      std::fill_n(row_max.begin(), rows, neg_inf);
      std::fill_n(row_sum.begin(), rows, acc_t(0));
      std::fill_n(acc.begin(), rows * Dv, acc_t(0));

      for (int64_t k0 = 0; k0 < key_end; k0 += kKeyBlock) {
        const int64_t cols = std::min(kKeyBlock, key_end - k0);
        transpose_as<acc_t>(k.row(b, h_kv, k0), cols, D, k.row_stride, k_t.data());
        block_gemm(rows, cols, D, q_rows, ldq, k_t.data(), cols, scores.data(), cols,
                   /*accumulate=*/false);
        for (int64_t r = 0; r < rows; ++r) {
          acc_t* s = scores.data() + r * cols;
          const int64_t visible = std::clamp<int64_t>(dims.visible_keys(q0 + r) - k0, 0, cols);
          acc_t block_max = neg_inf;
          for (int64_t c = 0; c < visible; ++c) {
            s[c] *= scale;
            block_max = std::max(block_max, s[c]);
          }
          const acc_t new_max = std::max(row_max[r], block_max);
          if (new_max == neg_inf) {  // nothing visible to this row yet
            std::fill_n(s, cols, acc_t(0));
            continue;
          }
          const acc_t correction = std::exp(row_max[r] - new_max);
          acc_t block_sum = 0;
          for (int64_t c = 0; c < visible; ++c) {
            s[c] = std::exp(s[c] - new_max);
            block_sum += s[c];
          }
          std::fill(s + visible, s + cols, acc_t(0));
          row_sum[r] = row_sum[r] * correction + block_sum;
          row_max[r] = new_max;
          acc_t* o = acc.data() + r * Dv;
          for (int64_t d = 0; d < Dv; ++d) {
            o[d] *= correction;
          }
        }
        int64_t ldv = 0;
        const acc_t* v_rows =
            rows_as<acc_t>(v.row(b, h_kv, k0), cols, Dv, v.row_stride, v_tile.data(), &ldv);
        block_gemm(rows, Dv, cols, scores.data(), cols, v_rows, ldv, acc.data(), Dv,
                   /*accumulate=*/true);
      }

      acc_t* lse_rows = lse + bh * dims.len_q + q0;
      for (int64_t r = 0; r < rows; ++r) {
        const bool empty_row = row_sum[r] == acc_t(0);
        const acc_t inv_sum = empty_row ? acc_t(0) : acc_t(1) / row_sum[r];
        lse_rows[r] = empty_row ? neg_inf : row_max[r] + std::log(row_sum[r]);
        store_rows<scalar_t>(acc.data() + r * Dv, 1, Dv, Dv, inv_sum, out.row(b, h, q0 + r),
                             out.row_stride);
      }
    }
    block_gemm_release();
  });
}

std::tuple<at::Tensor, at::Tensor> attention_forward_cpu(const at::Tensor& q, const at::Tensor& k,
                                                         const at::Tensor& v, double scale) {
  constexpr const char* op = "causal_attention.attention_forward";
  detail::check_attention_inputs(op, q, k, v);
  detail::check_scale(op, scale);
  const at::Tensor q4 = as_batch_heads_rows(q), k4 = as_batch_heads_rows(k),
                   v4 = as_batch_heads_rows(v);
  at::Tensor out = at::empty({q4.size(0), q4.size(1), q4.size(2), v4.size(3)}, q.options());
  at::Tensor lse = at::empty({q4.size(0), q4.size(1), q4.size(2)},
                             q.options().dtype(detail::accumulation_dtype(q.scalar_type())));
  if (lse.numel() > 0) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(),
                                    "causal_attention_forward_cpu",
                                    [&] { forward_kernel<scalar_t>(q4, k4, v4, out, lse, scale); });
  }
  return {out.view_symint(detail::output_sym_sizes(q, v)),
          lse.view_symint(detail::lse_sym_sizes(q))};
}

at::Tensor attention_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                         std::optional<double> scale) {
  const double resolved = detail::resolve_scale("causal_attention.attention", q, scale);
  return std::get<0>(attention_forward_cpu(q, k, v, resolved));
}

}  // namespace
}  // namespace causal_attention::cpu

TORCH_LIBRARY_IMPL(causal_attention, CPU, m) {
  m.impl("attention", causal_attention::cpu::attention_cpu);
  m.impl("attention_forward", causal_attention::cpu::attention_forward_cpu);
}
