// How the decode (kernels/decode.h) multiplies its few bfloat16 query rows by bfloat16 and
// float8 cache rows on this chip: by AVX-512 BF16's dot products of pairs (vdpbf16ps: the scores'
// query_key_pair_band in kernels/row_products.h, the values' kernels/float8_pair_values.h), or
// by float32 multiply-adds on the rows widened to float32 (the register tiles every chip has).
// Both meet the same accuracy rule (the pair values round each weight to bfloat16, as bfloat16's
// output rounds it); only speed decides, and the choice is fixed per chip and environment, so a
// machine's results stay bitwise the same run after run.
#pragma once

namespace causal_attention::cpu {

// Whether the decode takes the pair dots in the AVX-512 kernel build (the other builds never
// do). The CPU must have AVX-512 BF16 and AVX-512 VBMI (the float8 tables' byte permutes). Then
// the environment variable CAUSAL_ATTENTION_PAIR_DOTS, read once per process, decides: "auto"
// (the default) takes them on AMD's cores, where a vdpbf16ps adds two products a lane at the
// rate of a float32 multiply-add (Zen 4, Zen 5), and not on Intel's, where it runs at a quarter
// of that rate (measured on a Xeon with AMX: 16 independent vdpbf16ps took 4x the time of 16
// vfmadd231ps), so that its two products a lane cost twice the float32 ones (docs/benchmarks,
// "The decode's pair dots on an Intel Xeon with AMX"); "on" takes them wherever the CPU has them
// and "off" nowhere, which lets each chip's tests run the other chips' path. "on" on a CPU
// without them is a ValueError.
bool pair_dots_taken();

// How a bfloat16 decode made now multiplies (torch.ops.causal_attention.decode_products):
// "pairs" where the AVX-512 kernel build runs, bfloat16 products are native now
// (block_gemm.h) and pair_dots_taken(); else "float32".
const char* decode_products_in_use();

}  // namespace causal_attention::cpu
