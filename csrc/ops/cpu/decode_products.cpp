#include "decode_products.h"

#include "block_gemm.h"

#include <ATen/Version.h>
#include <c10/util/Exception.h>

#include <cstdlib>
#include <string>

namespace causal_attention::cpu {

bool pair_dots_taken() {
  static const bool taken = [] {
    const bool cpu_has_them =
        __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512vbmi");
    const char* value = std::getenv("CAUSAL_ATTENTION_PAIR_DOTS");
    const std::string choice = value == nullptr || *value == '\0' ? "auto" : value;
    TORCH_CHECK_VALUE(choice == "auto" || choice == "on" || choice == "off",
                      "CAUSAL_ATTENTION_PAIR_DOTS must be \"auto\", \"on\" or \"off\", got \"",
                      choice, "\"");
    TORCH_CHECK_VALUE(choice != "on" || cpu_has_them,
                      "CAUSAL_ATTENTION_PAIR_DOTS=on: this CPU lacks AVX-512 BF16 or AVX-512 "
                      "VBMI, which the decode's pair dots need");
    if (choice == "auto") {
      return cpu_has_them && __builtin_cpu_is("amd");
    }
    return choice == "on";
  }();
  return taken;
}

const char* decode_products_in_use() {
  const bool pairs = at::get_cpu_capability() == "AVX512" && native_products_now(at::kBFloat16) &&
                     pair_dots_taken();
  return pairs ? "pairs" : "float32";
}

}  // namespace causal_attention::cpu
