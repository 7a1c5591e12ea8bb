// Autocast for the ops, as torchvision registers its ops' autocast kernels. Inside an autocast
// region q, k and v are cast to the region's dtype with torch's own policy for
// scaled_dot_product_attention ("lower_precision_fp": floating CPU/CUDA tensors other than
// float64 are cast, float64 ones left alone), then the op is redispatched below autocast, so
// autograd sees the casts and float32 leaves get float32 gradients. The key mask stays boolean and
// the cumulative lengths int32: only q, k and v are cast. The backward ops need no kernel here:
// autograd runs them in the dtypes the forward chose.
#include "causal_attention/ops.h"

#include <ATen/autocast_mode.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/library.h>

namespace causal_attention {
namespace {

// Casts what autocast casts for SDPA, with autocast off for the call that follows.
template <c10::DeviceType device>
struct AutocastInputs {
  c10::impl::ExcludeDispatchKeyGuard below_autocast{
      at::autocast::get_autocast_dispatch_key_from_device_type(device)};
  const at::ScalarType dtype = at::autocast::get_autocast_dtype(device);

  at::Tensor cast(const at::Tensor& t) const { return at::autocast::cached_cast(dtype, t, device); }
};

// Sinks and ALiBi slopes are left as they are: float32 ones suit q in any dtype.
template <c10::DeviceType device>
at::Tensor attention_autocast(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                              std::optional<double> scale,
                              const std::optional<at::Tensor>& key_mask, at::IntArrayRef window,
                              std::optional<double> softcap,
                              const std::optional<at::Tensor>& alibi_slopes,
                              const std::optional<at::Tensor>& sinks, double dropout_p,
                              std::optional<at::Generator> generator) {
  const AutocastInputs<device> in;
  return attention(in.cast(q), in.cast(k), in.cast(v), scale, key_mask, window, softcap,
                   alibi_slopes, sinks, dropout_p, std::move(generator));
}

template <c10::DeviceType device>
std::tuple<at::Tensor, at::Tensor> attention_forward_autocast(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale,
    const std::optional<at::Tensor>& key_mask, at::IntArrayRef window,
    std::optional<double> softcap, const std::optional<at::Tensor>& alibi_slopes,
    const std::optional<at::Tensor>& sinks, double dropout_p,
    const std::optional<at::Tensor>& dropout_seed) {
  const AutocastInputs<device> in;
  return attention_forward(in.cast(q), in.cast(k), in.cast(v), scale, key_mask, window, softcap,
                           alibi_slopes, sinks, dropout_p, dropout_seed);
}

template <c10::DeviceType device>
at::Tensor varlen_attention_autocast(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                     const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k,
                                     c10::SymInt max_seqlen_q, c10::SymInt max_seqlen_k,
                                     std::optional<double> scale, at::IntArrayRef window,
                                     std::optional<double> softcap,
                                     const std::optional<at::Tensor>& alibi_slopes,
                                     const std::optional<at::Tensor>& sinks, double dropout_p,
                                     std::optional<at::Generator> generator) {
  const AutocastInputs<device> in;
  return varlen_attention(in.cast(q), in.cast(k), in.cast(v), cu_seqlens_q, cu_seqlens_k,
                          std::move(max_seqlen_q), std::move(max_seqlen_k), scale, window, softcap,
                          alibi_slopes, sinks, dropout_p, std::move(generator));
}

template <c10::DeviceType device>
std::tuple<at::Tensor, at::Tensor> varlen_attention_forward_autocast(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cu_seqlens_q,
    const at::Tensor& cu_seqlens_k, c10::SymInt max_seqlen_q, c10::SymInt max_seqlen_k,
    double scale, at::IntArrayRef window, std::optional<double> softcap,
    const std::optional<at::Tensor>& alibi_slopes, const std::optional<at::Tensor>& sinks,
    double dropout_p, const std::optional<at::Tensor>& dropout_seed) {
  const AutocastInputs<device> in;
  return varlen_attention_forward(in.cast(q), in.cast(k), in.cast(v), cu_seqlens_q, cu_seqlens_k,
                                  std::move(max_seqlen_q), std::move(max_seqlen_k), scale, window,
                                  softcap, alibi_slopes, sinks, dropout_p, dropout_seed);
}

}  // namespace

#define CAUSAL_ATTENTION_AUTOCAST_KERNELS(key, device)                             \
  TORCH_LIBRARY_IMPL(causal_attention, key, m) {                                   \
    m.impl("attention", attention_autocast<device>);                               \
    m.impl("attention_forward", attention_forward_autocast<device>);               \
    m.impl("varlen_attention", varlen_attention_autocast<device>);                 \
    m.impl("varlen_attention_forward", varlen_attention_forward_autocast<device>); \
  }
CAUSAL_ATTENTION_AUTOCAST_KERNELS(AutocastCPU, c10::DeviceType::CPU)
// Ready for the CUDA kernels (ops/cuda/): registered now, they cast for them once they exist.
CAUSAL_ATTENTION_AUTOCAST_KERNELS(AutocastCUDA, c10::DeviceType::CUDA)
#undef CAUSAL_ATTENTION_AUTOCAST_KERNELS

}  // namespace causal_attention
