#include <causal_attention/nn.h>
#include <causal_attention/ops.h>
#include <torch/script.h>
#include <torch/torch.h>

namespace ca = causal_attention::nn;

// A pre-norm transformer block around the module, as in nanoGPT.
struct BlockImpl : torch::nn::Module {
  BlockImpl(int64_t embed_dim, int64_t num_heads)
      : ln(register_module("ln", torch::nn::LayerNorm(torch::nn::LayerNormOptions({embed_dim})))),
        attn(register_module(
            "attn", ca::CausalSelfAttention(
                        ca::CausalSelfAttentionOptions(embed_dim, num_heads).num_kv_heads(2)))) {}

  // With a cache, x holds only the positions after the cached ones.
  torch::Tensor forward(const torch::Tensor& x, ca::KVCache* cache = nullptr) {
    return x + attn(ln(x), cache);
  }

  torch::nn::LayerNorm ln;
  ca::CausalSelfAttention attn;
};
TORCH_MODULE(Block);

// Runs x (B, L, E) through the block one position at a time, as a decoder does.
torch::Tensor decode_step_by_step(Block& block, const torch::Tensor& x) {
  torch::NoGradGuard no_grad;
  ca::KVCache cache = block->attn->make_cache(x.size(0), /*max_len=*/x.size(1));
  std::vector<torch::Tensor> steps;
  for (int64_t t = 0; t < x.size(1); ++t) {
    steps.push_back(block(x.narrow(1, t, 1), &cache));
  }
  return torch::cat(steps, 1);
}

// The op itself, its options set by name: a sliding window of 4096 keys, Gemma 2's softcap.
torch::Tensor local_attention(const torch::Tensor& q, const torch::Tensor& k,
                              const torch::Tensor& v) {
  using causal_attention::AttentionOptions;
  return causal_attention::attention(q, k, v, AttentionOptions().window({4095, 0}).softcap(50.0));
}

// A model saved from Python with torch.jit.script runs here, forward and backward.
torch::Tensor run_scripted(const std::string& path, const torch::Tensor& tokens) {
  torch::jit::Module model = torch::jit::load(path);
  torch::Tensor logits = model.forward({tokens}).toTensor();
  logits.square().mean().backward();  // gradients land in model.parameters()
  return logits;
}
