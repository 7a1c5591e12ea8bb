// The dropout mask as a pure function of (seed, offset, batch, head, row, key): a counter-based
// generator, so that the backward regenerates the forward's mask block by block, nothing of size
// Lq x Lk is stored, and the mask does not depend on how the work is split between threads.
// attention_weights builds the same mask from the same function (dropout_keep_mask_kernel.cpp).
// The results are integers, identical in every instruction set's build.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace causal_attention::cpu::CPU_CAPABILITY {

class DropoutHash {
 public:
  // Drops with probability p in [0, 1): a 32-bit hash below p * 2^32 drops.
  DropoutHash(double p, uint64_t seed, uint64_t offset)
      : threshold_(threshold_of(p)), seed_(seed), offset_(offset) {}

  bool active() const { return threshold_ != 0; }

  // The key of one query row: the row's hash, from which each key's hash follows.
  uint32_t row_key(int64_t batch, int64_t head, int64_t row) const {
    uint64_t x = mix64(seed_ ^ mix64(offset_ + 0x9E3779B97F4A7C15ull));
    x = mix64(x ^ uint64_t(batch));
    x = mix64(x ^ uint64_t(head));
    x = mix64(x ^ uint64_t(row));
    return uint32_t(x ^ (x >> 32));
  }

  // Whether the probability of `key` in the row of `row_key` is kept.
  bool kept(uint32_t row_key, int64_t key) const {
    return hash(row_key, uint32_t(key)) >= threshold_;
  }

  // row[c] = kept(row_key, first_key + c) ? row[c] * factor : 0 for c in [begin, end).
  template <typename T>
  void apply(T* row, int64_t begin, int64_t end, uint32_t row_key, int64_t first_key,
             T factor) const {
    for_each_chunk(begin, end, row_key, first_key, [&](int64_t c0, int64_t n, const uint32_t* h) {
      for (int64_t i = 0; i < n; ++i) {
        row[c0 + i] = h[i] >= threshold_ ? row[c0 + i] * factor : T(0);
      }
    });
  }

  // factors[c] = kept(row_key, first_key + c) ? factor : 0 for c in [begin, end).
  template <typename T>
  void keep_factors(T* factors, int64_t begin, int64_t end, uint32_t row_key, int64_t first_key,
                    T factor) const {
    for_each_chunk(begin, end, row_key, first_key, [&](int64_t c0, int64_t n, const uint32_t* h) {
      for (int64_t i = 0; i < n; ++i) {
        factors[c0 + i] = h[i] >= threshold_ ? factor : T(0);
      }
    });
  }

 private:
  static uint32_t threshold_of(double p) {
    const double scaled = std::round(p * 4294967296.0);
    return scaled >= 4294967295.0 ? 4294967295u : uint32_t(scaled);
  }
  // splitmix64's finalizer and the "lowbias32" integer hash: every input bit flips every output
  // bit with probability close to 1/2, so consecutive keys and rows give independent bits.
  static uint64_t mix64(uint64_t x) {
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return x ^ (x >> 31);
  }
  static uint32_t mix32(uint32_t x) {
    x = (x ^ (x >> 16)) * 0x7FEB352Du;
    x = (x ^ (x >> 15)) * 0x846CA68Bu;
    return x ^ (x >> 16);
  }

  // fn(c0, n, hashes) for chunks [c0, c0 + n) of [begin, end), with the hashes of their keys:
  // computed first, in 32-bit integer arithmetic alone, a loop the compiler vectorizes (one loop
  // computing and selecting it does not).
  template <typename Fn>
  static void for_each_chunk(int64_t begin, int64_t end, uint32_t row_key, int64_t first_key,
                             const Fn& fn) {
    constexpr int64_t kChunk = 64;
    uint32_t hashes[kChunk];
    for (int64_t c0 = begin; c0 < end; c0 += kChunk) {
      const int64_t n = std::min(kChunk, end - c0);
      const uint32_t key0 = uint32_t(first_key + c0);
      for (int64_t i = 0; i < n; ++i) {
        hashes[i] = hash(row_key, key0 + uint32_t(i));
      }
      fn(c0, n, hashes);
    }
  }

  static uint32_t hash(uint32_t row_key, uint32_t key) {
    return mix32(row_key ^ (key * 0x9E3779B9u));
  }

  uint32_t threshold_;
  uint64_t seed_, offset_;
};

}  // namespace
