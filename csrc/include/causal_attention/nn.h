// Public C++ modules of causal_attention: the multi-head CausalSelfAttention and its KV cache.
//
// The module keeps nanoGPT's parameter names and layout (c_attn: one Linear producing Q, K and V;
// c_proj: the output projection), as does the Python module causal_attention.CausalSelfAttention,
// so a state_dict moves between nanoGPT, Python and C++ unchanged; with the score options, the
// `sinks` parameter and the `alibi_slopes` buffer have the Python module's names too. Bad options
// or input raise c10::ValueError (shapes, sizes) or c10::TypeError (dtypes), naming the argument.
#pragma once

#include "causal_attention/options.h"

#include <ATen/core/Tensor.h>
#include <torch/arg.h>
#include <torch/nn/cloneable.h>
#include <torch/nn/modules/dropout.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/pimpl.h>

#include <cstdint>
#include <optional>
#include <tuple>

namespace causal_attention::nn {

// The scales of an 8-bit KVCache (stored value x scale = key or value). kToken: one per token
// and KV head for the keys and one for the values, float32 (B, Hkv, max_len) beside the storage
// (1 until written), each token's computed as it is written (its largest |x| over the head dim
// over the format's largest value): no calibration. kTensor: one for all the keys and one for all
// the values, given (calibrated beforehand); values beyond scale x the format's largest
// saturate. Python's KVCache(..., scales="token" | "tensor").
enum class ScaleLayout { kToken, kTensor };

// Preallocated keys (B, Hkv, max_len, D) and values (B, Hkv, max_len, Dv) for incremental
// decoding, the key mask (B, max_len) of the cached positions, and how many positions they hold.
// Made by CausalSelfAttention::make_cache.
//
// The key mask remembers, per sequence, which cached positions are real tokens (true) and which
// are padding (false), so that a left-padded prompt's padding stays hidden in every later
// decoding step. Until some append passes a key mask every position is real, and the cache hands
// out no mask, so the attention runs exactly as without one.
//
// 8-bit storage (float8_e4m3fn, float8_e5m2, int8: half a bfloat16 cache's bytes), inference
// only: append takes float32, bfloat16 or float16 keys and values (q's dtype) and stores them
// quantized (value / scale in float32, saturated to the format's finite range, rounded to
// nearest even; int8 symmetric in [-127, 127]), with the scales of a ScaleLayout; key_scales and
// value_scales are what paged_attention (ops.h) reads them with, as the module's forward does.
// The same values as Python's KVCache for the same input.
class KVCache {
 public:
  // Takes the storage; both must be 4-D with equal (B, Hkv, max_len), dtype and device. The key
  // mask storage is allocated here. An 8-bit storage takes `scales` (default kToken) and, with
  // kTensor, k_scale and v_scale (default 1; positive and finite in float32): c10::ValueError
  // otherwise, and for scales given with a float storage.
  KVCache(at::Tensor key_storage, at::Tensor value_storage,
          std::optional<ScaleLayout> scales = std::nullopt,
          std::optional<double> k_scale = std::nullopt,
          std::optional<double> v_scale = std::nullopt);

  int64_t length() const { return length_; }
  int64_t max_len() const { return key_storage_.size(2); }
  int64_t batch_size() const { return key_storage_.size(0); }

  // The cached positions: views (B, Hkv, length, D) and (B, Hkv, length, Dv) of the storage.
  at::Tensor keys() const;
  at::Tensor values() const;
  // The key mask of the cached positions, a bool view (B, length) of the storage (true for real
  // tokens), or nullopt while no append has passed one (every position is real).
  std::optional<at::Tensor> key_mask() const;

  // Whether the storage is 8-bit, and then its scales' layout.
  bool quantized() const { return scales_.has_value(); }
  std::optional<ScaleLayout> scales() const { return scales_; }
  // The cached keys' and values' dequantization scales: with kToken float32 views (B, Hkv,
  // length) of the scale storage, with kTensor 0-d float32 tensors; nullopt for float storage.
  std::optional<at::Tensor> key_scales() const;
  std::optional<at::Tensor> value_scales() const;

  // Forgets the cached positions and their key mask, keeping the storage, so that the cache can
  // serve a new sequence.
  void reset();

  // Writes keys (B, Hkv, L, D), values (B, Hkv, L, Dv) and their key_mask (bool (B, L), true for
  // real tokens; nullopt: all real) after the cached positions and returns all cached keys,
  // values and key mask (as key_mask() does), the new ones included: views of the storage, or
  // copies when autograd records (so that backward works through a decoded sequence, whose later
  // appends overwrite the storage in place). Throws, leaving the cache unchanged, if they do not
  // match the storage or would overflow max_len. An 8-bit cache stores them quantized and returns
  // its 8-bit views and no key mask; it throws c10::TypeError for keys and values not float32,
  // bfloat16 or float16 of one dtype, c10::ValueError for NaN or inf among them, and
  // c10::NotImplementedError for a key mask (the attention on 8-bit keys and values takes none).
  std::tuple<at::Tensor, at::Tensor, std::optional<at::Tensor>> append(
      const at::Tensor& keys, const at::Tensor& values,
      const std::optional<at::Tensor>& key_mask = std::nullopt);

 private:
  at::Tensor key_storage_;
  at::Tensor value_storage_;
  // Writes keys or values `added` (checked) after the cached positions of `storage`, quantized,
  // and with kToken their scales into scale_storage.
  void write_quantized(const at::Tensor& added, at::Tensor& storage, at::Tensor& scale_storage);

  at::Tensor mask_storage_;            // bool (B, max_len)
  std::optional<ScaleLayout> scales_;  // nullopt: float storage
  // kToken: float32 (B, Hkv, max_len); kTensor: float32 0-d; float storage: undefined
  at::Tensor key_scale_storage_, value_scale_storage_;
  int64_t length_ = 0;
  bool has_key_mask_ = false;  // whether an append since the last reset passed a key mask
};

// ALiBi's head slopes (Press et al.; BLOOM's build_alibi_tensor), float32 (num_heads,):
// 2^(-8 i / n) for i = 1..n when n is a power of two; otherwise those of the largest power of two
// c < n, then every other slope of 2 c heads (2^(-4 (2 i - 1) / c), i = 1..n - c). The same
// values as causal_attention.nn.alibi_slopes in Python.
at::Tensor alibi_slopes(int64_t num_heads);

struct CausalSelfAttentionOptions {
  using Window = causal_attention::Window;  // (left, right), as the op's (options.h)

  CausalSelfAttentionOptions(int64_t embed_dim, int64_t num_heads);

  // Width E of the input and output (B, L, E).
  TORCH_ARG(int64_t, embed_dim);
  // Query heads.
  TORCH_ARG(int64_t, num_heads);
  // Key/value heads, a divisor of num_heads (GQA; 1 is MQA). Default: num_heads.
  TORCH_ARG(std::optional<int64_t>, num_kv_heads) = std::nullopt;
  // Query/key width per head. Default: embed_dim / num_heads.
  TORCH_ARG(std::optional<int64_t>, head_dim) = std::nullopt;
  // Value width per head. Default: head_dim.
  TORCH_ARG(std::optional<int64_t>, value_head_dim) = std::nullopt;
  // Whether c_attn and c_proj have biases.
  TORCH_ARG(bool, bias) = true;
  // Dropout on the output projection in training (nanoGPT's resid_dropout).
  TORCH_ARG(double, dropout) = 0.0;
  // Dropout on the attention probabilities in training (nanoGPT's and GPT-2's attn_dropout), in
  // [0, 1); evaluation mode attends exactly. The op draws each call's mask from the default CPU
  // generator, so torch::manual_seed repeats it.
  TORCH_ARG(double, attn_dropout) = 0.0;
  // (left, right): position i attends position j iff i - left <= j <= i + right, -1 unbounded on
  // that side. The default {-1, 0} is causal; {W - 1, 0} a sliding window of W positions,
  // {-1, -1} bidirectional. With a KV cache, positions count from the first cached one, so
  // windows (and ALiBi) decode as the full sequence attends; a window that looks ahead
  // (right != 0) sees, when decoding, only the positions given so far.
  TORCH_ARG(Window, window) = { -1, 0 };
  // Caps the scores as softcap * tanh(S / softcap) (Gemma 2), > 0; nullopt: no cap.
  TORCH_ARG(std::optional<double>, softcap) = std::nullopt;
  // Learned attention sinks (gpt-oss): the parameter `sinks` (num_heads,) of logits, initialized
  // to 0, that join each row's softmax denominator, so that a row may attend to nothing.
  TORCH_ARG(bool, sinks) = false;
  // ALiBi: the scores get -slope_h * |i - j|, its slopes (alibi_slopes above) in the float32
  // buffer `alibi_slopes` (num_heads,), which to(dtype) leaves float32.
  TORCH_ARG(bool, alibi) = false;
};

// Multi-head causal self-attention, (B, L, E) -> (B, L, E), on causal_attention::attention.
class CausalSelfAttentionImpl : public torch::nn::Cloneable<CausalSelfAttentionImpl> {
 public:
  CausalSelfAttentionImpl(int64_t embed_dim, int64_t num_heads)
      : CausalSelfAttentionImpl(CausalSelfAttentionOptions(embed_dim, num_heads)) {}
  explicit CausalSelfAttentionImpl(const CausalSelfAttentionOptions& options);

  void reset() override;

  // As Module::to, but alibi_slopes stays float32 with its values: the op takes float32 slopes
  // only, and rounding them to half precision would move every score by up to
  // 2^-9 * slope * distance.
  using torch::nn::Cloneable<CausalSelfAttentionImpl>::to;
  void to(torch::Device device, torch::Dtype dtype, bool non_blocking = false) override;
  void to(torch::Dtype dtype, bool non_blocking = false) override;

  // With a cache, x holds the positions after the cached ones: their keys and values are
  // appended, and the queries attend to the whole cache (bottom-right alignment).
  //
  // key_mask, bool (B, L) for the L positions of x (true for real tokens, false for padding:
  // transformers' attention_mask as bool), hides the padding from every query. With a cache it
  // is stored next to the new keys, and every call attends with the mask of all cached
  // positions, so a left-padded prompt's padding stays hidden through prefill and every decoding
  // step; a call without one adds real positions. Outputs at padding positions are not
  // meaningful (a query that sees no key gives c_proj's bias). A bad key_mask throws
  // c10::TypeError (undefined, not bool) or c10::ValueError (shape, device) before the cache
  // changes.
  //
  // attn_mask, the op's (ops.h), broadcastable to (B, num_heads, L, cached + L), narrows what the
  // window and key mask let each query see (a document or prefix-LM mask, a learned bias, which
  // gets its gradient). It is not cached: each call gives its queries' mask against every key.
  at::Tensor forward(const at::Tensor& x, KVCache* cache = nullptr,
                     const std::optional<at::Tensor>& key_mask = std::nullopt,
                     const std::optional<at::Tensor>& attn_mask = std::nullopt);

  // forward's output and the attention probabilities (B, num_heads, L, cached + L); the latter
  // are materialized, O(L^2) memory, for inspection only. Under a key mask they are 0 at hidden
  // keys, and a row that sees no key is all 0; with sinks a row sums to less than 1; in training
  // with attn_dropout they are the dropped and rescaled ones that the output was computed with.
  std::tuple<at::Tensor, at::Tensor> forward_with_weights(
      const at::Tensor& x, KVCache* cache = nullptr,
      const std::optional<at::Tensor>& key_mask = std::nullopt,
      const std::optional<at::Tensor>& attn_mask = std::nullopt);

  // An empty cache for batch_size sequences of up to max_len positions, on the device of the
  // parameters, in `dtype` (the parameters' by default; an 8-bit dtype with scales, k_scale and
  // v_scale as KVCache takes them): forward decodes from any of them, an 8-bit one in inference
  // only (under torch::NoGradGuard or inference mode; no key_mask, attn_mask, attention dropout in
  // training or weights: c10::NotImplementedError), with the window, softcap, ALiBi and sinks.
  KVCache make_cache(int64_t batch_size, int64_t max_len,
                     std::optional<at::ScalarType> dtype = std::nullopt,
                     std::optional<ScaleLayout> scales = std::nullopt,
                     std::optional<double> k_scale = std::nullopt,
                     std::optional<double> v_scale = std::nullopt) const;

  // The options with every default resolved (num_kv_heads, head_dim, value_head_dim are set).
  CausalSelfAttentionOptions options;
  torch::nn::Linear c_attn{nullptr};
  torch::nn::Linear c_proj{nullptr};
  torch::nn::Dropout resid_dropout{nullptr};
  // The learned sinks (num_heads,) with options.sinks(), else undefined.
  at::Tensor sinks;
  // The ALiBi slopes, float32 (num_heads,), with options.alibi(), else undefined.
  at::Tensor alibi_slopes;

 private:
  struct Heads {
    at::Tensor q, k, v;  // (B, H, L, D) views of c_attn's output; k and v include the cache
    // What to attend with: key_mask without a cache, the cache's mask with one.
    std::optional<at::Tensor> key_mask;
    std::optional<at::Tensor> attn_mask;  // the call's, as given
  };
  Heads project_heads(const at::Tensor& x, KVCache* cache,
                      const std::optional<at::Tensor>& key_mask);
  // The op's options for the heads: every score option, attention dropout in training only.
  AttentionOptions attention_options(const Heads& heads) const;
  at::Tensor attend(const Heads& heads);
  // forward's attention (B, Hq, L, Dv) with an 8-bit cache: the new keys and values appended
  // (quantized), the queries attending the whole cache by paged_attention, which reads each
  // sequence's cache as one page in place. What that does not serve throws before anything
  // enters the cache.
  at::Tensor decode_quantized(const at::Tensor& x, KVCache& cache,
                              const std::optional<at::Tensor>& key_mask,
                              const std::optional<at::Tensor>& attn_mask);
  // Puts back the float32 slopes that a dtype conversion has converted.
  void restore_alibi_slopes(const at::Tensor& slopes);
  at::Tensor project_output(const at::Tensor& attended);
};

TORCH_MODULE(CausalSelfAttention);

}  // namespace causal_attention::nn
