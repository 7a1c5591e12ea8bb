// CPU backward, FlashAttention-2 style: P is recomputed block by block from the saved lse, never
// stored. To keep every gradient element owned by exactly one task (bitwise identical results
// at any thread count, no atomics, no per-thread partial sums), it runs two passes:
//   1. tasks own a (batch, kv head, key block) and accumulate dK_j, dV_j over the query rows of
//      every query head in the group that see those keys;
//   2. tasks own a (batch, query head, query block) and accumulate dQ_i over its visible keys.
// Pass 2 recomputes S and dP once more: 7 block products instead of 5, the price of determinism
// without O(L^2) or O(threads * L * D) buffers.
//
// delta is usually rowsum(dO * O); but for bfloat16/float16 O was rounded to 8 or 11 bits, and
// that rounding error would reach every dS = P * (dP - delta), hence dQ and dK, most visibly
// where a row sees few keys. There pass 2 runs first and computes delta exactly as
// sum_j P_ij dP_ij in float32, using dQ_i = scale * (sum_j P_ij dP_ij K_j - delta_i sum_j P_ij K_j)
// so that it needs delta only at the end (one more block product); pass 1 then uses that delta.
#include "kernel_api.h"
#include "tile_ops.h"

#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include <vector>

namespace causal_attention::cpu::CPU_CAPABILITY {
namespace {

template <typename scalar_t, typename gemm_t>
class BackwardKernel {
  using acc_t = at::opmath_type<scalar_t>;
  using Ops = Operands<gemm_t>;
  // float32/float64 outputs are exact enough for delta = rowsum(dO * O); see the file comment.
  static constexpr bool kDeltaFromOutput = std::is_same_v<scalar_t, acc_t>;

 public:
  explicit BackwardKernel(const BackwardTensors& t)
      : dims_(t.q, t.k, t.v),
        q_(t.q),
        k_(t.k),
        v_(t.v),
        out_(t.out),
        grad_out_(t.grad_out),
        dq_(t.dq),
        dk_(t.dk),
        dv_(t.dv),
        lse_(t.lse.data_ptr<acc_t>()),
        scale_(static_cast<acc_t>(t.scale)) {}

  void run() {
    if constexpr (kDeltaFromOutput) {
      compute_delta_from_output();
    } else {
      delta_.resize(dims_.batch * dims_.heads_q * dims_.len_q);
    }
    const auto make_scratch = [this] { return Scratch(dims_); };
    for_each_head_block(dims_.batch * dims_.heads_q, ceil_div(dims_.len_q, kQueryBlock),
                        make_scratch, [&](int64_t bh, int64_t block, Scratch& s) {
                          query_block_gradient(bh / dims_.heads_q, bh % dims_.heads_q,
                                               block * kQueryBlock, s);
                        });
    for_each_head_block(dims_.batch * dims_.heads_kv, ceil_div(dims_.len_k, kKeyBlock),
                        make_scratch, [&](int64_t bh_kv, int64_t block, Scratch& s) {
                          key_block_gradients(bh_kv / dims_.heads_kv, bh_kv % dims_.heads_kv,
                                              block * kKeyBlock, s);
                        });
  }

 private:
  // Per-task scratch: operand tiles, the P and dS tiles, and the gradient accumulators.
  struct Scratch {
    std::vector<gemm_t> q_tile, do_tile, k_tile, v_tile, k_rows, p_tile, ds_tile;
    std::vector<acc_t> p, ds, grad_a, grad_b, grad_c, row_sums;
    std::vector<int64_t> visible;  // keys of the current block each query row sees
    NonFiniteRowGuard<scalar_t> guard;
    explicit Scratch(const AttentionDims& d)
        : q_tile(Ops::scratch_size(kQueryBlock, d.head_dim)),
          do_tile(Ops::scratch_size(kQueryBlock, d.value_dim)),
          k_tile(Ops::scratch_size(kKeyBlock, d.head_dim)),
          v_tile(Ops::scratch_size(kKeyBlock, d.value_dim)),
          k_rows(Ops::scratch_size(kKeyBlock, d.head_dim)),
          p_tile(Ops::scratch_size(kQueryBlock, kKeyBlock)),
          ds_tile(Ops::scratch_size(kQueryBlock, kKeyBlock)),
          p(kQueryBlock * kKeyBlock),
          ds(kQueryBlock * kKeyBlock),
          grad_a(std::max(kQueryBlock, kKeyBlock) * d.head_dim),
          grad_b(kKeyBlock * d.value_dim),
          grad_c(kDeltaFromOutput ? 0 : kQueryBlock * d.head_dim),
          row_sums(kQueryBlock),
          visible(kQueryBlock) {}
  };

  // delta = rowsum(dO * O) in acc_t, one value per query row: O(Lq) memory.
  void compute_delta_from_output() {
    const int64_t num_heads = dims_.batch * dims_.heads_q;
    delta_.resize(num_heads * dims_.len_q);
    at::parallel_for(0, num_heads, 1, [&](int64_t begin, int64_t end) {
      for (int64_t bh = begin; bh < end; ++bh) {
        const int64_t b = bh / dims_.heads_q, h = bh % dims_.heads_q;
        for (int64_t r = 0; r < dims_.len_q; ++r) {
          delta_[bh * dims_.len_q + r] =
              dot_row<acc_t>(out_.row(b, h, r), grad_out_.row(b, h, r), dims_.value_dim);
        }
      }
    });
  }

  // The (rows x cols) tiles P = exp(S * scale - lse) and dS = P * (dO V^T - delta) for query
  // rows [q0, q0 + rows) of head (b, h) against the keys whose transposed operands are k_t, v_t
  // (without delta, dS = P * dO V^T). Entries a row may not see, and rows with no visible key,
  // are zero.
  void score_tiles(int64_t bh, const gemm_t* q_rows, int64_t ldq, const gemm_t* do_rows,
                   int64_t ld_do, const gemm_t* k_t, int64_t ldk, const gemm_t* v_t, int64_t ldv,
                   int64_t q0, int64_t rows, int64_t k0, int64_t cols, bool with_delta,
                   Scratch& s) const {
    block_gemm(rows, cols, Ops::padded_k(dims_.head_dim), q_rows, ldq, k_t, ldk, s.p.data(), cols,
               /*accumulate=*/false);
    block_gemm(rows, cols, Ops::padded_k(dims_.value_dim), do_rows, ld_do, v_t, ldv, s.ds.data(),
               cols, /*accumulate=*/false);
    const acc_t* lse = lse_ + bh * dims_.len_q + q0;
    const acc_t* delta = delta_.data() + bh * dims_.len_q + q0;
    for (int64_t r = 0; r < rows; ++r) {
      acc_t* p = s.p.data() + r * cols;
      acc_t* ds = s.ds.data() + r * cols;
      const bool empty_row = lse[r] == -std::numeric_limits<acc_t>::infinity();
      const int64_t visible =
          empty_row ? 0 : std::clamp<int64_t>(dims_.visible_keys(q0 + r) - k0, 0, cols);
      s.visible[r] = visible;
      exp_and_sum(p, visible, cols, scale_, lse[r]);
      // Only over the visible keys: a NaN delta (poisoned row) must not reach masked entries.
      softmax_gradient(p, ds, visible, with_delta ? delta[r] : acc_t(0));
      std::fill(ds + visible, ds + cols, acc_t(0));
    }
  }

  // Pass 1: dK and dV of one key block, summed over every query row (of every query head in the
  // group) that sees it, in a fixed order.
  void key_block_gradients(int64_t b, int64_t h_kv, int64_t k0, Scratch& s) const {
    const int64_t D = dims_.head_dim, Dv = dims_.value_dim;
    const int64_t cols = std::min(kKeyBlock, dims_.len_k - k0);
    int64_t ldk = 0, ldv = 0;
    const gemm_t* k_t =
        Ops::b_transposed(k_.row(b, h_kv, k0), cols, D, k_.row_stride, s.k_tile.data(), &ldk);
    const gemm_t* v_t =
        Ops::b_transposed(v_.row(b, h_kv, k0), cols, Dv, v_.row_stride, s.v_tile.data(), &ldv);
    acc_t* dk = s.grad_a.data();
    acc_t* dv = s.grad_b.data();
    std::fill_n(dk, cols * D, acc_t(0));
    std::fill_n(dv, cols * Dv, acc_t(0));
    const int64_t first_q0 = dims_.first_row_seeing(k0) / kQueryBlock * kQueryBlock;
    for (int64_t g = 0; g < dims_.group(); ++g) {
      const int64_t h = h_kv * dims_.group() + g;
      for (int64_t q0 = first_q0; q0 < dims_.len_q; q0 += kQueryBlock) {
        const int64_t rows = std::min(kQueryBlock, dims_.len_q - q0);
        int64_t ldq = 0, ld_do = 0, ld_pt = 0, ld_dst = 0, ldq_b = 0, ld_do_b = 0;
        const gemm_t* q_rows =
            Ops::a(q_.row(b, h, q0), rows, D, q_.row_stride, s.q_tile.data(), &ldq);
        const gemm_t* do_rows = Ops::a(grad_out_.row(b, h, q0), rows, Dv, grad_out_.row_stride,
                                       s.do_tile.data(), &ld_do);
        score_tiles(b * dims_.heads_q + h, q_rows, ldq, do_rows, ld_do, k_t, ldk, v_t, ldv, q0,
                    rows, k0, cols, /*with_delta=*/true, s);
        // dV_j += P^T dO_i and dK_j += dS^T Q_i; the B operands reuse the row tiles' scratch.
        const bool has_masked_entries = s.visible[0] < cols;
        const gemm_t* p_t =
            Ops::a_transposed(s.p.data(), rows, cols, cols, s.p_tile.data(), &ld_pt);
        const gemm_t* ds_t =
            Ops::a_transposed(s.ds.data(), rows, cols, cols, s.ds_tile.data(), &ld_dst);
        const scalar_t* do_block = grad_out_.row(b, h, q0);
        int64_t ld_source = 0;
        const scalar_t* do_source = s.guard.prepare(has_masked_entries, do_block, rows, Dv,
                                                    grad_out_.row_stride, &ld_source);
        const gemm_t* do_b = Ops::b(do_source, rows, Dv, ld_source, s.do_tile.data(), &ld_do_b);
        block_gemm(cols, Dv, Ops::padded_k(rows), p_t, ld_pt, do_b, ld_do_b, dv, Dv,
                   /*accumulate=*/true);
        s.guard.add_back_transposed(s.p.data(), cols, do_block, grad_out_.row_stride, Dv,
                                    s.visible.data(), dv, Dv);
        const scalar_t* q_block = q_.row(b, h, q0);
        const scalar_t* q_source =
            s.guard.prepare(has_masked_entries, q_block, rows, D, q_.row_stride, &ld_source);
        const gemm_t* q_b = Ops::b(q_source, rows, D, ld_source, s.q_tile.data(), &ldq_b);
        block_gemm(cols, D, Ops::padded_k(rows), ds_t, ld_dst, q_b, ldq_b, dk, D,
                   /*accumulate=*/true);
        s.guard.add_back_transposed(s.ds.data(), cols, q_block, q_.row_stride, D, s.visible.data(),
                                    dk, D);
      }
    }
    for (int64_t c = 0; c < cols; ++c) {
      store_scaled_row(dk + c * D, D, scale_, dk_.row(b, h_kv, k0 + c));
      store_scaled_row(dv + c * Dv, Dv, acc_t(1), dv_.row(b, h_kv, k0 + c));
    }
  }

  // Pass 2: dQ of one query block, summed over its visible key blocks in order (and, for
  // bfloat16/float16, the block's exact delta; see the file comment).
  void query_block_gradient(int64_t b, int64_t h, int64_t q0, Scratch& s) {
    const int64_t D = dims_.head_dim, Dv = dims_.value_dim;
    const int64_t h_kv = h / dims_.group();
    const int64_t bh = b * dims_.heads_q + h;
    const int64_t rows = std::min(kQueryBlock, dims_.len_q - q0);
    const int64_t key_end = dims_.visible_keys(q0 + rows - 1);
    int64_t ldq = 0, ld_do = 0;
    const gemm_t* q_rows = Ops::a(q_.row(b, h, q0), rows, D, q_.row_stride, s.q_tile.data(), &ldq);
    const gemm_t* do_rows =
        Ops::a(grad_out_.row(b, h, q0), rows, Dv, grad_out_.row_stride, s.do_tile.data(), &ld_do);
    acc_t* dq = s.grad_a.data();         // sum_j dS_ij K_j, or sum_j P_ij dP_ij K_j
    acc_t* p_times_k = s.grad_c.data();  // sum_j P_ij K_j (exact-delta form only)
    acc_t* delta = s.row_sums.data();    // sum_j P_ij dP_ij (exact-delta form only)
    std::fill_n(dq, rows * D, acc_t(0));
    if constexpr (!kDeltaFromOutput) {
      std::fill_n(p_times_k, rows * D, acc_t(0));
      std::fill_n(delta, rows, acc_t(0));
    }
    for (int64_t k0 = 0; k0 < key_end; k0 += kKeyBlock) {
      const int64_t cols = std::min(kKeyBlock, key_end - k0);
      int64_t ldk = 0, ldv = 0, ld_ds = 0, ldk_b = 0;
      const gemm_t* k_t =
          Ops::b_transposed(k_.row(b, h_kv, k0), cols, D, k_.row_stride, s.k_tile.data(), &ldk);
      const gemm_t* v_t =
          Ops::b_transposed(v_.row(b, h_kv, k0), cols, Dv, v_.row_stride, s.v_tile.data(), &ldv);
      score_tiles(bh, q_rows, ldq, do_rows, ld_do, k_t, ldk, v_t, ldv, q0, rows, k0, cols,
                  /*with_delta=*/kDeltaFromOutput, s);
      const scalar_t* k_block = k_.row(b, h_kv, k0);
      int64_t ld_source = 0;
      const scalar_t* k_source =
          s.guard.prepare(s.visible[0] < cols, k_block, cols, D, k_.row_stride, &ld_source);
      const gemm_t* k_b = Ops::b(k_source, cols, D, ld_source, s.k_rows.data(), &ldk_b);
      const gemm_t* ds = Ops::a(s.ds.data(), rows, cols, cols, s.ds_tile.data(), &ld_ds);
      block_gemm(rows, D, Ops::padded_k(cols), ds, ld_ds, k_b, ldk_b, dq, D, /*accumulate=*/true);
      s.guard.add_back(s.ds.data(), cols, rows, k_block, k_.row_stride, D, s.visible.data(), dq, D);
      if constexpr (!kDeltaFromOutput) {
        int64_t ld_p = 0;
        const gemm_t* p = Ops::a(s.p.data(), rows, cols, cols, s.p_tile.data(), &ld_p);
        block_gemm(rows, D, Ops::padded_k(cols), p, ld_p, k_b, ldk_b, p_times_k, D,
                   /*accumulate=*/true);
        s.guard.add_back(s.p.data(), cols, rows, k_block, k_.row_stride, D, s.visible.data(),
                         p_times_k, D);
        for (int64_t r = 0; r < rows; ++r) {
          delta[r] += row_sum(s.ds.data() + r * cols, cols);
        }
      }
    }
    for (int64_t r = 0; r < rows; ++r) {
      if constexpr (!kDeltaFromOutput) {
        delta_[bh * dims_.len_q + q0 + r] = delta[r];
        subtract_scaled_row(dq + r * D, p_times_k + r * D, D, delta[r]);
      }
      store_scaled_row(dq + r * D, D, scale_, dq_.row(b, h, q0 + r));
    }
  }

  const AttentionDims dims_;
  const HeadRows<const scalar_t> q_, k_, v_, out_, grad_out_;
  const HeadRows<scalar_t> dq_, dk_, dv_;
  const acc_t* const lse_;
  const acc_t scale_;
  std::vector<acc_t> delta_;
};

}  // namespace

void backward_kernel(const BackwardTensors& tensors) {
  run_for_dtype<BackwardKernel>(tensors);
}

}  // namespace causal_attention::cpu::CPU_CAPABILITY
