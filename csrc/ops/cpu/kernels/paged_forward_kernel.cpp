// CPU forward of a paged KV cache (paged_attention): every sequence's query rows, decode rows and
// prefill chunks alike, go through the decode path (decode.h) with K and V rows read in place
// from their pages (PagedRows): no gather and no copy of the cache, and key splits over long
// caches as for a contiguous one. The path carries a (batch, KV head)'s query rows through the
// keys together, its scratch sized by those rows, never by the cache.
#include "decode.h"
#include "dtype_dispatch.h"
#include "geometry.h"
#include "kernel_api.h"
#include "score_modifiers.h"
#include "split_combine.h"

#include <ATen/OpMathType.h>

namespace causal_attention::cpu::CPU_CAPABILITY {
namespace {

// gemm_t is unused: the decode path multiplies in registers, in the accumulation dtype.
template <typename scalar_t, typename gemm_t>
class PagedForwardKernel {
  using acc_t = at::opmath_type<scalar_t>;

 public:
  explicit PagedForwardKernel(const PagedForwardTensors& t)
      : dims_(t),
        q_(t.q, dims_.cu_q),
        k_(t.k, t.block_table),
        v_(t.v, t.block_table),
        modifiers_(t),
        output_{HeadRows<scalar_t>(t.out, dims_.cu_q), HeadRows<acc_t>(t.lse, dims_.cu_q),
                dims_.heads_q, dims_.value_dim, modifiers_} {}

  void run() const {
    DecodeForward<scalar_t, PagedRows<const scalar_t>>(dims_, q_, k_, v_, output_, modifiers_)
        .run();
  }

 private:
  const AttentionDims dims_;
  const HeadRows<const scalar_t> q_;
  const PagedRows<const scalar_t> k_, v_;
  const ScoreModifiers<acc_t> modifiers_;
  const OutputRows<scalar_t, acc_t> output_;
};

void paged_forward_kernel_impl(const PagedForwardTensors& tensors) {
  run_for_dtype<PagedForwardKernel>(tensors);
}

}  // namespace

CAUSAL_ATTENTION_REGISTER_KERNEL(paged_forward_kernel, paged_forward_kernel_impl);

}  // namespace causal_attention::cpu::CPU_CAPABILITY
