// paged_attention through the C++ API: K/V laid into shuffled pages of a pool read through the
// block table equal the same attention on the contiguous keys, for decode rows, a packed batch of
// decodes and a prefill chunk, and every score option the op takes; the options it does not take
// and a table naming no page of the pool raise c10::ValueError naming them. An int8 cache with a
// scale per token and KV head reads as its dequantized copy.
#include "../attention_test_utils.h"

#include <causal_attention/ops.h>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <vector>

namespace {

using causal_attention::AttentionOptions;
using causal_attention::tests::expect_error;
using causal_attention::tests::max_abs_diff;

// (B, Hkv, L, D) keys or values laid into the pages of a shuffled pool, sequence b's pages in
// row b of the table: the pool (B * pages_per_sequence, page_size, Hkv, D).
at::Tensor pool(const at::Tensor& rows, int64_t page_size, const at::Tensor& table) {
  const int64_t batch = rows.size(0), heads = rows.size(1), length = rows.size(2);
  const int64_t pages = table.size(1), dim = rows.size(3);
  const at::Tensor padded =
      torch::constant_pad_nd(rows.transpose(1, 2), {0, 0, 0, 0, 0, pages * page_size - length});
  at::Tensor cache = torch::full({batch * pages, page_size, heads, dim}, 1e30, rows.options());
  cache.index_copy_(0, table.flatten().to(torch::kLong),
                    padded.reshape({batch * pages, page_size, heads, dim}));
  return cache;
}

struct PagedCase {
  at::Tensor k, v, k_cache, v_cache, table, seqlens;
};

PagedCase paged_case(int64_t batch, int64_t length, int64_t page_size) {
  PagedCase c;
  c.k = torch::randn({batch, 2, length, 16}, torch::kDouble);
  c.v = torch::randn({batch, 2, length, 8}, torch::kDouble);
  const int64_t pages = (length + page_size - 1) / page_size;
  c.table = torch::randperm(batch * pages, torch::kInt).view({batch, pages});
  c.k_cache = pool(c.k, page_size, c.table);
  c.v_cache = pool(c.v, page_size, c.table);
  c.seqlens = torch::full({batch}, length, torch::kInt);
  return c;
}

TEST(PagedAttention, DecodeRowsEqualAttentionOnTheContiguousKeysWithEveryOption) {
  torch::manual_seed(3);
  const PagedCase c = paged_case(/*batch=*/3, /*length=*/300, /*page_size=*/16);
  const at::Tensor q = torch::randn({3, 1, 8, 16}, torch::kDouble);  // (B, Lq, Hq, D)
  const std::vector<AttentionOptions> options{
      AttentionOptions(), AttentionOptions().scale(0.3).window({63, 0}),
      AttentionOptions().softcap(5.0).alibi_slopes(torch::rand({8})).sinks(torch::randn({8}))};
  for (size_t i = 0; i < options.size(); ++i) {
    const auto [out, lse] =
        causal_attention::paged_attention(q, c.k_cache, c.v_cache, c.table, c.seqlens, options[i]);
    const auto [expected, expected_lse] = causal_attention::attention_forward(
        q.transpose(1, 2), c.k, c.v, options[i].scale().value_or(0.25),
        AttentionOptions(options[i]).scale(std::nullopt));
    EXPECT_LT(max_abs_diff(out.transpose(1, 2), expected), 1e-12) << "options " << i;
    EXPECT_LT(max_abs_diff(lse, expected_lse), 1e-12) << "options " << i;
  }
}

TEST(PagedAttention, PackedDecodesAndAChunkEqualTheirContiguousCalls) {
  torch::manual_seed(4);
  const PagedCase c = paged_case(/*batch=*/3, /*length=*/200, /*page_size=*/64);
  const std::vector<int64_t> rows{1, 40, 1};  // a prefill chunk of 40 between two decodes
  const at::Tensor cu_seqlens_q = torch::tensor(std::vector<int32_t>{0, 1, 41, 42}, torch::kInt);
  const at::Tensor q = torch::randn({42, 8, 16}, torch::kDouble);
  const auto [out, lse] = causal_attention::paged_attention(
      q, c.k_cache, c.v_cache, c.table, c.seqlens, AttentionOptions(), cu_seqlens_q, 40);
  for (int64_t b = 0, first = 0; b < 3; first += rows[b], ++b) {
    const at::Tensor q_b = q.narrow(0, first, rows[b]).transpose(0, 1);  // (Hq, Lq, D)
    const at::Tensor expected = causal_attention::attention(q_b, c.k[b], c.v[b]);
    EXPECT_LT(max_abs_diff(out.narrow(0, first, rows[b]).transpose(0, 1), expected), 1e-12)
        << "sequence " << b;
  }
}

TEST(PagedAttention, OptionsItDoesNotTakeAndPagesOutsideThePoolRaiseValueError) {
  const PagedCase c = paged_case(/*batch=*/2, /*length=*/20, /*page_size=*/16);
  const at::Tensor q = torch::randn({2, 1, 4, 16}, torch::kDouble);
  const auto call = [&](const AttentionOptions& options, const at::Tensor& table) {
    return causal_attention::paged_attention(q, c.k_cache, c.v_cache, table, c.seqlens, options);
  };
  expect_error<c10::ValueError>(
      [&] { call(AttentionOptions().key_mask(torch::ones({2, 20}, torch::kBool)), c.table); },
      {"paged_attention", "key_mask"});
  expect_error<c10::ValueError>([&] { call(AttentionOptions().dropout_p(0.1), c.table); },
                                {"paged_attention", "dropout"});
  at::Tensor table = c.table.clone();
  table[1][1] = 4;  // the pool holds pages 0-3
  expect_error<c10::ValueError>([&] { call(AttentionOptions(), table); },
                                {"block_table[1][1]=4", "k_cache.shape[0]=4"});
}

TEST(PagedAttention, AnInt8CacheWithScalesPerTokenReadsAsItsDequantizedCopy) {
  torch::manual_seed(5);
  const PagedCase c = paged_case(/*batch=*/2, /*length=*/100, /*page_size=*/16);
  const at::Tensor q = torch::randn({2, 1, 4, 16}, torch::kFloat);
  std::vector<at::Tensor> stored, scales;
  for (const at::Tensor& cache : {c.k_cache, c.v_cache}) {
    // Pages no sequence reads hold 1e30: they are stored as 0.
    const at::Tensor rows = torch::where(cache.abs() < 1e29, cache, 0);
    const at::Tensor scale = rows.abs().amax(-1).div(127).clamp_min(1e-30).to(torch::kFloat);
    stored.push_back((rows / scale.unsqueeze(-1)).round().clamp(-127, 127).to(torch::kChar));
    scales.push_back(scale);
  }
  const auto [out, lse] = causal_attention::paged_attention(
      q, stored[0], stored[1], c.table, c.seqlens, AttentionOptions(), std::nullopt, std::nullopt,
      scales[0], scales[1]);
  const auto [expected, expected_lse] = causal_attention::paged_attention(
      q, stored[0].to(torch::kFloat) * scales[0].unsqueeze(-1),
      stored[1].to(torch::kFloat) * scales[1].unsqueeze(-1), c.table, c.seqlens);
  EXPECT_LT(max_abs_diff(out, expected), 1e-5);
  EXPECT_LT(max_abs_diff(lse, expected_lse), 1e-5);
  expect_error<c10::ValueError>(
      [&] {
        causal_attention::paged_attention(q, stored[0], stored[1], c.table, c.seqlens,
                                          AttentionOptions(), std::nullopt, std::nullopt,
                                          torch::zeros({3}), scales[1]);
      },
      {"paged_attention", "k_scale", "(num_pages, page_size, Hkv)"});
}

}  // namespace
