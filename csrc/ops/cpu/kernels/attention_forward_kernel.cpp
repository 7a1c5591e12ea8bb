// CPU forward: few query rows against a long cache take the decode path (decode.h), the others
// the block path (block_forward.h), both on K/V rows read from the call's tensors.
#include "block_forward.h"
#include "decode.h"
#include "dtype_dispatch.h"
#include "geometry.h"
#include "kernel_api.h"
#include "schedule.h"
#include "split_combine.h"

#include <ATen/OpMathType.h>

namespace causal_attention::cpu::CPU_CAPABILITY {
namespace {

template <typename scalar_t, typename gemm_t>
class ForwardKernel {
  using acc_t = at::opmath_type<scalar_t>;

 public:
  explicit ForwardKernel(const ForwardTensors& t)
      : dims_(t),
        q_(t.q, dims_.cu_q),
        k_(t.k, dims_.cu_k),
        v_(t.v, dims_.cu_k),
        modifiers_(t),
        output_{HeadRows<scalar_t>(t.out, dims_.cu_q), HeadRows<acc_t>(t.lse, dims_.cu_q),
                dims_.heads_q, dims_.value_dim, modifiers_} {}

  void run() const {
    if (forward_decodes(dims_)) {
      DecodeForward<scalar_t>(dims_, q_, k_, v_, output_, modifiers_).run();
    } else {
      BlockForward<scalar_t, gemm_t>(dims_, q_, k_, v_, output_, modifiers_).run();
    }
  }

 private:
  const AttentionDims dims_;
  const HeadRows<const scalar_t> q_, k_, v_;
  const ScoreModifiers<acc_t> modifiers_;
  const OutputRows<scalar_t, acc_t> output_;
};

void forward_kernel_impl(const ForwardTensors& tensors) {
  run_for_dtype<ForwardKernel>(tensors);
}

}  // namespace

CAUSAL_ATTENTION_REGISTER_KERNEL(forward_kernel, forward_kernel_impl);

}  // namespace causal_attention::cpu::CPU_CAPABILITY
