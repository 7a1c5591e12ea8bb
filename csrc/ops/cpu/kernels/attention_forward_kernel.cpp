// CPU forward, FlashAttention-2 style: K (and V where it needs packing) is packed once per call
// (packed_kv.h); then one task owns a (batch, query head, query block, key split) and walks its
// visible key blocks in order with an online softmax (online_softmax.h). Nothing of size
// Lq x Lk is ever allocated. Few query rows against a long cache take the decode path (decode.h).
#include "decode.h"
#include "dispatch.h"
#include "geometry.h"
#include "kernel_api.h"
#include "non_finite_guard.h"
#include "online_softmax.h"
#include "operands.h"
#include "packed_kv.h"
#include "schedule.h"
#include "split_combine.h"

#include <ATen/OpMathType.h>

#include <vector>

namespace causal_attention::cpu::CPU_CAPABILITY {
namespace {

template <typename scalar_t, typename gemm_t>
class ForwardKernel {
  using acc_t = at::opmath_type<scalar_t>;
  using Pack = Packing<gemm_t>;
  using Packed = PackedKeyValues<scalar_t, gemm_t>;

 public:
  explicit ForwardKernel(const ForwardTensors& t)
      : dims_(t.q, t.k, t.v),
        blocks_(block_sizes(dims_.head_dim, dims_.value_dim)),
        q_(t.q),
        k_(t.k),
        v_(t.v),
        output_{HeadRows<scalar_t>(t.out), t.lse.data_ptr<acc_t>(), dims_.heads_q, dims_.len_q,
                dims_.value_dim},
        scale_(static_cast<acc_t>(t.scale)) {}

  void run() {
    if (dims_.len_q <= kMaxDecodeQueryRows) {
      DecodeForward<scalar_t>(dims_, q_, k_, v_, output_, scale_).run();
      return;
    }
    const int64_t num_heads = dims_.batch * dims_.heads_q;
    const int64_t num_qblocks = ceil_div(dims_.len_q, blocks_.query_rows);
    KeySplits<scalar_t, acc_t> splits(
        dims_, key_splits(dims_, num_heads * num_qblocks, sizeof(scalar_t)), output_);
    const Packed packed(dims_, k_, v_, blocks_.keys,
                        ceil_div(dims_.key_end(dims_.len_q - 1), blocks_.keys));
    const int64_t per_head = num_qblocks * splits.count();
    for_each_head_block(
        num_heads, per_head, [this] { return Scratch(dims_, blocks_); },
        [&](int64_t bh, int64_t block, Scratch& s) {
          query_block(bh, block / splits.count() * blocks_.query_rows, block % splits.count(),
                      packed, splits, s);
        });
    splits.merge();
  }

 private:
  struct Scratch {
    std::vector<gemm_t> q_tile, p_tile, v_tile;
    std::vector<acc_t> scores;
    std::vector<int64_t> visible;  // keys of the current block each row sees
    NonFiniteRowGuard<scalar_t> v_guard;
    RowState<acc_t> state;
    Scratch(const AttentionDims& d, const BlockSizes& blocks)
        : q_tile(Pack::scratch_size(blocks.query_rows, d.head_dim)),
          p_tile(Pack::scratch_size(blocks.query_rows, blocks.keys)),
          v_tile(Pack::scratch_size(blocks.keys, d.value_dim)),
          scores(blocks.query_rows * blocks.keys),
          visible(blocks.query_rows),
          state(blocks.query_rows, d.value_dim) {}
  };

  // Query rows [q0, q0 + rows) of head bh against the keys of chunk `split`.
  void query_block(int64_t bh, int64_t q0, int64_t split, const Packed& packed,
                   KeySplits<scalar_t, acc_t>& splits, Scratch& s) const {
    const int64_t b = bh / dims_.heads_q, h_kv = bh % dims_.heads_q / dims_.group();
    const int64_t rows = std::min(blocks_.query_rows, dims_.len_q - q0);
    const auto [key_begin, key_end] = splits.key_range(split, dims_.key_end(q0 + rows - 1));
    s.state.reset(rows);
    const Operand<gemm_t> q_rows = Pack::a(q_.row(b, bh % dims_.heads_q, q0), rows, dims_.head_dim,
                                           q_.row_stride, s.q_tile.data());
    for (int64_t k0 = key_begin; k0 < key_end; k0 += blocks_.keys) {
      const int64_t cols = std::min(blocks_.keys, key_end - k0);
      // S = Q_i K_j^T
      multiply(rows, cols, dims_.head_dim, q_rows, packed.keys_t(b, h_kv, k0), s.scores.data(),
               cols, /*accumulate=*/false);
      // m' = max(m, rowmax(S)); P = exp(S - m'); l = e^(m-m') l + rowsum(P); O = e^(m-m') O
      for (int64_t r = 0; r < rows; ++r) {
        s.visible[r] = dims_.visible_in_block(q0 + r, k0, cols);
        s.state.fold_row(s.scores.data() + r * cols, r, s.visible[r], cols, scale_);
      }
      // O += P V_j
      accumulate_values(b, h_kv, q0, rows, k0, cols, packed, s);
    }
    for (int64_t r = 0; r < rows; ++r) {
      splits.emit(s.state, r, bh, q0 + r, split);
    }
  }

  // O += P V_j, with P in s.scores; V_j is the packed block unless the guard cleaned it.
  void accumulate_values(int64_t b, int64_t h_kv, int64_t q0, int64_t rows, int64_t k0,
                         int64_t cols, const Packed& packed, Scratch& s) const {
    const Operand<gemm_t> p = Pack::a(s.scores.data(), rows, cols, cols, s.p_tile.data());
    const Operand<scalar_t> v_rows{v_.row(b, h_kv, k0), v_.row_stride};
    const auto pack_values = [&](Operand<scalar_t> source) {
      const Operand<gemm_t> prepacked = packed.values(b, h_kv, k0, cols);
      if (source.data == v_rows.data && prepacked.data != nullptr) {
        return prepacked;
      }
      return Pack::b(source.data, cols, dims_.value_dim, source.ld, s.v_tile.data());
    };
    s.v_guard.multiply_add(dims_.has_masked_entries(q0, rows, k0, cols), rows, dims_.value_dim,
                           cols, p,
                           MaskedFactor<acc_t>{s.scores.data(), cols, s.visible.data(),
                                               /*transposed=*/false},
                           v_rows, pack_values, s.state.out.data(), dims_.value_dim);
  }

  const AttentionDims dims_;
  const BlockSizes blocks_;
  const HeadRows<const scalar_t> q_, k_, v_;
  const OutputRows<scalar_t, acc_t> output_;
  const acc_t scale_;
};

}  // namespace

void forward_kernel(const ForwardTensors& tensors) {
  run_for_dtype<ForwardKernel>(tensors);
}

}  // namespace causal_attention::cpu::CPU_CAPABILITY
