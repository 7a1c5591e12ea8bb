// Calls causal_attention::attention through the installed public header and checks it against
// softmax(q k^T * scale, causal mask) v written out with ATen. Exits non-zero on a mismatch.
#include <causal_attention/ops.h>

#include <ATen/ops/allclose.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/matmul.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/softmax.h>

#include <cmath>
#include <iostream>
#include <limits>

namespace {

// Deterministic inputs of that shape, no random generator needed.
at::Tensor inputs(at::IntArrayRef shape, double phase) {
  int64_t numel = 1;
  for (const int64_t size : shape) numel *= size;
  return at::arange(numel, at::kDouble).mul(0.37).add(phase).sin().reshape(shape);
}

}  // namespace

int main() {
  // Two heads, fewer queries than keys: query row i sees keys j <= i + (Lk - Lq).
  const int64_t heads = 2, len_q = 3, len_k = 5, dim = 4;
  const at::Tensor q = inputs({heads, len_q, dim}, 0.0);
  const at::Tensor k = inputs({heads, len_k, dim}, 1.0);
  const at::Tensor v = inputs({heads, len_k, dim}, 2.0);

  const at::Tensor out = causal_attention::attention(q, k, v);

  const double scale = 1.0 / std::sqrt(static_cast<double>(dim));
  const at::Tensor visible = at::ones({len_q, len_k}, at::kBool).tril(len_k - len_q);
  const at::Tensor scores =
      at::matmul(q, k.transpose(-2, -1))
          .mul(scale)
          .masked_fill(visible.logical_not(), -std::numeric_limits<double>::infinity());
  const at::Tensor expected = at::matmul(at::softmax(scores, -1), v);

  if (!at::allclose(out, expected, /*rtol=*/1e-12, /*atol=*/1e-12)) {
    std::cerr << "causal_attention::attention disagrees with the naive computation:\n"
              << out << "\nexpected\n"
              << expected << "\n";
    return 1;
  }
  // The installed options header: the same call with its scale set by name.
  const at::Tensor named =
      causal_attention::attention(q, k, v, causal_attention::AttentionOptions().scale(scale));
  if (!named.equal(out)) {
    std::cerr << "causal_attention::attention with AttentionOptions().scale(1/sqrt(D)) differs "
                 "from the default scale\n";
    return 1;
  }
  std::cout << "causal_attention::attention from the installed package matches the naive "
               "computation\n";
  return 0;
}
