// Autocast for the ops, as torchvision registers its ops' autocast kernels. Inside an autocast
// region q, k and v are cast to the region's dtype with torch's own policy for
// scaled_dot_product_attention ("lower_precision_fp": floating CPU/CUDA tensors other than
// float64 are cast, float64 ones left alone), then the op is redispatched below autocast, so
// autograd sees the casts and float32 leaves get float32 gradients. Only q, k and v are cast: the
// key mask stays boolean, the cumulative lengths int32, and float32 sinks and ALiBi slopes suit q
// in any dtype. The backward op needs no kernel here: autograd runs it in the dtypes the forward
// chose.
#include "../schema_adapters.h"

#include <ATen/autocast_mode.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/library.h>

namespace causal_attention {
namespace {

// One kernel for every op: `Call` is the op's struct (op_arguments.h), `redispatch` calls the op.
template <c10::DeviceType device, typename Call, auto redispatch>
auto autocast(const Call& call) {
  const c10::impl::ExcludeDispatchKeyGuard below_autocast{
      at::autocast::get_autocast_dispatch_key_from_device_type(device)};
  const at::ScalarType dtype = at::autocast::get_autocast_dtype(device);
  Call cast = call;
  for (at::Tensor* t : {&cast.q, &cast.k, &cast.v}) {
    *t = at::autocast::cached_cast(dtype, *t, device);
  }
  return redispatch(cast);
}

template <c10::DeviceType device>
constexpr auto attention_autocast = autocast<device, detail::AttentionCall, detail::call_attention>;
template <c10::DeviceType device>
constexpr auto forward_autocast =
    autocast<device, detail::ForwardCall, detail::call_attention_forward>;

}  // namespace

#define CAUSAL_ATTENTION_AUTOCAST_KERNELS(key, device)                                            \
  TORCH_LIBRARY_IMPL(causal_attention, key, m) {                                                  \
    m.impl("attention", detail::attention_from_schema<attention_autocast<device>>);               \
    m.impl("varlen_attention", detail::varlen_attention_from_schema<attention_autocast<device>>); \
    m.impl("attention_forward", detail::forward_from_schema<forward_autocast<device>>);           \
  }
CAUSAL_ATTENTION_AUTOCAST_KERNELS(AutocastCPU, c10::DeviceType::CPU)
// Ready for the CUDA kernels (ops/cuda/): registered now, they cast for them once they exist.
CAUSAL_ATTENTION_AUTOCAST_KERNELS(AutocastCUDA, c10::DeviceType::CUDA)
#undef CAUSAL_ATTENTION_AUTOCAST_KERNELS

}  // namespace causal_attention
