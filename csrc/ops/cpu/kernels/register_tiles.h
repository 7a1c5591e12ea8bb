// Register-level building blocks of the decode path's products (row_products.h): loads that
// widen bfloat16/float16 and 8-bit rows to float32 in registers, the horizontal sums of several
// vectors at once, the rank-one register tile both products run on, and the prefetches that stream
// K and V in from memory behind the arithmetic.
#pragma once

#include "eight_bit_values.h"

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

namespace causal_attention::cpu::CPU_CAPABILITY {

// Prefetches for one key block (or one run of it, on pages): as the scores pass over keys
// [j, j + n) of its `keys`, the same share of the next block's key and value rows is requested
// into L2, a block ahead, so that K and V stream in from memory behind the arithmetic. Measured
// on Zen 4 (bfloat16 paged decode, B 8 x 32768 keys, Hkv 8, D 128, 1 thread):
// - without them, 230 ms against 103: the hardware's prefetchers do not follow rows of 1-8 lines
//   lying a few KiB apart (a page's heads interleave);
// - every line is requested: every other line, or a row's first, took 205 and 198 ms;
// - the next block of the same head, not the next head's block (129 ms), and all of it while the
//   scores compute: with the next block's value rows requested by the values' products instead
//   (each pass over a stretch of columns requesting the same columns of the next block's rows),
//   the decode was within 2 % either way at 2 threads (float32, bfloat16, int8);
// - requesting the current block's value rows into L1 as well, as the scores pass, made the
//   decode 7 % slower in bfloat16 and 3 % in float32 (2 threads);
// - each KV head requesting its share of the next block's whole token rows (every head's, in
//   the order memory holds them) instead of its own rows: no faster (a trial build); on a Zen 5
//   at 2 threads bfloat16 9 % faster one block ahead (slower two ahead), int8 15 % slower
//   either way (stop 65);
// - no requests, the heads' products served in turn every 16 or 4 keys so that the demand reads
//   pass through the pages in memory order, or pages laid head by head (8 KiB runs a head): the
//   hardware's prefetchers did not keep up, 1.1-2x slower (trial builds, docs/benchmarks).
// With the bare-read probe corrected (stop 66), on a Zen 5 the float32 and bfloat16 decodes move
//   their pages at one rate, about 29 GB/s at 2 threads against a bare read's 70: what these
//   requests deliver to a walk the hardware's prefetchers do not follow. The 8-bit decodes are
//   bound by their arithmetic (docs/benchmarks, "The bare-read probe corrected").
struct StreamAhead {
  struct Rows {
    const char* data = nullptr;
    int64_t count = 0, row_bytes = 0, stride_bytes = 0;

    template <typename T>
    static Rows of(const T* data, int64_t count, int64_t width, int64_t ld) {
      return {reinterpret_cast<const char*>(data), count, width * int64_t(sizeof(T)),
              ld * int64_t(sizeof(T))};
    }
  };
  int64_t keys = 0;  // of the block (run) the scores pass over
  Rows next_keys, next_values;
  // When next_values are requested: as the scores pass over the keys (kWithKeys); as the values'
  // pass reaches them instead (kApart: the block's requests spread over both passes, not crowded
  // into the first; bfloat16 decode from memory 0.91-0.94 of its time on an AMX Xeon; float32's,
  // whose value rows need the longer lead, 1.01-1.05, keeps them with the scores); or at both
  // (kTwice: on a Zen 5, with 4 KiB pages, a request made a block ahead left a share of the value
  // rows to be read from memory when the values' pass came to them, and the same lines asked
  // again by that pass, half a block ahead, made the bfloat16 paged decode 8-10 % faster;
  // docs/benchmarks, "The value rows requested twice").
  enum class ValueRequests : uint8_t { kWithKeys, kApart, kTwice };
  ValueRequests value_requests = ValueRequests::kWithKeys;

  // The scores have reached keys [j, j + n) of `keys`.
  void at_keys(int64_t j, int64_t n) const {
    fetch_share(next_keys, j, n);
    if (value_requests != ValueRequests::kApart) {
      fetch_share(next_values, j, n);
    }
  }
  // The scores have reached key j of `keys`: at_keys(j, 1), where the next block's run holds as
  // many rows as this one (every run but a sequence's last) the row of the same index, with no
  // division. The bfloat16 pair tiles (query_key_pair_tile) ask key by key, spreading the
  // requests among their arithmetic, where a tile's (4 keys') at once came in bursts of 8-16
  // lines: on a Zen 5 at 2 threads the paged decode from memory then took 0.92 of its time in
  // bfloat16 and 0.94-0.97 in int8, and in cache 0.95-0.97 without the divisions. The float32
  // tiles, whose 16 keys' requests (one query row a KV head) went out together at their first
  // step anyway, were slower so and ask a tile at a time (docs/benchmarks, "Requests key by key").
  C10_ALWAYS_INLINE void at_key(int64_t j) const {
    if (next_keys.count != keys) {
      at_keys(j, 1);
      return;
    }
    fetch_row(next_keys, j);
    if (value_requests != ValueRequests::kApart) {
      fetch_row(next_values, j);
    }
  }
  // The values' pass has reached keys [j, j + n) of `keys` (kApart, kTwice).
  void at_values(int64_t j, int64_t n) const { fetch_share(next_values, j, n); }

  static constexpr int64_t kLineBytes = 64;
  // The lines of a row of `bytes` bytes from `row` requested into L2.
  static C10_ALWAYS_INLINE void request_row(const char* row, int64_t bytes) {
    for (int64_t c = 0; c < bytes; c += kLineBytes) {
      request_line(row + c);
    }
  }
  // One cache line requested into L2. Not __builtin_prefetch: GCC 12 takes a function whose only
  // effect is that builtin for a pure one and deletes the calls to it, and at_keys compiled to
  // nothing (the library held no prefetch instruction). An asm volatile statement is an effect it
  // keeps.
  static C10_ALWAYS_INLINE void request_line(const char* line) {
#if defined(__x86_64__) || defined(__i386__)
    asm volatile("prefetcht1 %0" : : "m"(*line));
#else
    __builtin_prefetch(line, /*rw=*/0, /*locality=*/2);
#endif
  }

 private:
  // The share of `rows` that keys [j, j + n) of `keys` stand for.
  void fetch_share(const Rows& rows, int64_t j, int64_t n) const {
    if (keys <= 0 || rows.count == 0) {
      return;
    }
    const int64_t begin = rows.count * j / keys;
    fetch(rows, begin, rows.count * std::min(j + n, keys) / keys - begin);
  }

  static void fetch(const Rows& rows, int64_t first, int64_t n) {
    for (int64_t i = first; i < std::min(first + n, rows.count); ++i) {
      fetch_row(rows, i);
    }
  }

  static C10_ALWAYS_INLINE void fetch_row(const Rows& rows, int64_t i) {
    request_row(rows.data + i * rows.stride_bytes, rows.row_bytes);
  }
};

// Vec::size() elements of src as acc_t: a bfloat16, float16 or 8-bit source is widened in
// registers.
template <typename acc_t, typename src_t>
inline at::vec::Vectorized<acc_t> load_as(const src_t* src) {
  using Vec = at::vec::Vectorized<acc_t>;
  if constexpr (std::is_same_v<acc_t, src_t>) {
    return Vec::loadu(src);
  } else if constexpr (is_eight_bit_v<src_t>) {
    return load_eight_bit(src);
  } else {
    Vec out;
    at::vec::load_to_float(src, out);
    return out;
  }
}

// kVecs consecutive vectors of elements from src as acc_t: 8-bit ones that widen in pairs
// (kWidensInPairs) two vectors at a time.
template <int64_t kVecs, typename acc_t, typename src_t>
C10_ALWAYS_INLINE void load_vectors_as(const src_t* src, at::vec::Vectorized<acc_t> (&out)[kVecs]) {
  constexpr int64_t N = at::vec::Vectorized<acc_t>::size();
  int64_t x = 0;
  if constexpr (std::is_same_v<acc_t, float> && kWidensInPairs<src_t>) {
#pragma GCC unroll 8
    for (; x + 2 <= kVecs; x += 2) {
      load_eight_bit_pair(src + x * N, out[x], out[x + 1]);
    }
  }
#pragma GCC unroll 16
  for (; x < kVecs; ++x) {
    out[x] = load_as<acc_t>(src + x * N);
  }
}

// The first `count` (< Vec::size()) elements of src as acc_t, the other lanes zero.
template <typename acc_t, typename src_t>
inline at::vec::Vectorized<acc_t> load_as(const src_t* src, int64_t count) {
  using Vec = at::vec::Vectorized<acc_t>;
  if constexpr (std::is_same_v<acc_t, src_t>) {
    return Vec::loadu(src, count);
  } else if constexpr (is_eight_bit_v<src_t>) {
    return load_eight_bit(src, count);
  } else {
    __at_align__ acc_t widened[Vec::size()] = {};
    std::copy_n(src, count, widened);
    return Vec::loadu(widened);
  }
}

// Lane i of the result is the sum of the lanes of acc[i], for i < Vec::size(). Fixed order, so
// the sums do not depend on anything but the inputs. float32 and int32 lanes (whose sums are
// exact) go through the same shuffles of their bits, added as their type adds.
template <typename acc_t>
C10_ALWAYS_INLINE at::vec::Vectorized<acc_t> lane_sums(const at::vec::Vectorized<acc_t>* acc) {
  using Vec = at::vec::Vectorized<acc_t>;
#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
  constexpr bool kInts = std::is_same_v<acc_t, int32_t>;
#endif
#if defined(CPU_CAPABILITY_AVX512)
  if constexpr (std::is_same_v<acc_t, float> || kInts) {
    const auto bits = [](const Vec& v) {
      if constexpr (kInts) {
        return _mm512_castsi512_ps(v);
      } else {
        return __m512(v);
      }
    };
    const auto add = [](__m512 a, __m512 b) {
      if constexpr (kInts) {
        return _mm512_castsi512_ps(
            _mm512_add_epi32(_mm512_castps_si512(a), _mm512_castps_si512(b)));
      } else {
        return _mm512_add_ps(a, b);
      }
    };
    // Three rounds, each adding two shuffles of pairs of vectors (in 128-bit lanes, then across
    // them) so that every round halves the vectors: 45 instructions in place of 256 scalar adds.
    __m512 pairs[8], quads[4];
    for (int i = 0; i < 8; ++i) {  // lane-wise halves of acc[2i] and acc[2i + 1], interleaved
      const __m512 a = bits(acc[2 * i]), b = bits(acc[2 * i + 1]);
      pairs[i] = add(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
    }
    for (int i = 0; i < 4; ++i) {  // each 128-bit lane: the lane's sums of acc[4i .. 4i + 3]
      const __m512d a = _mm512_castps_pd(pairs[2 * i]), b = _mm512_castps_pd(pairs[2 * i + 1]);
      quads[i] = add(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),  // moves pairs of lanes
                     _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
    }
    const __m512 q01 = add(_mm512_shuffle_f32x4(quads[0], quads[1], 0x44),
                           _mm512_shuffle_f32x4(quads[0], quads[1], 0xEE));
    const __m512 q23 = add(_mm512_shuffle_f32x4(quads[2], quads[3], 0x44),
                           _mm512_shuffle_f32x4(quads[2], quads[3], 0xEE));
    const __m512 sums =
        add(_mm512_shuffle_f32x4(q01, q23, 0x88), _mm512_shuffle_f32x4(q01, q23, 0xDD));
    if constexpr (kInts) {
      return Vec(_mm512_castps_si512(sums));
    } else {
      return Vec(sums);
    }
  }
#endif
#if defined(CPU_CAPABILITY_AVX2)
  if constexpr (std::is_same_v<acc_t, float>) {
    // Two rounds of pairwise adds leave the sums of the low halves in the low 128-bit lane and
    // of the high halves in the high lane; adding the lanes crosswise finishes all eight.
    const __m256 h01 = _mm256_hadd_ps(acc[0], acc[1]), h23 = _mm256_hadd_ps(acc[2], acc[3]);
    const __m256 h45 = _mm256_hadd_ps(acc[4], acc[5]), h67 = _mm256_hadd_ps(acc[6], acc[7]);
    const __m256 low = _mm256_hadd_ps(h01, h23), high = _mm256_hadd_ps(h45, h67);
    return _mm256_add_ps(_mm256_permute2f128_ps(low, high, 0x20),
                         _mm256_permute2f128_ps(low, high, 0x31));
  }
  if constexpr (kInts) {  // the same rounds in int32
    const __m256i h01 = _mm256_hadd_epi32(acc[0], acc[1]), h23 = _mm256_hadd_epi32(acc[2], acc[3]);
    const __m256i h45 = _mm256_hadd_epi32(acc[4], acc[5]), h67 = _mm256_hadd_epi32(acc[6], acc[7]);
    const __m256i low = _mm256_hadd_epi32(h01, h23), high = _mm256_hadd_epi32(h45, h67);
    return _mm256_add_epi32(_mm256_permute2x128_si256(low, high, 0x20),
                            _mm256_permute2x128_si256(low, high, 0x31));
  }
#endif
  constexpr int64_t N = Vec::size();
  __at_align__ acc_t lanes[N * N];
  __at_align__ acc_t sums[N];
  for (int64_t i = 0; i < N; ++i) {
    acc[i].store(lanes + i * N);
  }
  for (int64_t i = 0; i < N; ++i) {
    acc_t sum = 0;
    for (int64_t l = 0; l < N; ++l) {
      sum += lanes[i * N + l];
    }
    sums[i] = sum;
  }
  return Vec::loadu(sums);
}

// The rows of an operand read in place, in runs: rows [offset, offset + count) lie ld apart from
// `first`. A tensor's rows are one run, a paged cache's one a page or a stretch of pages in order
// (PagedRows::run_end).
template <typename T>
struct RowRun {
  int64_t offset, count;
  const T* first;
};
template <typename T>
struct RunRows {
  const RowRun<T>* runs = nullptr;  // by offset
  int64_t num_runs = 0;
  int64_t ld = 0;
  // Where given, one a run: the next block's value rows to request as each stretch is reached
  // (StreamAhead::value_requests).
  const StreamAhead* streams = nullptr;
  // With streams, the stretches are cut to at most this many rows, each asking for its share of
  // the next block's value rows before fn runs on it. A whole run's share at once (a page of 16
  // rows: 32-64 lines) came in a burst: on a Zen 5 the bfloat16 paged decode, whose values' pass
  // asks again for its 16-bit rows (kTwice), took 0.97 of its time from memory with the requests
  // spread and 0.94 in cache (docs/benchmarks, "Requests key by key").
  static constexpr int64_t kRequestRows = 4;

  // Calls fn(t, n, row) for each stretch [t, t + n) of rows [begin, end) that lies on one run
  // (of at most kRequestRows rows with streams), `row` the stretch's first, in order.
  template <typename Fn>
  void for_each_stretch(int64_t begin, int64_t end, const Fn& fn) const {
    for (int64_t i = 0; i < num_runs && runs[i].offset < end; ++i) {
      const RowRun<T>& run = runs[i];
      const int64_t from = std::max(begin, run.offset), to = std::min(end, run.offset + run.count);
      const int64_t longest = streams != nullptr ? kRequestRows : to - from;
      for (int64_t t = from; t < to; t += longest) {
        const int64_t n = std::min(longest, to - t);
        if (streams != nullptr) {
          streams[i].at_values(t - run.offset, n);
        }
        fn(t, n, run.first + (t - run.offset) * ld);
      }
    }
  }
};

// The steps of a register tile of rank-one updates, the one inner loop of both products:
//   acc[i][x] += sum over t < steps of a[i * lda + t] * b[t * ldb + x * Vec::size() ...]
// for kRows rows i and kVecs vectors of columns x. Each b vector loaded serves kRows rows, each
// broadcast a element kVecs vectors. (Scores: a = key rows, b = transposed query rows; values:
// a = probabilities, b = value rows, read in their own dtype.)
template <int64_t kRows, int64_t kVecs, typename acc_t, typename a_t, typename b_t>
inline void rank_one_steps(at::vec::Vectorized<acc_t> (&acc)[kRows][kVecs], const a_t* a,
                           int64_t lda, const b_t* b, int64_t ldb, int64_t steps) {
  using Vec = at::vec::Vectorized<acc_t>;
  for (int64_t t = 0; t < steps; ++t) {
    Vec columns[kVecs];
    load_vectors_as<kVecs>(b + t * ldb, columns);
#pragma GCC unroll 16
    for (int64_t i = 0; i < kRows; ++i) {
      const Vec scalar(static_cast<acc_t>(a[i * lda + t]));
#pragma GCC unroll 16
      for (int64_t x = 0; x < kVecs; ++x) {
        acc[i][x] = at::vec::fmadd(columns[x], scalar, acc[i][x]);
      }
    }
  }
}

// The tile's accumulators from c, and back to c.
template <int64_t kRows, int64_t kVecs, typename acc_t>
inline void load_tile(at::vec::Vectorized<acc_t> (&acc)[kRows][kVecs], const acc_t* c,
                      int64_t ldc) {
  using Vec = at::vec::Vectorized<acc_t>;
#pragma GCC unroll 16
  for (int64_t i = 0; i < kRows; ++i) {
#pragma GCC unroll 16
    for (int64_t x = 0; x < kVecs; ++x) {
      acc[i][x] = Vec::loadu(c + i * ldc + x * Vec::size());
    }
  }
}
template <int64_t kRows, int64_t kVecs, typename acc_t>
inline void store_tile(const at::vec::Vectorized<acc_t> (&acc)[kRows][kVecs], acc_t* c,
                       int64_t ldc) {
#pragma GCC unroll 16
  for (int64_t i = 0; i < kRows; ++i) {
#pragma GCC unroll 16
    for (int64_t x = 0; x < kVecs; ++x) {
      acc[i][x].store(c + i * ldc + x * at::vec::Vectorized<acc_t>::size());
    }
  }
}

// A register tile of rank-one updates:
//   c[i * ldc + x] = sum over t in [begin, end) of a[i * lda + t] * b[t * ldb + x]
// for kRows rows i and kVecs vectors of columns x.
template <int64_t kRows, int64_t kVecs, typename acc_t, typename a_t, typename b_t>
inline void rank_one_tile(const a_t* a, int64_t lda, const b_t* b, int64_t ldb, int64_t begin,
                          int64_t end, acc_t* c, int64_t ldc) {
  at::vec::Vectorized<acc_t> acc[kRows][kVecs];
#pragma GCC unroll 16
  for (int64_t i = 0; i < kRows; ++i) {
#pragma GCC unroll 16
    for (int64_t x = 0; x < kVecs; ++x) {
      acc[i][x] = at::vec::Vectorized<acc_t>(acc_t(0));
    }
  }
  rank_one_steps<kRows, kVecs>(acc, a + begin, lda, b + begin * ldb, ldb, end - begin);
  store_tile<kRows, kVecs>(acc, c, ldc);
}

// The same tile added to c, its b rows in runs (their columns from `col`): the accumulators stay
// in registers from one run to the next.
template <int64_t kRows, int64_t kVecs, typename acc_t, typename a_t, typename b_t>
inline void rank_one_tile_on_runs(const a_t* a, int64_t lda, const RunRows<b_t>& b, int64_t col,
                                  int64_t begin, int64_t end, acc_t* c, int64_t ldc) {
  at::vec::Vectorized<acc_t> acc[kRows][kVecs];
  load_tile<kRows, kVecs>(acc, c, ldc);
  b.for_each_stretch(begin, end, [&](int64_t t, int64_t n, const b_t* row) {
    rank_one_steps<kRows, kVecs>(acc, a + t, lda, row + col, b.ld, n);
  });
  store_tile<kRows, kVecs>(acc, c, ldc);
}

}  // namespace causal_attention::cpu::CPU_CAPABILITY
