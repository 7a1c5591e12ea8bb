// CPU backward, FlashAttention-2 style: P is recomputed block by block from the saved lse, never
// stored. To keep every gradient element owned by exactly one task (bitwise identical results
// at any thread count, no atomics, no per-thread partial sums), it runs two passes:
//   1. tasks own a (batch, kv head, key block) and accumulate dK_j, dV_j over the query rows of
//      every query head in the group that see those keys;
//   2. tasks own a (batch, query head, query block) and accumulate dQ_i over its visible keys.
// Pass 2 recomputes S and dP once more: 7 block products instead of 5, the price of determinism
// without O(L^2) or O(threads * L * D) buffers.
#include "../checks.h"
#include "attention_tiles.h"
#include "block_gemm.h"

#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros_like.h>
#include <torch/library.h>

#include <cmath>
#include <limits>
#include <vector>

namespace causal_attention::cpu {
namespace {

template <typename scalar_t>
struct BackwardProblem {
  using acc_t = at::opmath_type<scalar_t>;
  AttentionDims dims;
  HeadRows<const scalar_t> q, k, v, grad_out;
  const acc_t* lse;    // (batch * heads_q, len_q)
  const acc_t* delta;  // rowsum(dO * O), same layout as lse
  acc_t scale;
};

// The scratch one task needs to form one (query block x key block) tile of P and dS.
template <typename acc_t>
struct ScoreTiles {
  std::vector<acc_t> k_t, v_t;         // K_j^T (D x cols), V_j^T (Dv x cols)
  std::vector<acc_t> q_tile, do_tile;  // Q_i, dO_i converted to acc_t when needed
  std::vector<acc_t> p, ds;            // rows x cols

  ScoreTiles(int64_t D, int64_t Dv)
      : k_t(D * kKeyBlock),
        v_t(Dv * kKeyBlock),
        q_tile(kQueryBlock * D),
        do_tile(kQueryBlock * Dv),
        p(kQueryBlock * kKeyBlock),
        ds(kQueryBlock * kKeyBlock) {}
};

// Fills tiles.p = exp(S * scale - lse) and tiles.ds = P * (dO V^T - delta) for query rows
// [q0, q0 + rows) of head h against keys [k0, k0 + cols), whose transposes are already in
// tiles.k_t / tiles.v_t. Entries a row may not see, and rows with no visible key, are zero.
template <typename scalar_t>
void score_tiles(const BackwardProblem<scalar_t>& pb, int64_t bh,
                 const typename BackwardProblem<scalar_t>::acc_t* q_rows, int64_t ldq,
                 const typename BackwardProblem<scalar_t>::acc_t* do_rows, int64_t ld_do,
                 int64_t q0, int64_t rows, int64_t k0, int64_t cols,
                 ScoreTiles<typename BackwardProblem<scalar_t>::acc_t>& tiles) {
  using acc_t = typename BackwardProblem<scalar_t>::acc_t;
  const int64_t D = pb.dims.head_dim, Dv = pb.dims.value_dim;
  block_gemm(rows, cols, D, q_rows, ldq, tiles.k_t.data(), cols, tiles.p.data(), cols,
             /*accumulate=*/false);
  block_gemm(rows, cols, Dv, do_rows, ld_do, tiles.v_t.data(), cols, tiles.ds.data(), cols,
             /*accumulate=*/false);
  const acc_t* lse = pb.lse + bh * pb.dims.len_q + q0;
  const acc_t* delta = pb.delta + bh * pb.dims.len_q + q0;
  for (int64_t r = 0; r < rows; ++r) {
    acc_t* p = tiles.p.data() + r * cols;
    acc_t* ds = tiles.ds.data() + r * cols;
    const bool empty_row = lse[r] == -std::numeric_limits<acc_t>::infinity();
    const int64_t visible =
        empty_row ? 0 : std::clamp<int64_t>(pb.dims.visible_keys(q0 + r) - k0, 0, cols);
    for (int64_t c = 0; c < visible; ++c) {
      p[c] = std::exp(p[c] * pb.scale - lse[r]);
      ds[c] = p[c] * (ds[c] - delta[r]);
    }
    std::fill(p + visible, p + cols, acc_t(0));
    std::fill(ds + visible, ds + cols, acc_t(0));
  }
}

// Pass 1: dK and dV of one key block, summed over every query row (of every query head in the
// group) that sees it, in a fixed order.
template <typename scalar_t>
void key_block_gradients(const BackwardProblem<scalar_t>& pb, const HeadRows<scalar_t>& dk,
                         const HeadRows<scalar_t>& dv, int64_t b, int64_t h_kv, int64_t k0,
                         ScoreTiles<typename BackwardProblem<scalar_t>::acc_t>& tiles,
                         std::vector<typename BackwardProblem<scalar_t>::acc_t>& dk_acc,
                         std::vector<typename BackwardProblem<scalar_t>::acc_t>& dv_acc,
                         std::vector<typename BackwardProblem<scalar_t>::acc_t>& transposed) {
  using acc_t = typename BackwardProblem<scalar_t>::acc_t;
  const AttentionDims& dims = pb.dims;
  const int64_t D = dims.head_dim, Dv = dims.value_dim;
  const int64_t cols = std::min(kKeyBlock, dims.len_k - k0);
  transpose_as<acc_t>(pb.k.row(b, h_kv, k0), cols, D, pb.k.row_stride, tiles.k_t.data());
  transpose_as<acc_t>(pb.v.row(b, h_kv, k0), cols, Dv, pb.v.row_stride, tiles.v_t.data());
  std::fill_n(dk_acc.begin(), cols * D, acc_t(0));
  std::fill_n(dv_acc.begin(), cols * Dv, acc_t(0));
  const int64_t first_q0 = dims.first_row_seeing(k0) / kQueryBlock * kQueryBlock;
  for (int64_t g = 0; g < dims.group(); ++g) {
    const int64_t h = h_kv * dims.group() + g;
    const int64_t bh = b * dims.heads_q + h;
    for (int64_t q0 = first_q0; q0 < dims.len_q; q0 += kQueryBlock) {
      const int64_t rows = std::min(kQueryBlock, dims.len_q - q0);
      int64_t ldq = 0, ld_do = 0;
      const acc_t* q_rows =
          rows_as<acc_t>(pb.q.row(b, h, q0), rows, D, pb.q.row_stride, tiles.q_tile.data(), &ldq);
      const acc_t* do_rows = rows_as<acc_t>(pb.grad_out.row(b, h, q0), rows, Dv,
                                            pb.grad_out.row_stride, tiles.do_tile.data(), &ld_do);
      score_tiles(pb, bh, q_rows, ldq, do_rows, ld_do, q0, rows, k0, cols, tiles);
      // dV_j += P^T dO_i ; dK_j += dS^T Q_i
      transpose_as<acc_t>(tiles.p.data(), rows, cols, cols, transposed.data());
      block_gemm(cols, Dv, rows, transposed.data(), rows, do_rows, ld_do, dv_acc.data(), Dv,
                 /*accumulate=*/true);
      transpose_as<acc_t>(tiles.ds.data(), rows, cols, cols, transposed.data());
      block_gemm(cols, D, rows, transposed.data(), rows, q_rows, ldq, dk_acc.data(), D,
                 /*accumulate=*/true);
    }
  }
  store_rows<scalar_t>(dk_acc.data(), cols, D, D, pb.scale, dk.row(b, h_kv, k0), dk.row_stride);
  store_rows<scalar_t>(dv_acc.data(), cols, Dv, Dv, acc_t(1), dv.row(b, h_kv, k0), dv.row_stride);
}

// Pass 2: dQ of one query block, summed over its visible key blocks in order.
template <typename scalar_t>
void query_block_gradient(const BackwardProblem<scalar_t>& pb, const HeadRows<scalar_t>& dq,
                          int64_t b, int64_t h, int64_t q0,
                          ScoreTiles<typename BackwardProblem<scalar_t>::acc_t>& tiles,
                          std::vector<typename BackwardProblem<scalar_t>::acc_t>& k_tile,
                          std::vector<typename BackwardProblem<scalar_t>::acc_t>& dq_acc) {
  using acc_t = typename BackwardProblem<scalar_t>::acc_t;
  const AttentionDims& dims = pb.dims;
  const int64_t D = dims.head_dim, Dv = dims.value_dim;
  const int64_t h_kv = h / dims.group();
  const int64_t bh = b * dims.heads_q + h;
  const int64_t rows = std::min(kQueryBlock, dims.len_q - q0);
  const int64_t key_end = dims.visible_keys(q0 + rows - 1);
  int64_t ldq = 0, ld_do = 0;
  const acc_t* q_rows =
      rows_as<acc_t>(pb.q.row(b, h, q0), rows, D, pb.q.row_stride, tiles.q_tile.data(), &ldq);
  const acc_t* do_rows = rows_as<acc_t>(pb.grad_out.row(b, h, q0), rows, Dv, pb.grad_out.row_stride,
                                        tiles.do_tile.data(), &ld_do);
  std::fill_n(dq_acc.begin(), rows * D, acc_t(0));
  for (int64_t k0 = 0; k0 < key_end; k0 += kKeyBlock) {
    const int64_t cols = std::min(kKeyBlock, key_end - k0);
    transpose_as<acc_t>(pb.k.row(b, h_kv, k0), cols, D, pb.k.row_stride, tiles.k_t.data());
    transpose_as<acc_t>(pb.v.row(b, h_kv, k0), cols, Dv, pb.v.row_stride, tiles.v_t.data());
    score_tiles(pb, bh, q_rows, ldq, do_rows, ld_do, q0, rows, k0, cols, tiles);
    int64_t ldk = 0;
    const acc_t* k_rows =
        rows_as<acc_t>(pb.k.row(b, h_kv, k0), cols, D, pb.k.row_stride, k_tile.data(), &ldk);
    block_gemm(rows, D, cols, tiles.ds.data(), cols, k_rows, ldk, dq_acc.data(), D,
               /*accumulate=*/true);
  }
  store_rows<scalar_t>(dq_acc.data(), rows, D, D, pb.scale, dq.row(b, h, q0), dq.row_stride);
}

template <typename scalar_t>
void backward_kernel(const at::Tensor& grad_out4, const at::Tensor& q4, const at::Tensor& k4,
                     const at::Tensor& v4, const at::Tensor& out4, const at::Tensor& lse3,
                     double scale, const at::Tensor& dq4, const at::Tensor& dk4,
                     const at::Tensor& dv4) {
  using acc_t = at::opmath_type<scalar_t>;
  const AttentionDims dims = dims_of(q4, k4, v4);
  const int64_t D = dims.head_dim, Dv = dims.value_dim;
  const int64_t num_heads = dims.batch * dims.heads_q;

  // delta = rowsum(dO * O) in acc_t, one value per query row: O(Lq) memory.
  at::Tensor delta = at::empty({num_heads, dims.len_q}, lse3.options());
  const HeadRows<const scalar_t> out(out4), grad_out(grad_out4);
  acc_t* const delta_data = delta.data_ptr<acc_t>();
  at::parallel_for(0, num_heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / dims.heads_q, h = bh % dims.heads_q;
      for (int64_t r = 0; r < dims.len_q; ++r) {
        const scalar_t* o = out.row(b, h, r);
        const scalar_t* d_o = grad_out.row(b, h, r);
        acc_t sum = 0;
        for (int64_t d = 0; d < Dv; ++d) {
          sum += static_cast<acc_t>(o[d]) * static_cast<acc_t>(d_o[d]);
        }
        delta_data[bh * dims.len_q + r] = sum;
      }
    }
  });

  const at::Tensor lse_rows = lse3.contiguous();
  const BackwardProblem<scalar_t> pb{dims,
                                     HeadRows<const scalar_t>(q4),
                                     HeadRows<const scalar_t>(k4),
                                     HeadRows<const scalar_t>(v4),
                                     grad_out,
                                     lse_rows.data_ptr<acc_t>(),
                                     delta_data,
                                     static_cast<acc_t>(scale)};

  const int64_t num_kblocks = ceil_div(dims.len_k, kKeyBlock);
  const HeadRows<scalar_t> dk(dk4), dv(dv4), dq(dq4);
  at::parallel_for(0, dims.batch * dims.heads_kv * num_kblocks, 1, [&](int64_t begin, int64_t end) {
    ScoreTiles<acc_t> tiles(D, Dv);
    std::vector<acc_t> dk_acc(kKeyBlock * D), dv_acc(kKeyBlock * Dv);
    std::vector<acc_t> transposed(kKeyBlock * kQueryBlock);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t bh_kv = item / num_kblocks;
      const int64_t k0 = balanced_block(item % num_kblocks, num_kblocks) * kKeyBlock;
      key_block_gradients(pb, dk, dv, bh_kv / dims.heads_kv, bh_kv % dims.heads_kv, k0, tiles,
                          dk_acc, dv_acc, transposed);
    }
    block_gemm_release();
  });

  const int64_t num_qblocks = ceil_div(dims.len_q, kQueryBlock);
  at::parallel_for(0, num_heads * num_qblocks, 1, [&](int64_t begin, int64_t end) {
    ScoreTiles<acc_t> tiles(D, Dv);
    std::vector<acc_t> k_tile(kKeyBlock * D), dq_acc(kQueryBlock * D);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t bh = item / num_qblocks;
      const int64_t q0 = balanced_block(item % num_qblocks, num_qblocks) * kQueryBlock;
      query_block_gradient(pb, dq, bh / dims.heads_q, bh % dims.heads_q, q0, tiles, k_tile, dq_acc);
    }
    block_gemm_release();
  });
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_backward_cpu(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& lse, double scale) {
  detail::check_backward_inputs(grad_out, q, k, v, out, lse, scale);
  const at::Tensor q4 = as_batch_heads_rows(q), k4 = as_batch_heads_rows(k),
                   v4 = as_batch_heads_rows(v);
  const at::Tensor out4 = as_batch_heads_rows(out), grad_out4 = as_batch_heads_rows(grad_out);
  const at::Tensor lse3 = lse.reshape({q4.size(0), q4.size(1), q4.size(2)});
  at::Tensor dq = at::empty(q4.sizes(), q.options());
  at::Tensor dk = at::empty(k4.sizes(), k.options());
  at::Tensor dv = at::empty(v4.sizes(), v.options());
  if (dq.numel() > 0 || dk.numel() > 0 || dv.numel() > 0) {
    AT_DISPATCH_FLOATING_TYPES_AND2(
        at::kBFloat16, at::kHalf, q.scalar_type(), "causal_attention_backward_cpu",
        [&] { backward_kernel<scalar_t>(grad_out4, q4, k4, v4, out4, lse3, scale, dq, dk, dv); });
  }
  return {dq.view_symint(q.sym_sizes()), dk.view_symint(k.sym_sizes()),
          dv.view_symint(v.sym_sizes())};
}

}  // namespace
}  // namespace causal_attention::cpu

TORCH_LIBRARY_IMPL(causal_attention, CPU, m) {
  m.impl("attention_backward", causal_attention::cpu::attention_backward_cpu);
}
