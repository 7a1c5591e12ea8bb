// attn_mask's tile summary (a mask -> one MaskTile per kTileRows x kTileKeys entries of its own
// dims, read once per call) and its gradient's reduction to the mask's shape (attn_mask.h).
#include "attn_mask.h"

#include "../shapes.h"

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <c10/util/accumulate.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace causal_attention::cpu {
namespace {

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

}  // namespace

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

}  // namespace causal_attention::cpu
