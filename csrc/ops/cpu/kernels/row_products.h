// Block products for a handful of query rows, as in decoding against a KV cache: the query rows
// against a block of key and value rows read in place, in registers, with no packed copy of K or
// V (bfloat16 and float16 rows are widened to float32 as they are loaded).
//
// The micro-kernel behind block_gemm wants its right-hand operand laid out for it (K_j^T, or
// VNNI pairs), and that repacking costs as much as the product itself when only a few query rows
// share a key block; with so few rows its register tiles also run mostly empty (measured: no
// faster than the code below at 8 or 16 rows). Here:
// - scores of fewer rows than a vector holds come from dot products, up to four rows by a few
//   keys at a time (each key vector loaded once for the four), their horizontal sums done
//   together (lane_sums); bfloat16 query rows against key rows bfloat16 holds exactly take
//   AVX-512 BF16's dot products of pairs where the CPU has them (query_key_pair_band), float8 rows
//   converted by byte tables;
// - scores of more rows are computed transposed, vectors of query rows against broadcast key
//   elements (Q given transposed, packed once per task), with no horizontal sums;
// - values are accumulated four query rows at a time, so each value vector loaded serves four
//   (this and the transposed scores share one register tile of rank-one updates);
// - the cache lines of the next steps are requested as the scores are computed (StreamAhead),
//   so that K and V stream in from memory behind the arithmetic.
//
// Included only by the per-instruction-set kernel sources (see geometry.h).
#pragma once

#include "../decode_products.h"
#include "register_tiles.h"
#include "schedule.h"

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

namespace causal_attention::cpu::CPU_CAPABILITY {

// q · k over `dim` elements.
template <typename acc_t, typename src_t>
inline acc_t dot(const acc_t* q, const src_t* k, int64_t dim) {
  using Vec = at::vec::Vectorized<acc_t>;
  Vec sum(acc_t(0));
  int64_t d = 0;
  for (; d + Vec::size() <= dim; d += Vec::size()) {
    sum = at::vec::fmadd(Vec::loadu(q + d), load_as<acc_t>(k + d), sum);
  }
  if (d < dim) {
    sum = at::vec::fmadd(Vec::loadu(q + d, dim - d), load_as<acc_t>(k + d, dim - d), sum);
  }
  return at::vec::vec_reduce_all<acc_t>([](Vec& a, Vec& b) { return a + b; }, sum);
}

// A tile's sums into scores (row i, key c at scores[i * ld_scores + c]): its accumulators
// acc[i * kKeys + c] reduced together by lane_sums.
template <int64_t kRows, int64_t kKeys, typename acc_t>
C10_ALWAYS_INLINE void store_tile_sums(const at::vec::Vectorized<acc_t>* acc, acc_t* scores,
                                       int64_t ld_scores) {
  __at_align__ acc_t sums[at::vec::Vectorized<acc_t>::size()];
  lane_sums(acc).store(sums);
#pragma GCC unroll 4
  for (int64_t i = 0; i < kRows; ++i) {
#pragma GCC unroll 16
    for (int64_t c = 0; c < kKeys; ++c) {
      scores[i * ld_scores + c] = sums[i * kKeys + c];
    }
  }
}

// One tile of query_key_scores: rows [0, kRows) against keys [0, kKeys) into scores, one
// accumulator a (row, key) pair, kRows * kKeys <= Vec::size() of them reduced together by
// lane_sums. Each key vector loaded (widened, for a key row of a reduced or 8-bit dtype) serves
// the kRows rows.
template <int64_t kRows, int64_t kKeys, typename acc_t, typename src_t>
C10_ALWAYS_INLINE void query_key_tile(const acc_t* q, int64_t ld_q, const src_t* k, int64_t ld_k,
                                      int64_t dim, acc_t* scores, int64_t ld_scores) {
  using Vec = at::vec::Vectorized<acc_t>;
  constexpr int64_t N = Vec::size();
  static_assert(kRows * kKeys <= N);
  Vec acc[N];  // acc[i * kKeys + c]: row i, key c; those past kRows * kKeys stay zero
#pragma GCC unroll 16
  for (int64_t i = 0; i < N; ++i) {
    acc[i] = Vec(acc_t(0));
  }
  // kParts vectors of the head dim from d, or a last `width` < N elements (kParts = 1). Key rows
  // that widen in pairs (kWidensInPairs) take two vectors a step; each sum adds the same
  // products in the same order either way.
  const auto step = [&](auto parts, int64_t d, int64_t width) {
    constexpr int64_t kParts = decltype(parts)::value;
    Vec keys[kKeys][kParts];
#pragma GCC unroll 16
    for (int64_t c = 0; c < kKeys; ++c) {
      if (width == kParts * N) {
        load_vectors_as<kParts>(k + c * ld_k + d, keys[c]);
      } else {
        keys[c][0] = load_as<acc_t>(k + c * ld_k + d, width);
      }
    }
#pragma GCC unroll 4
    for (int64_t i = 0; i < kRows; ++i) {
#pragma GCC unroll 2
      for (int64_t part = 0; part < kParts; ++part) {
        const acc_t* q_part = q + i * ld_q + d + part * N;
        const Vec qv = width == kParts * N ? Vec::loadu(q_part) : Vec::loadu(q_part, width);
#pragma GCC unroll 16
        for (int64_t c = 0; c < kKeys; ++c) {
          acc[i * kKeys + c] = at::vec::fmadd(keys[c][part], qv, acc[i * kKeys + c]);
        }
      }
    }
  };
  using One = std::integral_constant<int64_t, 1>;
  using Step = std::integral_constant<int64_t, kWidensInPairs<src_t> ? 2 : 1>;
  const int64_t full_dim = dim / N * N;
  int64_t d = 0;
  for (; d + Step::value * N <= full_dim; d += Step::value * N) {
    step(Step{}, d, Step::value * N);
  }
  for (; d < full_dim; d += N) {
    step(One{}, d, N);
  }
  if (full_dim < dim) {
    step(One{}, full_dim, dim - full_dim);
  }
  store_tile_sums<kRows, kKeys>(acc, scores, ld_scores);
}

// Calls band(std::integral_constant<int64_t, n>{}, r) for each band of four of `rows` rows from
// row r (n = 4, fewer for the last): the register tiles take their rows as a constant.
template <typename Band>
C10_ALWAYS_INLINE void in_bands_of_four(int64_t rows, const Band& band) {
  for (int64_t r = 0; r < rows; r += 4) {
    switch (std::min<int64_t>(4, rows - r)) {
      case 4:
        band(std::integral_constant<int64_t, 4>{}, r);
        break;
      case 3:
        band(std::integral_constant<int64_t, 3>{}, r);
        break;
      case 2:
        band(std::integral_constant<int64_t, 2>{}, r);
        break;
      default:
        band(std::integral_constant<int64_t, 1>{}, r);
    }
  }
}

// The keys a tile of a band of query_key_scores takes for kRows rows: as many as leaves no
// accumulator of the tile empty where kRows is a power of two (for three rows, those of four).
template <typename acc_t>
constexpr int64_t band_tile_keys(int64_t rows) {
  return std::max<int64_t>(1, at::vec::Vectorized<acc_t>::size() / (rows == 3 ? 4 : rows));
}

// Whether query_key_scores may score bfloat16 query rows against key rows of src_t with
// AVX-512 BF16's dot products of pairs (query_key_pair_band): key rows whose values bfloat16
// holds exactly (its own and the float8 ones; int8 rows are scored by integer products,
// integer_products.h), in the AVX-512 build, which asks at run time whether they pay
// (pair_dots_here).
template <typename acc_t, typename src_t>
inline constexpr bool kPairDots =
#if defined(CPU_CAPABILITY_AVX512)
    std::is_same_v<acc_t, float> &&
    (std::is_same_v<src_t, c10::BFloat16> || std::is_same_v<src_t, E4M3Over256> ||
     std::is_same_v<src_t, c10::Float8_e5m2>);
#else
    false;
#endif

// Whether the decode takes AVX-512 BF16's dot products of pairs (and AVX-512 VBMI's byte permutes,
// the float8 tables) in this kernel build: where the CPU has them and they pay on it
// (decode_products.h).
inline bool pair_dots_here() {
#if defined(CPU_CAPABILITY_AVX512)
  return pair_dots_taken();
#else
  return false;
#endif
}

// Whether query_key_pair_tile widens src_t's key rows to bfloat16 by byte tables, 64 values a
// step, in the order byte_pairs leaves them (order_query_pairs): the float8 formats', whose
// widening through float16 and then float32 takes 14-16 instructions a 64 values where the
// tables take 5 (e5m2 measured in cache with either: docs/benchmarks). bfloat16 rows are read as
// they are.
template <typename src_t>
inline constexpr bool kByTables =
    std::is_same_v<src_t, E4M3Over256> || std::is_same_v<src_t, c10::Float8_e5m2>;

// The head dims query_key_pair_band takes: whole steps of 64 for the float8 formats (the
// tables'), of 32 for bfloat16.
template <typename src_t>
inline bool pair_dots_fit(int64_t dim) {
  return dim % (kByTables<src_t> ? 64 : 32) == 0;
}

// A bfloat16 query row of `dim` elements in the order query_key_pair_tile's key vectors hold the
// head dim for src_t: as it is, or where kByTables each step of 64 as byte_pairs leaves it (the
// first vector the elements 0-7, 16-23, 32-39 and 48-55 of the step, the second the others).
template <typename src_t>
void order_query_pairs(const c10::BFloat16* q, int64_t dim, c10::BFloat16* out) {
  if (kByTables<src_t>) {
    for (int64_t d0 = 0; d0 < dim; d0 += 64) {
      for (int64_t half = 0; half < 2; ++half) {
        for (int64_t lane = 0; lane < 4; ++lane) {
          std::copy_n(q + d0 + lane * 16 + half * 8, 8, out + d0 + half * 32 + lane * 8);
        }
      }
    }
  } else {
    std::copy_n(q, dim, out);
  }
}

#if defined(CPU_CAPABILITY_AVX512)
#pragma GCC push_options
#pragma GCC target("avx512bf16,avx512vbmi")
// The value of src_t's byte of magnitude m (m < 128, the sign clear): a kByTables format's.
template <typename src_t>
float byte_value(uint8_t m) {
  if constexpr (std::is_same_v<src_t, E4M3Over256>) {
    return float(E4M3Over256(m));
  } else {
    return float(c10::Float8_e5m2(m, c10::Float8_e5m2::from_bits()));
  }
}

// The bfloat16 bits of src_t's values (kByTables) by the byte's magnitude (its low 7 bits):
// the high bytes (sign clear) in hi[0..1], the low bytes in lo[0..1], 64 magnitudes a vector.
// Exact: e4m3 has 4 significant bits, e5m2 3, and both exponent ranges lie within bfloat16's;
// e4m3's NaN magnitude and e5m2's infinity and NaNs give bfloat16's.
template <typename src_t>
struct BytePairTables {
  __m512i hi[2], lo[2];
  static BytePairTables get() {
    static const BytePairTables tables = [] {
      alignas(64) uint8_t hi_bytes[128], lo_bytes[128];
      for (int m = 0; m < 128; ++m) {
        const uint16_t bits = c10::BFloat16(byte_value<src_t>(uint8_t(m))).x;
        hi_bytes[m] = uint8_t(bits >> 8);
        lo_bytes[m] = uint8_t(bits & 0xFF);
      }
      BytePairTables t;
      for (int i = 0; i < 2; ++i) {
        t.hi[i] = _mm512_load_si512(hi_bytes + 64 * i);
        t.lo[i] = _mm512_load_si512(lo_bytes + 64 * i);
      }
      return t;
    }();
    return tables;
  }
};

// 64 bytes of src_t as two vectors of bfloat16 (their values, exactly): each byte's magnitude
// (its low 7 bits, the only ones the permutes read) looked up in the tables, its sign put back,
// the low and high bytes interleaved. out[0] holds the bytes 0-7 of each 16-byte lane, out[1]
// the bytes 8-15.
template <typename src_t>
C10_ALWAYS_INLINE void byte_pairs_of(__m512i bytes, const BytePairTables<src_t>& t,
                                     __m512bh (&out)[2]) {
  const __m512i lo = _mm512_permutex2var_epi8(t.lo[0], bytes, t.lo[1]);
  const __m512i hi_magnitude = _mm512_permutex2var_epi8(t.hi[0], bytes, t.hi[1]);
  // hi | (bytes & 0x80): the sign back on the high byte
  const __m512i hi =
      _mm512_ternarylogic_epi32(hi_magnitude, bytes, _mm512_set1_epi8(char(0x80)), 0xF8);
  out[0] = reinterpret_cast<__m512bh>(_mm512_unpacklo_epi8(lo, hi));
  out[1] = reinterpret_cast<__m512bh>(_mm512_unpackhi_epi8(lo, hi));
}

// byte_pairs_of the 64 bytes at src: in order_query_pairs' order.
template <typename src_t>
C10_ALWAYS_INLINE void byte_pairs(const src_t* src, const BytePairTables<src_t>& t,
                                  __m512bh (&out)[2]) {
  byte_pairs_of(_mm512_loadu_si512(src), t, out);
}

// query_key_tile for query rows in bfloat16 (q, ld_q apart, in order_query_pairs' order) and a
// head dim of whole steps (pair_dots_fit): each step by AVX-512 BF16's dot products of pairs, half
// the instructions of float32's multiply-adds, the key vectors converted to bfloat16 exactly (their
// values are bfloat16's, kPairDots): float8 rows by tables (kByTables), 64 values a step,
// bfloat16 rows as they are, 32 values a step. Each product is exact and each pair's two are added
// to the float32 sum one after the other, as two multiply-adds would, in another order than
// query_key_tile's (and bfloat16 subnormals taken as zero, as the native block products take
// them). With `stream`, each key (the block's key first_key + c) is told to the stream as its
// first vector is loaded (StreamAhead::at_key).
template <int64_t kRows, int64_t kKeys, typename src_t>
C10_ALWAYS_INLINE void query_key_pair_tile(const c10::BFloat16* q, int64_t ld_q, const src_t* k,
                                           int64_t ld_k, int64_t dim, float* scores,
                                           int64_t ld_scores, const BytePairTables<src_t>& tables,
                                           const StreamAhead* stream, int64_t first_key) {
  using Vec = at::vec::Vectorized<float>;
  constexpr int64_t N = Vec::size();
  constexpr bool kTables = kByTables<src_t>;
  constexpr int64_t kStep = kTables ? 64 : 2 * N;
  constexpr int64_t kParts = kStep / (2 * N);
  static_assert(kRows * kKeys <= N);
  Vec acc[N];
#pragma GCC unroll 16
  for (int64_t i = 0; i < N; ++i) {
    acc[i] = Vec(0.0f);
  }
  for (int64_t d = 0; d < dim; d += kStep) {
    if constexpr (kTables) {
      // key by key, each key's two vectors serving the rows at once (the tables' and the
      // accumulators' registers leave no room for every key's)
#pragma GCC unroll 16
      for (int64_t c = 0; c < kKeys; ++c) {
        if (stream != nullptr && d == 0) {
          stream->at_key(first_key + c);
        }
        __m512bh key[kParts];
        byte_pairs(k + c * ld_k + d, tables, key);
#pragma GCC unroll 4
        for (int64_t i = 0; i < kRows; ++i) {
#pragma GCC unroll 2
          for (int64_t part = 0; part < kParts; ++part) {
            const __m512bh qv =
                reinterpret_cast<__m512bh>(_mm512_loadu_si512(q + i * ld_q + d + part * 2 * N));
            acc[i * kKeys + c] = _mm512_dpbf16_ps(acc[i * kKeys + c], qv, key[part]);
          }
        }
      }
      continue;
    }
    __m512bh keys[kKeys];
#pragma GCC unroll 16
    for (int64_t c = 0; c < kKeys; ++c) {
      if (stream != nullptr && d == 0) {
        stream->at_key(first_key + c);
      }
      keys[c] = reinterpret_cast<__m512bh>(_mm512_loadu_si512(k + c * ld_k + d));
    }
#pragma GCC unroll 4
    for (int64_t i = 0; i < kRows; ++i) {
      const __m512bh qv = reinterpret_cast<__m512bh>(_mm512_loadu_si512(q + i * ld_q + d));
#pragma GCC unroll 16
      for (int64_t c = 0; c < kKeys; ++c) {
        acc[i * kKeys + c] = _mm512_dpbf16_ps(acc[i * kKeys + c], qv, keys[c]);
      }
    }
  }
  store_tile_sums<kRows, kKeys>(acc, scores, ld_scores);
}

// query_key_band by query_key_pair_tile, the keys past the last whole tile one at a time. (Its
// loop is query_key_band's: a helper taking the tiles as lambdas would call them out of line,
// as GCC inlines no function of this target into one without it.)
template <int64_t kRows, typename src_t>
void query_key_pair_band(const c10::BFloat16* q, int64_t ld_q, const src_t* k, int64_t ld_k,
                         int64_t cols, int64_t dim, float* scores, int64_t ld_scores,
                         const StreamAhead* stream) {
  constexpr int64_t kKeys = band_tile_keys<float>(kRows);
  BytePairTables<src_t> tables;  // in registers for the band (kByTables)
  if constexpr (kByTables<src_t>) {
    tables = BytePairTables<src_t>::get();
  }
  int64_t j = 0;
  for (; j + kKeys <= cols; j += kKeys) {
    query_key_pair_tile<kRows, kKeys>(q, ld_q, k + j * ld_k, ld_k, dim, scores + j, ld_scores,
                                      tables, stream, j);
  }
  if (stream != nullptr) {
    stream->at_keys(j, cols - j);
  }
  for (; j < cols; ++j) {
    query_key_pair_tile<kRows, 1>(q, ld_q, k + j * ld_k, ld_k, dim, scores + j, ld_scores, tables,
                                  nullptr, 0);
  }
}
#pragma GCC pop_options
#endif

// query_key_scores for kRows rows (at most four), band_tile_keys keys a tile; with `stream`,
// told of each tile's keys before it. Told key by key, as the pair tiles tell theirs, a float32
// paged decode with one query row a KV head (tiles of 16 keys) was slower from memory (6500ba9:
// 92.9 and 73.4 ms against 70.2 and 70.4 this way; docs/benchmarks, "Requests key by key").
template <int64_t kRows, typename acc_t, typename src_t>
inline void query_key_band(const acc_t* q, int64_t ld_q, const src_t* k, int64_t ld_k, int64_t cols,
                           int64_t dim, acc_t* scores, int64_t ld_scores,
                           const StreamAhead* stream) {
  constexpr int64_t kKeys = band_tile_keys<acc_t>(kRows);
  int64_t j = 0;
  for (; j + kKeys <= cols; j += kKeys) {
    if (stream != nullptr) {
      stream->at_keys(j, kKeys);
    }
    query_key_tile<kRows, kKeys>(q, ld_q, k + j * ld_k, ld_k, dim, scores + j, ld_scores);
  }
  if (stream != nullptr) {
    stream->at_keys(j, cols - j);
  }
  for (; j < cols; ++j) {
    for (int64_t r = 0; r < kRows; ++r) {
      scores[r * ld_scores + j] = dot(q + r * ld_q, k + j * ld_k, dim);
    }
  }
}

// scores[r * ld_scores + j] = q_r · k_j for r < rows, j < cols, where q_r = q + r * ld_q and
// k_j = k + j * ld_k each hold `dim` elements. For rows < Vec::size(): each key element then
// serves so few rows that K is read in its own dtype, with no converted copy, in tiles of four
// rows (fewer for the last) by a few keys, so that each key vector is loaded (and widened, for
// a reduced dtype) once for four rows, and the tile's sums reduced together. The first band
// tells the stream. Where q_pairs holds the same rows in bfloat16 (given only where kPairDots,
// pair_dots_here and pair_dots_fit(dim)), the bands are query_key_pair_band's.
template <typename acc_t, typename src_t>
void query_key_scores(const acc_t* q, const c10::BFloat16* q_pairs, int64_t ld_q, int64_t rows,
                      const src_t* k, int64_t ld_k, int64_t cols, int64_t dim, acc_t* scores,
                      int64_t ld_scores, const StreamAhead& stream) {
  in_bands_of_four(rows, [&](auto band_rows, int64_t r) {
    constexpr int64_t kRows = decltype(band_rows)::value;
    const StreamAhead* told = r == 0 ? &stream : nullptr;
#if defined(CPU_CAPABILITY_AVX512)
    if constexpr (kPairDots<acc_t, src_t>) {
      if (q_pairs != nullptr) {
        query_key_pair_band<kRows>(q_pairs + r * ld_q, ld_q, k, ld_k, cols, dim,
                                   scores + r * ld_scores, ld_scores, told);
        return;
      }
    }
#endif
    query_key_band<kRows>(q + r * ld_q, ld_q, k, ld_k, cols, dim, scores + r * ld_scores, ld_scores,
                          told);
  });
}

// A register tile sums a transposed score along the head dim in one chain of fused
// multiply-adds, whose rounding error grows with its length (with D = 128 it measured twice the
// error of a blocked sum, which a peaked softmax turns into twice the error of P): chunks of
// kShortScoreChain (schedule.h) are summed apart and added in order.
// scores_t tile (kKeys rows of kVecs vectors, from `scores`) = the q_t columns' products with
// kKeys key rows from `keys`, over the head dim in chunks of kShortScoreChain.
template <int64_t kKeys, int64_t kVecs, typename acc_t>
inline void key_query_tile(const acc_t* q_t, int64_t ld_qt, const acc_t* keys, int64_t ld_k,
                           int64_t dim, acc_t* scores, int64_t ld_st) {
  using Vec = at::vec::Vectorized<acc_t>;
  constexpr int64_t kWidth = kVecs * Vec::size();
  rank_one_tile<kKeys, kVecs>(keys, ld_k, q_t, ld_qt, 0, std::min(dim, kShortScoreChain), scores,
                              ld_st);
  for (int64_t d0 = kShortScoreChain; d0 < dim; d0 += kShortScoreChain) {
    __at_align__ acc_t chunk[kKeys * kWidth];
    rank_one_tile<kKeys, kVecs>(keys, ld_k, q_t, ld_qt, d0, std::min(dim, d0 + kShortScoreChain),
                                chunk, kWidth);
#pragma GCC unroll 16
    for (int64_t i = 0; i < kKeys; ++i) {
#pragma GCC unroll 16
      for (int64_t x = 0; x < kVecs; ++x) {
        acc_t* out = scores + i * ld_st + x * Vec::size();
        (Vec::loadu(out) + Vec::loadu(chunk + i * kWidth + x * Vec::size())).store(out);
      }
    }
  }
}

// One band of kVecs vectors of query rows of key_query_scores, kKeys keys a tile; with `stream`,
// told of each tile's keys.
template <int64_t kKeys, int64_t kVecs, typename acc_t>
inline void key_query_band(const acc_t* q_t, int64_t ld_qt, const acc_t* k, int64_t ld_k,
                           int64_t cols, int64_t dim, acc_t* scores_t, int64_t ld_st,
                           const StreamAhead* stream) {
  int64_t j = 0;
  for (; j + kKeys <= cols; j += kKeys) {
    if (stream != nullptr) {
      stream->at_keys(j, kKeys);
    }
    key_query_tile<kKeys, kVecs>(q_t, ld_qt, k + j * ld_k, ld_k, dim, scores_t + j * ld_st, ld_st);
  }
  if (stream != nullptr) {
    stream->at_keys(j, cols - j);
  }
  for (; j < cols; ++j) {
    key_query_tile<1, kVecs>(q_t, ld_qt, k + j * ld_k, ld_k, dim, scores_t + j * ld_st, ld_st);
  }
}

// scores_t[j * ld_st + r] = q_r · k_j for r < padded_rows and j < cols, with the query rows
// given transposed: q_t[d * ld_qt + r], padded_rows a multiple of Vec::size() (zero rows past
// the real ones), k_j = k + j * ld_k.
template <typename acc_t>
void key_query_scores(const acc_t* q_t, int64_t ld_qt, int64_t padded_rows, const acc_t* k,
                      int64_t ld_k, int64_t cols, int64_t dim, acc_t* scores_t, int64_t ld_st,
                      const StreamAhead& stream) {
  constexpr int64_t N = at::vec::Vectorized<acc_t>::size();
  int64_t r = 0;
  // Two vectors of rows against four keys: eight accumulators, and six loads per eight FMAs;
  // a last single vector of rows against eight keys. The first band tells the stream.
  for (; r + 2 * N <= padded_rows; r += 2 * N) {
    key_query_band<4, 2>(q_t + r, ld_qt, k, ld_k, cols, dim, scores_t + r, ld_st,
                         r == 0 ? &stream : nullptr);
  }
  for (; r < padded_rows; r += N) {
    key_query_band<8, 1>(q_t + r, ld_qt, k, ld_k, cols, dim, scores_t + r, ld_st,
                         r == 0 ? &stream : nullptr);
  }
}

// out[c] += sum over j in [begin, end) of p[j] * v_j[c] for first_col <= c < dim_v, v_j value
// row j: the columns past the last whole vector, one at a time.
template <typename acc_t, typename src_t>
inline void accumulate_tail_columns(const acc_t* p, int64_t begin, int64_t end,
                                    const RunRows<src_t>& v, int64_t first_col, int64_t dim_v,
                                    acc_t* out) {
  for (int64_t c = first_col; c < dim_v; ++c) {
    acc_t sum = out[c];
    v.for_each_stretch(begin, end, [&](int64_t t, int64_t n, const src_t* row) {
      for (int64_t j = 0; j < n; ++j) {
        sum += p[t + j] * static_cast<acc_t>(row[j * v.ld + c]);
      }
    });
    out[c] = sum;
  }
}

// out[c] += sum over j in [begin, end) of p[j] * v_j[c] for c < dim_v: one row, for the keys
// only some rows of a tile see, and for the rows past the last whole tile.
template <typename acc_t, typename src_t>
inline void accumulate_one_row(const acc_t* p, int64_t begin, int64_t end, const RunRows<src_t>& v,
                               int64_t dim_v, acc_t* out) {
  if (begin >= end) {  // as most calls of a tile's rows are: no output row to load and store
    return;
  }
  constexpr int64_t N = at::vec::Vectorized<acc_t>::size();
  int64_t c = 0;
  for (; c + 8 * N <= dim_v; c += 8 * N) {
    rank_one_tile_on_runs<1, 8>(p, 0, v, c, begin, end, out + c, 0);
  }
  for (; c + N <= dim_v; c += N) {
    rank_one_tile_on_runs<1, 1>(p, 0, v, c, begin, end, out + c, 0);
  }
  accumulate_tail_columns(p, begin, end, v, c, dim_v, out);
}

// The rows of accumulate_weighted_values' register tiles.
inline constexpr int64_t kValueTileRows = 4;

// out[r * ld_out + c] += sum over j in [first[r], visible[r]) of p[r * ld_p + j] * v_j[c], for
// r < rows and c < dim_v, v_j value row j of `v`'s runs (rows no run holds are left out). A row
// reads only the value rows it sees, so a non-finite value row never reaches a query row the
// mask hides it from.
template <typename acc_t, typename src_t>
void accumulate_weighted_values(const acc_t* p, int64_t ld_p, int64_t rows, const int64_t* first,
                                const int64_t* visible, const RunRows<src_t>& v, int64_t dim_v,
                                acc_t* out, int64_t ld_out) {
  // Four rows by four vectors where 32 vector registers hold the sixteen accumulators (AVX-512):
  // eight loads per sixteen FMAs, and a value row's lines read in two passes, not four (with the
  // L1 requests of V dropped at the same time, register_tiles.h, the decode's arithmetic ran
  // 7-10 % faster in every dtype on Zen 4: docs/benchmarks, "8-bit KV caches"). Four by two with 16
  // registers (AVX2): eight accumulators, six loads per eight FMAs (measured faster there than one
  // by eight, two by four and three by four).
  constexpr int64_t kRows = kValueTileRows;
#if defined(CPU_CAPABILITY_AVX512)
  constexpr int64_t kVecs = 4;
#else
  constexpr int64_t kVecs = 2;
#endif
  constexpr int64_t N = at::vec::Vectorized<acc_t>::size();
  // v's streams (the next block's value rows) are requested by the first tile's pass alone.
  RunRows<src_t> quiet = v;
  quiet.streams = nullptr;
  int64_t r = 0;
  for (; r + kRows <= rows; r += kRows) {
    // The keys every row of the tile sees go through the tile; the rest row by row.
    const int64_t shared_begin = *std::max_element(first + r, first + r + kRows);
    const int64_t shared_end =
        std::max(shared_begin, *std::min_element(visible + r, visible + r + kRows));
    const acc_t* weights = p + r * ld_p;
    acc_t* out_rows = out + r * ld_out;
    int64_t c = 0;
    for (; c + kVecs * N <= dim_v; c += kVecs * N) {
      rank_one_tile_on_runs<kRows, kVecs>(weights, ld_p, r == 0 && c == 0 ? v : quiet, c,
                                          shared_begin, shared_end, out_rows + c, ld_out);
    }
    for (; c + N <= dim_v; c += N) {
      rank_one_tile_on_runs<kRows, 1>(weights, ld_p, r == 0 && c == 0 ? v : quiet, c, shared_begin,
                                      shared_end, out_rows + c, ld_out);
    }
    for (int64_t i = r; i < r + kRows; ++i) {
      const acc_t* row_p = p + i * ld_p;
      acc_t* row_out = out + i * ld_out;
      accumulate_tail_columns(row_p, shared_begin, shared_end, quiet, c, dim_v, row_out);
      accumulate_one_row(row_p, first[i], std::min(shared_begin, visible[i]), quiet, dim_v,
                         row_out);
      accumulate_one_row(row_p, std::max(shared_end, first[i]), visible[i], quiet, dim_v, row_out);
    }
  }
  for (; r < rows; ++r) {
    accumulate_one_row(p + r * ld_p, first[r], visible[r], quiet, dim_v, out + r * ld_out);
  }
}

}  // namespace causal_attention::cpu::CPU_CAPABILITY
