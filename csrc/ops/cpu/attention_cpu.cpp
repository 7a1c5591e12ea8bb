// The CPU dispatch key: validates, views the inputs as (batch, heads, rows, dim), allocates the
// outputs and hands them to the kernels' stubs (kernels/kernel_api.h), which run the build for
// this CPU's instruction set. attention and
// varlen_attention reach these through their one kernel (ops/attention.cpp).
#include "../checks.h"
#include "../schema_adapters.h"
#include "../shapes.h"
#include "block_gemm.h"
#include "kernels/kernel_api.h"

#include <ATen/Parallel.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

namespace causal_attention::cpu {
namespace {

// (..., H, L, D) or (L, D) as a 4-D (batch, H, L, D) tensor with unit stride along D: a view
// whenever the leading dims can be merged (the transposed (B, L, H, D) layout included).
at::Tensor as_batch_heads_rows(const at::Tensor& t) {
  at::Tensor t4;
  if (t.dim() == 2) {
    t4 = t.unsqueeze(0).unsqueeze(0);
  } else if (t.dim() == 3) {
    t4 = t.unsqueeze(0);
  } else {
    int64_t batch = 1;
    for (int64_t d = 0; d + 3 < t.dim(); ++d) {
      batch *= t.size(d);
    }
    t4 = t.reshape({batch, t.size(-3), t.size(-2), t.size(-1)});
  }
  if (t4.stride(3) != 1 && t4.size(3) > 1) {
    t4 = t4.contiguous();
  }
  return t4;
}

// Calls a kernel's build for this CPU (kernel_api.h), with the block products of
// bfloat16/float16 decided once for the call (block_gemm.h): torch.backends.mkldnn is read here
// only, so that a flag flipped by another thread meanwhile changes no product of this call.
template <typename Tensors>
void run_kernel(const KernelStub<Tensors>& kernel, Tensors tensors) {
  tensors.native_products = native_products_now(tensors.q.scalar_type());
  kernel(tensors);
}

// A call's inputs in the kernels' layout (kernel_api.h): dense (..., H, L, D) ones as
// (batch, H, L, D), packed (total, H, D) ones as (1, H, total, D), with their sequences.
class KernelLayout {
 public:
  explicit KernelLayout(const detail::ForwardCall& call) : packed_(call.packed.any()) {}

  // Views whenever the layout allows, so that outputs allocated contiguous are written in place.
  at::Tensor rows(const at::Tensor& t) const {
    return as_batch_heads_rows(packed_ ? t.transpose(0, 1).unsqueeze(0) : t);
  }
  // lse: (..., Hq, Lq) as (batch, Hq, Lq), or packed (Hq, total_q) as (1, Hq, total_q); a view
  // of a contiguous one.
  at::Tensor lse_rows(const at::Tensor& lse, const at::Tensor& q_rows) const {
    return packed_ ? lse.contiguous().unsqueeze(0)
                   : lse.reshape({q_rows.size(0), q_rows.size(1), q_rows.size(2)}).contiguous();
  }
  std::vector<c10::SymInt> out_sizes(const at::Tensor& q, const at::Tensor& v) const {
    return packed_ ? detail::varlen_output_sym_sizes(q, v) : detail::output_sym_sizes(q, v);
  }
  std::vector<c10::SymInt> lse_sizes(const at::Tensor& q) const {
    return packed_ ? detail::varlen_lse_sym_sizes(q) : detail::lse_sym_sizes(q);
  }
  bool packed() const { return packed_; }

 private:
  bool packed_;
};

PackedSequences packed_sequences(const char* op, const detail::ForwardCall& call) {
  const detail::PackedLengths& lengths = call.packed;
  PackedSequences sequences{lengths.cu_seqlens_q->contiguous(), lengths.cu_seqlens_k->contiguous()};
  sequences.max_len_q =
      detail::check_cumulative_lengths(op, "cu_seqlens_q", sequences.cu_q, call.q.size(0),
                                       "max_seqlen_q", lengths.max_seqlen_q->expect_int());
  sequences.max_len_k =
      detail::check_cumulative_lengths(op, "cu_seqlens_k", sequences.cu_k, call.k.size(0),
                                       "max_seqlen_k", lengths.max_seqlen_k->expect_int());
  return sequences;
}

// The key mask as the kernels read it: contiguous bool (batch, Lk), and the running count of the
// keys it keeps, (batch, Lk + 1) from 0, which says in O(1) whether a key block is hidden
// entirely (skipped), partly (masked entries) or not at all.
void set_key_mask(ForwardTensors& t, const std::optional<at::Tensor>& key_mask) {
  // A mask that hides nothing is no mask: the call then runs exactly as without one.
  if (!key_mask.has_value() || key_mask->numel() == 0 || key_mask->all().item<bool>()) {
    return;
  }
  const int64_t len_k = t.k.size(2);
  t.key_mask = key_mask->reshape({t.q.size(0), len_k}).contiguous();
  t.kept_keys_before = at::zeros({t.q.size(0), len_k + 1}, t.key_mask.options().dtype(at::kInt));
  t.kept_keys_before.narrow(1, 1, len_k).copy_(t.key_mask.cumsum(1, at::kInt));
}

// attn_mask's own dims as (batch, heads, rows, keys) for a dense q: each is the scores' size or 1
// where the mask is broadcast along it. A view of the mask but where it broadcasts along some of
// several batch dims and not others: those are expanded (a copy of the mask times the batch dims
// it spans, never its expansion over heads, rows or keys).
at::Tensor mask_as_kernel_dims(const at::Tensor& mask, const at::Tensor& q) {
  at::Tensor m = mask;
  while (m.dim() < q.dim()) {
    m = m.unsqueeze(0);
  }
  if (m.dim() == 2) {
    return m.unsqueeze(0).unsqueeze(0);
  }
  if (m.dim() == 3) {
    return m.unsqueeze(0);
  }
  const auto inner = m.sizes().slice(m.dim() - 3);
  const auto leading = m.sizes().slice(0, m.dim() - 3);
  if (std::all_of(leading.begin(), leading.end(), [](int64_t size) { return size == 1; })) {
    return m.reshape({1, inner[0], inner[1], inner[2]});
  }
  std::vector<int64_t> sizes(q.sizes().begin(), q.sizes().end() - 3);
  const int64_t batch = c10::multiply_integers(sizes);
  sizes.insert(sizes.end(), inner.begin(), inner.end());
  return m.expand(sizes).reshape({batch, inner[0], inner[1], inner[2]});
}

// Eight true bools, read as one word.
constexpr uint64_t kAllTrue = 0x0101010101010101ULL;

// Whether some of keys [0, n) of one mask row (key stride `stride`) do not hide their key (true,
// not -inf), and whether some do not leave the score as it is (false, not 0), or-ed into
// *shows and *changes; without branches, so that the compiler vectorizes this pass over the
// whole mask. Unit-stride bools go eight at a time, as words.
template <typename T>
void flag_entries(const T* row, int64_t n, int64_t stride, uint8_t* shows, uint8_t* changes) {
  uint8_t shown = 0, changed = 0;
  int64_t c = 0;
  if constexpr (std::is_same_v<T, bool>) {
    const auto* bytes = reinterpret_cast<const uint8_t*>(row);
    if (stride == 1) {
      for (; c + 8 <= n; c += 8) {
        uint64_t word;
        std::memcpy(&word, bytes + c, sizeof(word));
        shown |= uint8_t(word != 0);
        changed |= uint8_t(word != kAllTrue);
      }
    }
    for (; c < n; ++c) {
      const uint8_t x = bytes[c * stride];
      shown |= x;
      changed |= x ^ 1;
    }
  } else {
    constexpr T lowest = -std::numeric_limits<T>::infinity();
    for (; c < n; ++c) {
      const T x = row[c * stride];
      shown |= uint8_t(x != lowest);
      changed |= uint8_t(x != T(0));
    }
  }
  *shows |= shown;
  *changes |= changed;
}

// flag_entries for the rows [first_row, last_row) of (b, h) of a bool mask with unit stride along
// keys and whole tiles of keys, every tile at once: the rows' words (eight bools each) or-ed and
// and-ed together first, then two words a tile. Returns false (and does nothing) for any other
// mask.
template <typename T>
bool bool_words(const at::Tensor& mask, const T* data, int64_t b, int64_t h, int64_t first_row,
                int64_t last_row, uint8_t* shows, uint8_t* changes, std::vector<uint64_t>& any,
                std::vector<uint64_t>& all) {
  constexpr int64_t kKeys = KernelAttentionMask::kTileKeys, kWordsPerTile = kKeys / 8;
  const int64_t keys = mask.size(3);
  if constexpr (!std::is_same_v<T, bool>) {
    return false;
  } else {
    if (mask.stride(3) != 1 || keys % kKeys != 0) {
      return false;
    }
    const int64_t words = keys / 8;
    any.assign(words, 0);
    all.assign(words, ~uint64_t(0));
    for (int64_t r = first_row; r < last_row; ++r) {
      const auto* row = reinterpret_cast<const uint8_t*>(data + b * mask.stride(0) +
                                                         h * mask.stride(1) + r * mask.stride(2));
      for (int64_t w = 0; w < words; ++w) {
        uint64_t word;
        std::memcpy(&word, row + 8 * w, sizeof(word));
        any[w] |= word;
        all[w] &= word;
      }
    }
    for (int64_t j = 0; j < keys / kKeys; ++j) {
      uint64_t any_tile = 0, all_tile = ~uint64_t(0);
      for (int64_t w = j * kWordsPerTile; w < (j + 1) * kWordsPerTile; ++w) {
        any_tile |= any[w];
        all_tile &= all[w];
      }
      shows[j] = uint8_t(any_tile != 0);
      changes[j] = uint8_t(all_tile != kAllTrue);
    }
    return true;
  }
}

// One MaskTile per KernelAttentionMask::kTileRows x kTileKeys entries of a mask in its own dims:
// hidden where every entry hides its key (false, -inf), visible where none changes anything
// (true, 0), else mixed. O(mask) time, O(tiles) memory, one task per row of tiles, reading the
// mask row by row.
template <typename T>
at::Tensor mask_tiles(const at::Tensor& mask) {
  constexpr int64_t kRows = KernelAttentionMask::kTileRows, kKeys = KernelAttentionMask::kTileKeys;
  const int64_t batch = mask.size(0), heads = mask.size(1), rows = mask.size(2),
                keys = mask.size(3);
  const int64_t row_tiles = (rows + kRows - 1) / kRows, key_tiles = (keys + kKeys - 1) / kKeys;
  at::Tensor tiles =
      at::empty({batch, heads, row_tiles, key_tiles}, mask.options().dtype(at::kByte));
  uint8_t* out = tiles.data_ptr<uint8_t>();
  const T* data = mask.data_ptr<T>();
  at::parallel_for(0, batch * heads * row_tiles, 1, [&](int64_t begin, int64_t end) {
    std::vector<uint8_t> shows(key_tiles), changes(key_tiles);
    std::vector<uint64_t> any, all;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / (heads * row_tiles), h = item / row_tiles % heads,
                    row_tile = item % row_tiles;
      const int64_t first_row = row_tile * kRows, last_row = std::min(rows, first_row + kRows);
      if (!bool_words(mask, data, b, h, first_row, last_row, shows.data(), changes.data(), any,
                      all)) {  // else it set every tile's flags
        std::fill(shows.begin(), shows.end(), 0);
        std::fill(changes.begin(), changes.end(), 0);
        for (int64_t r = first_row; r < last_row; ++r) {
          const T* row = data + b * mask.stride(0) + h * mask.stride(1) + r * mask.stride(2);
          for (int64_t j = 0; j < key_tiles; ++j) {
            flag_entries(row + j * kKeys * mask.stride(3), std::min(kKeys, keys - j * kKeys),
                         mask.stride(3), &shows[j], &changes[j]);
          }
        }
      }
      for (int64_t j = 0; j < key_tiles; ++j) {
        out[item * key_tiles + j] = !shows[j]     ? kTileHidden
                                    : !changes[j] ? kTileVisible
                                                  : kTileMixed;
      }
    }
  });
  return tiles;
}

// attn_mask as the kernels read it (kernel_api.h), for q, k in the kernels' layout: floating
// masks in the accumulation dtype, unit stride along keys, expanded to the scores as a view.
KernelAttentionMask kernel_attn_mask(const at::Tensor& mask, const at::Tensor& q,
                                     const ForwardTensors& t) {
  at::Tensor own = mask_as_kernel_dims(mask, q);
  if (own.scalar_type() != at::kBool) {
    own = own.to(detail::accumulation_dtype(q.scalar_type()));
  }
  if (own.size(3) > 1 && own.stride(3) != 1) {
    own = own.contiguous();
  }
  KernelAttentionMask kernel;
  kernel.tiles = own.scalar_type() == at::kBool     ? mask_tiles<bool>(own)
                 : own.scalar_type() == at::kDouble ? mask_tiles<double>(own)
                                                    : mask_tiles<float>(own);
  kernel.values = own.expand({t.q.size(0), t.q.size(1), t.q.size(2), t.k.size(2)});
  return kernel;
}

// attn_mask's gradient from the kernel's dS over the scores (batch, Hq, Lq, Lk): summed over the
// dims the mask is broadcast along, one slice after the other (the same sums at any thread
// count), in the mask's shape and dtype.
at::Tensor attn_mask_gradient(const at::Tensor& scores_grad, const at::Tensor& q,
                              const at::Tensor& k, const at::Tensor& mask) {
  std::vector<int64_t> scores(q.sizes().begin(), q.sizes().end());
  scores.back() = k.size(-2);
  at::Tensor grad = scores_grad.view(scores);
  const int64_t padding = grad.dim() - mask.dim();
  for (int64_t d = 0; d < grad.dim(); ++d) {
    if (grad.size(d) > 1 && (d < padding || mask.size(d - padding) == 1)) {
      at::Tensor sum = grad.select(d, 0).clone();
      for (int64_t i = 1; i < grad.size(d); ++i) {
        sum.add_(grad.select(d, i));
      }
      grad = sum.unsqueeze(d);
    }
  }
  return grad.reshape(mask.sizes()).to(mask.scalar_type());
}

// The score options as the kernels read them (kernel_api.h), for tensors already in the kernels'
// layout with their sequences set.
KernelScoreOptions kernel_options(const ForwardTensors& t, const detail::ScoreOptions& options) {
  KernelScoreOptions resolved;
  resolved.window_left = options.window[0];
  resolved.window_right = options.window[1];
  resolved.softcap = options.softcap.value_or(0.0);
  const int64_t batch = t.sequences.packed() ? t.sequences.cu_q.numel() - 1 : t.q.size(0);
  const int64_t heads_q = t.q.size(1);
  if (options.alibi_slopes.has_value()) {
    const at::Tensor& slopes = *options.alibi_slopes;
    resolved.alibi_slopes =
        (slopes.dim() == 1 ? slopes.expand({batch, heads_q}) : slopes.reshape({batch, heads_q}))
            .contiguous();
  }
  if (options.sinks.has_value()) {
    resolved.sinks = options.sinks->to(detail::accumulation_dtype(t.q.scalar_type())).contiguous();
  }
  resolved.dropout_p = options.dropout_p;
  if (options.dropout_p > 0) {
    const at::Tensor seed = options.dropout_seed->contiguous();
    resolved.dropout_seed = uint64_t(seed.data_ptr<int64_t>()[0]);
    resolved.dropout_offset = uint64_t(seed.data_ptr<int64_t>()[1]);
  }
  return resolved;
}

// The inputs of a call, its key mask, sequences and options, as the kernels take them.
ForwardTensors kernel_inputs(const char* op, const detail::ForwardCall& call,
                             const KernelLayout& layout) {
  ForwardTensors t =
      ForwardTensors::of(layout.rows(call.q), layout.rows(call.k), layout.rows(call.v));
  t.scale = call.scale;
  if (layout.packed()) {
    t.sequences = packed_sequences(op, call);
  } else {
    set_key_mask(t, call.key_mask);
    if (call.attn_mask.has_value()) {
      t.attn_mask = kernel_attn_mask(*call.attn_mask, call.q, t);
    }
  }
  t.options = kernel_options(t, call.options);
  if (call.query_offset.has_value()) {
    t.query_offset = call.query_offset->guard_int(__FILE__, __LINE__);
  }
  return t;
}

// Whether a packed call has no sequence, and so nothing to compute.
bool no_sequences(const ForwardTensors& t) {
  return t.sequences.packed() && t.sequences.cu_q.numel() <= 1;
}

std::tuple<at::Tensor, at::Tensor> attention_forward_cpu(const detail::ForwardCall& call) {
  detail::check_forward_call(call);
  const KernelLayout layout(call);
  ForwardTensors t = kernel_inputs("causal_attention.attention_forward", call, layout);
  at::Tensor out = at::empty_symint(layout.out_sizes(call.q, call.v), call.q.options());
  at::Tensor lse = at::empty_symint(layout.lse_sizes(call.q), detail::lse_options(call.q));
  t.out = layout.rows(out);
  t.lse = layout.lse_rows(lse, t.q);  // a view: lse is allocated contiguous
  if (lse.numel() > 0 && !no_sequences(t)) {
    run_kernel(forward_kernel, std::move(t));
  }
  return {out, lse};
}

// attention_gradients, and attention_backward (its results but the mask's), checked under `op`.
detail::Gradients gradients_cpu(const char* op, const detail::BackwardCall& call) {
  detail::check_backward_call(call, op);
  const KernelLayout layout(call);
  BackwardTensors t(kernel_inputs(op, call, layout));
  t.grad_out = layout.rows(call.grad_out);
  t.out = layout.rows(call.out);
  t.lse = layout.lse_rows(call.lse, t.q);
  if (call.delta.has_value()) {
    t.delta = layout.lse_rows(*call.delta, t.q);
  }
  // The sinks' gradient is accumulated in the accumulation dtype and returned in the sinks'
  // dtype; (0,) without sinks.
  const std::optional<at::Tensor>& sinks = call.options.sinks;
  if (sinks.has_value()) {
    t.dsinks = at::zeros({sinks->size(0)},
                         sinks->options().dtype(detail::accumulation_dtype(t.q.scalar_type())));
  }
  const at::TensorOptions gradients = detail::gradient_options(call.q, call.delta.has_value());
  at::Tensor dq = at::empty(call.q.sizes(), gradients);
  at::Tensor dk = at::empty(call.k.sizes(), gradients);
  at::Tensor dv = at::empty(call.v.sizes(), gradients);
  t.dq = layout.rows(dq);
  t.dk = layout.rows(dk);
  t.dv = layout.rows(dv);
  if (call.attn_mask_grad) {
    t.dattn_mask = at::zeros({t.q.size(0), t.q.size(1), t.q.size(2), t.k.size(2)},
                             detail::lse_options(call.q));
  }
  if ((dq.numel() > 0 || dk.numel() > 0 || dv.numel() > 0) && !no_sequences(t)) {
    run_kernel(backward_kernel, t);
  }
  return {dq, dk, dv,
          sinks.has_value() ? t.dsinks.to(sinks->scalar_type()) : at::empty({0}, call.q.options()),
          call.attn_mask_grad ? attn_mask_gradient(t.dattn_mask, call.q, call.k, *call.attn_mask)
                              : at::empty({0}, call.q.options())};
}

detail::Gradients attention_gradients_cpu(const detail::BackwardCall& call) {
  return gradients_cpu("causal_attention.attention_gradients", call);
}
detail::Gradients attention_backward_cpu(const detail::BackwardCall& call) {
  return gradients_cpu("causal_attention.attention_backward", call);
}

// What paged_attention's checks leave to the host (checks.h), read here: each sequence's keys
// fit the pages its row of the table holds and every one of those pages lies in the pool.
// Returns the sequences as the kernels read them: cu_q (given,
// or Lq each for a dense q) and cu_k, the running count of the keys.
PackedSequences paged_sequences(const detail::PagedCall& call, const at::Tensor& table) {
  constexpr const char* op = "causal_attention.paged_attention";
  const at::Tensor seqlens = call.cache_seqlens.contiguous();
  const int64_t batch = seqlens.size(0), width = table.size(1);
  const int64_t pages = call.k_cache.size(0), page_size = call.k_cache.size(1);
  PackedSequences sequences;
  if (call.packed()) {
    sequences.cu_q = call.cu_seqlens_q->contiguous();
    sequences.max_len_q =
        detail::check_cumulative_lengths(op, "cu_seqlens_q", sequences.cu_q, call.q.size(0),
                                         "max_seqlen_q", call.max_seqlen_q->expect_int());
  } else {
    sequences.max_len_q = call.q.size(1);
    sequences.cu_q = at::arange(batch + 1, seqlens.options()).mul_(sequences.max_len_q);
  }
  sequences.cu_k = at::zeros({batch + 1}, seqlens.options());
  const int32_t* lengths = seqlens.data_ptr<int32_t>();
  const int32_t* rows = table.data_ptr<int32_t>();
  int32_t* cu_k = sequences.cu_k.data_ptr<int32_t>();
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t keys = lengths[b];
    TORCH_CHECK_VALUE(keys >= 0 && keys <= width * page_size, op, ": cache_seqlens[", b, "]=", keys,
                      " must lie in [0, ", width * page_size,
                      "], the keys block_table's row holds (max_pages * page_size = ", width, " * ",
                      page_size, ")");
    for (int64_t j = 0; j < (keys + page_size - 1) / page_size; ++j) {
      const int64_t page = rows[b * width + j];
      TORCH_CHECK_VALUE(page >= 0 && page < pages, op, ": block_table[", b, "][", j, "]=", page,
                        " names no page of the pool (k_cache.shape[0]=", pages, "); sequence ", b,
                        "'s ", keys, " keys lie on its first ", (keys + page_size - 1) / page_size,
                        " entries");
    }
    // The kernels count keys in int32 (cu_k): a table naming one page many times can say more.
    TORCH_CHECK_VALUE(cu_k[b] + keys <= std::numeric_limits<int32_t>::max(), op,
                      ": the sequences hold more than 2^31 - 1 keys in all (cache_seqlens sums to ",
                      cu_k[b] + keys, " by sequence ", b, ")");
    cu_k[b + 1] = static_cast<int32_t>(cu_k[b] + keys);
    sequences.max_len_k = std::max(sequences.max_len_k, keys);
  }
  return sequences;
}

// paged_attention: every sequence's query rows, one after the other as packed q's, against its
// keys read in place through the block table (kernels/paged_forward_kernel.cpp).
std::tuple<at::Tensor, at::Tensor> paged_attention_cpu(const detail::PagedCall& call) {
  const double scale = detail::check_paged_call(call);
  const bool packed = call.packed();
  const at::Tensor table = call.block_table.contiguous();
  const int64_t batch = table.size(0), heads_q = call.q.size(-2);
  const int64_t total_q = packed ? call.q.size(0) : call.q.size(0) * call.q.size(1);
  const auto kernel_rows = [](const at::Tensor& rows) {  // (total, H, D) as (1, H, total, D)
    return as_batch_heads_rows(rows.transpose(0, 1).unsqueeze(0));
  };
  // The caches as (num_pages, Hkv, page_size, D): views, but for a cache whose last dim is
  // strided.
  const auto kernel_cache = [](const at::Tensor& cache) {
    return (cache.stride(3) == 1 ? cache : cache.contiguous()).permute({0, 2, 1, 3});
  };
  PagedForwardTensors t(
      ForwardTensors::of(kernel_rows(call.q.reshape({total_q, heads_q, call.q.size(-1)})),
                         kernel_cache(call.k_cache), kernel_cache(call.v_cache)));
  t.block_table = table;
  t.scale = scale;
  t.sequences = paged_sequences(call, table);
  t.options = kernel_options(t, call.options);
  const int64_t value_dim = call.v_cache.size(3);
  at::Tensor out = at::empty({total_q, heads_q, value_dim}, call.q.options());
  at::Tensor lse = at::empty({heads_q, total_q}, detail::lse_options(call.q));
  t.out = kernel_rows(out);
  t.lse = lse.unsqueeze(0);
  if (total_q > 0 && batch > 0) {
    run_kernel(paged_forward_kernel, std::move(t));
  }
  if (packed) {
    return {out, lse};
  }
  // flash-attn's dense layout: out (B, Lq, Hq, Dv), lse (B, Hq, Lq).
  const int64_t len_q = call.q.size(1);
  return {out.view({batch, len_q, heads_q, value_dim}),
          lse.view({heads_q, batch, len_q}).permute({1, 0, 2}).contiguous()};
}

// The dropout keep mask of scores (..., Hq, Lq, Lk), from the kernels' own hash (batch = the
// flat index of the leading dims).
at::Tensor dropout_keep_mask_cpu(const at::Tensor& dropout_seed, c10::SymIntArrayRef shape,
                                 double dropout_p) {
  detail::check_dropout_keep_mask_call(dropout_seed, shape, dropout_p);
  const std::vector<int64_t> sizes = C10_AS_INTARRAYREF_SLOW(shape).vec();
  KeepMaskTensors t;
  t.mask = at::empty(sizes, dropout_seed.options().dtype(at::kBool));
  t.len_q = sizes[sizes.size() - 2];
  t.heads = sizes.size() >= 3 ? sizes[sizes.size() - 3] : 1;
  t.dropout_p = dropout_p;
  const at::Tensor seed = dropout_seed.contiguous();
  t.dropout_seed = uint64_t(seed.data_ptr<int64_t>()[0]);
  t.dropout_offset = uint64_t(seed.data_ptr<int64_t>()[1]);
  dropout_keep_mask_kernel(t);
  return t.mask;
}

}  // namespace
}  // namespace causal_attention::cpu

TORCH_LIBRARY_IMPL(causal_attention, CPU, m) {
  using namespace causal_attention;
  m.impl("attention_forward", detail::forward_from_schema<cpu::attention_forward_cpu>);
  m.impl("attention_gradients", detail::gradients_from_schema<cpu::attention_gradients_cpu>);
  m.impl("attention_backward", detail::backward_from_schema<cpu::attention_backward_cpu>);
  m.impl("dropout_keep_mask", causal_attention::cpu::dropout_keep_mask_cpu);
  m.impl("paged_attention", detail::paged_from_schema<cpu::paged_attention_cpu>);
}
