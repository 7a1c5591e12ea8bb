// The options of the ops, as one builder in libtorch's style:
//
//   causal_attention::attention(q, k, v, AttentionOptions().window({4095, 0}).softcap(50.0));
//
// Each option has the name of the Python keyword argument and defaults to off; ops.h says what
// each one does. CausalSelfAttentionOptions (nn.h) takes its window in the same Window type.
#pragma once

#include <ATen/core/Generator.h>
#include <ATen/core/Tensor.h>
#include <torch/arg.h>

#include <array>
#include <cstdint>
#include <optional>

namespace causal_attention {

// (left, right): query row i sees key j iff i + off - left <= j <= i + off + right, off = Lk - Lq,
// -1 unbounded on that side. {-1, 0} is causal attention.
using Window = std::array<int64_t, 2>;

struct AttentionOptions {
  // Multiplies q k^T; nullopt: 1/sqrt(D).
  TORCH_ARG(std::optional<double>, scale) = std::nullopt;
  // bool (*batch, Lk), true where a key may be attended. Dense calls only.
  TORCH_ARG(std::optional<at::Tensor>, key_mask) = std::nullopt;
  // SDPA's attn_mask, broadcastable to the scores (*batch, Hq, Lq, Lk): bool (true where a query
  // row may attend a key) or floating (float32 or q's dtype, added to the scores; -inf hides).
  // It narrows what the window and key mask let a row see. Dense calls only.
  TORCH_ARG(std::optional<at::Tensor>, attn_mask) = std::nullopt;
  TORCH_ARG(Window, window) = Window { -1, 0 };
  TORCH_ARG(std::optional<double>, softcap) = std::nullopt;
  TORCH_ARG(std::optional<at::Tensor>, alibi_slopes) = std::nullopt;
  TORCH_ARG(std::optional<at::Tensor>, sinks) = std::nullopt;
  TORCH_ARG(double, dropout_p) = 0.0;
  // Where the differentiable ops draw dropout's (seed, offset) from; the kernel ops take the
  // seed itself instead.
  TORCH_ARG(std::optional<at::Generator>, generator) = std::nullopt;
};

}  // namespace causal_attention
