#include "block_shapes.h"

#include <ATen/cpu/Utils.h>
#include <c10/util/Exception.h>

#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <optional>
#include <string>

namespace causal_attention::cpu {

int64_t cache_bytes(int name, int64_t fallback) {
  const long reported = sysconf(name);
  return reported > 0 ? int64_t(reported) : fallback;
}

namespace {

constexpr int64_t kShapeStep = 16;
constexpr int64_t kLargestShape = 1024;

// CAUSAL_ATTENTION_BLOCK_SHAPE, read once per process: the shape every call takes, or none for
// "auto" (or unset).
std::optional<BlockSizes> shape_from_environment() {
  static const std::optional<BlockSizes> shape = []() -> std::optional<BlockSizes> {
    const char* value = std::getenv("CAUSAL_ATTENTION_BLOCK_SHAPE");
    const std::string choice = value == nullptr ? "" : value;
    if (choice.empty() || choice == "auto") {
      return std::nullopt;
    }
    const auto valid = [](int64_t n) {
      return n >= kShapeStep && n <= kLargestShape && n % kShapeStep == 0;
    };
    const size_t by = choice.find('x');
    char* end = nullptr;
    BlockSizes forced{0, 0};
    if (by != std::string::npos) {
      forced.query_rows = std::strtoll(choice.c_str(), &end, 10);
      const bool rows_read = end == choice.c_str() + by;
      forced.keys = std::strtoll(choice.c_str() + by + 1, &end, 10);
      if (rows_read && *end == '\0' && valid(forced.query_rows) && valid(forced.keys)) {
        return forced;
      }
    }
    TORCH_CHECK_VALUE(false,
                      "CAUSAL_ATTENTION_BLOCK_SHAPE must be \"auto\" or \"QxK\" (query rows x "
                      "keys, each a multiple of ",
                      kShapeStep, " from ", kShapeStep, " to ", kLargestShape, "), got \"", choice,
                      "\"");
  }();
  return shape;
}

}  // namespace

bool products_on_tiles(at::ScalarType products) {
  static const bool amx_bf16 = [] {
    const auto capabilities = at::cpu::get_cpu_capabilities();
    const auto found = capabilities.find("amx_bf16");
    return found != capabilities.end() && found->second.isBool() && found->second.toBool();
  }();
  return products == at::kBFloat16 && amx_bf16;
}

// Longer key blocks amortize the softmax's per-block work (the row max, the correction of the
// running output) over more keys, but a product slows down once its operands outgrow the cache it
// runs from:
//   - products on vector units (float32, avx512_bf16, widened): 64 query rows by 128 keys where
//     the block's float32 K and V rows fit in twice L1d, else 64. Measured on Zen 3 (32 KiB L1d),
//     a 64 x 128 x 128 float32 product ran at 60 % of the rate of 64 x 64 x 128 or 64 x 128 x 64.
//     Where bfloat16 multiplies natively on vector units (avx512_bf16), longer: 256 keys, else
//     128, where the rows its products read fit in a quarter of L2 (K in bfloat16, 2 bytes a
//     value; V as the value pairs that P's (hi, lo) pairs multiply, 4) and a row sees more than
//     half such a block's keys, or, under a sliding window, its span is four such blocks' keys.
//     With 1 MiB of L2 that is 256 keys at D 64 and 128, 128 at D 256. On a Zen 5 (48 KiB L1d)
//     the float32 count gave 64 and 128 keys at D 128 and 64: longer blocks made forwards and
//     forwards+backwards faster at L 1024-4096, and sliding windows of 64-256 keys slower by up
//     to 40 %, from the keys a longer block computes past their span (docs/benchmarks/README.md,
//     stop 64); causal calls of L 128-512 forward 4-9 % faster (stop 65). Held then to twice L1d
//     (96 KiB there: 128 keys at D 128, where 256 ran within the drift, its forward a little
//     faster), on a Zen 4 (32 KiB L1d) the blocks stayed at 64 keys at D 128 and 128 at D 64;
//     256 keys made its bfloat16 B 4 calls 0.90-0.93 of their time forward and 0.92
//     forward+backward, and forwards at L 256-512, D 128 0.87-0.89 (stop 69). The others keep
//     the shapes measured for them: float32 and float16's native products (AVX512-FP16) were not
//     measured with longer blocks.
//   - products on AMX tiles: the tiles run from L2 at about the same rate for blocks of 32 to 512
//     (benchmarks.breakdown's probe on the AMX Xeon, unordered by size within its drift), so the
//     per-block work outside the products decides: 128 query rows by 256 keys, where the block's K
//     (bfloat16) and V (float32, for P V) rows fit in a quarter of L2 and a row sees keys enough
//     (1024) for blocks this long to waste little on the causal diagonal. Measured on the AMX Xeon
//     (2 MiB L2), bfloat16 grid at L 1024-4096 against the vector-unit shapes forced back with
//     CAUSAL_ATTENTION_BLOCK_SHAPE (docs/benchmarks/README.md): forward 0.95-1.34x as fast
//     (median 1.13), forward+backward 0.97-1.50x (median 1.10); at L 128-512 longer blocks gained
//     nothing. On another AMX Xeon (family 6 model 167 as its VM reports it, 2 MiB L2, stop 72)
//     they did at head dims of 64 from rows of 160 keys: forwards at L 160-512 took 0.83-0.98 of
//     their time and forwards+backwards 0.85-1.01 (B 1, H 8), so at D <= 64 the tiles take them
//     where the vector units' rule does (a row seeing more than half a block's keys, a window's
//     span four blocks'); at D 128 the backward at L 256-512 took 1.13x its time with them.
BlockSizes block_sizes(int64_t head_dim, int64_t value_dim, int64_t keys_seen, bool windowed,
                       at::ScalarType products) {
  if (const auto forced = shape_from_environment()) {
    return *forced;
  }
  static const int64_t l1d_bytes = cache_bytes(_SC_LEVEL1_DCACHE_SIZE, 32 * 1024);
  static const int64_t l2_bytes = cache_bytes(_SC_LEVEL2_CACHE_SIZE, 512 * 1024);
  // The bytes of a key block's K and V rows, K at key_bytes a value and V at 4 (float32, or the
  // value pairs that P's (hi, lo) pairs multiply).
  const auto block_bytes = [&](int64_t keys, int64_t key_bytes) {
    return keys * (head_dim * key_bytes + value_dim * 4);
  };
  // Where bfloat16's blocks run from L2 (on AMX tiles, or its longer blocks on vector units): a
  // quarter of it.
  const auto fit_l2 = [&](int64_t keys) { return block_bytes(keys, 2) <= l2_bytes / 4; };
  // Whether rows that see keys_seen keys gain from blocks of `keys`: a window's rows take key
  // blocks aligned before its start, each up to keys - 1 keys past it, so the span must be four
  // blocks long; other rows compute no key they do not see, and gain once they see more keys
  // than the half block that a block of half the length would hold whole.
  const auto longer_blocks_pay = [&](int64_t keys) {
    return windowed ? keys_seen >= 4 * keys : 2 * keys_seen > keys;
  };
  constexpr int64_t kTileKeys = 256;
  if (products_on_tiles(products) && fit_l2(kTileKeys) &&
      (keys_seen >= 4 * kTileKeys || (head_dim <= 64 && longer_blocks_pay(kTileKeys)))) {
    return {128, kTileKeys};
  }
  if (products == at::kBFloat16 && !products_on_tiles(products)) {
    for (const int64_t keys : {256, 128}) {
      if (fit_l2(keys) && longer_blocks_pay(keys)) {
        return {64, keys};
      }
    }
  }
  return {64, block_bytes(128, 4) <= 2 * l1d_bytes ? 128 : 64};
}

namespace {

// The L3 that CPU 0 shares, as sysfs describes its caches ("32768K"), else as sysconf reports it
// (16 MiB where neither does): glibc's sysconf gives the sum of a package's L3s on AMD EPYC (384
// MiB on a Zen 5 whose cores share 32 MiB each).
int64_t shared_l3_bytes() {
  for (int index = 0; index < 8; ++index) {
    const std::string cache = "/sys/devices/system/cpu/cpu0/cache/index" + std::to_string(index);
    std::ifstream level_file(cache + "/level"), size_file(cache + "/size");
    int level = 0;
    std::string size;
    if (level_file >> level && level == 3 && size_file >> size) {
      char* unit = nullptr;
      const long long count = std::strtoll(size.c_str(), &unit, 10);
      const int64_t scale = *unit == 'K' ? 1024 : *unit == 'M' ? 1024 * 1024 : 1;
      if (count > 0) {
        return int64_t(count) * scale;
      }
    }
  }
  return cache_bytes(_SC_LEVEL3_CACHE_SIZE, int64_t(16) << 20);
}

}  // namespace

int64_t packing_budget() {
  static const int64_t budget = [] {
    const char* value = std::getenv("CAUSAL_ATTENTION_PACKING_BYTES");
    if (value == nullptr || *value == '\0') {
      return shared_l3_bytes() / 2;
    }
    char* end = nullptr;
    const long long bytes = std::strtoll(value, &end, 10);
    TORCH_CHECK_VALUE(*end == '\0' && bytes > 0,
                      "CAUSAL_ATTENTION_PACKING_BYTES must be a positive number of bytes, got \"",
                      value, "\"");
    return int64_t(bytes);
  }();
  return budget;
}

}  // namespace causal_attention::cpu
