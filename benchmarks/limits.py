"""The machine a run measures: the CPU, the block-product limit the kernels' shares are taken of
(the probe library built from block_gemm_probe.cpp and page_read_probe.cpp), and the bandwidth
of a large copy."""

import functools
import os
import platform
import subprocess
from pathlib import Path

import torch

import causal_attention  # noqa: F401  (the probe library links the op library: load it first)

from .cases import DTYPES, FULL, QUICK
from .timing import interleaved_median, timer

CPU_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16",
             "amx_fp16")
PROBE_LIBRARY = Path(__file__).with_name("libcausal_attention_bench_probe.so")


def cpu_environment():
    """lscpu's model line, the ISA flags that matter, torch's view of the CPU."""
    model = None
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        model = next((" ".join(line.split()) for line in lscpu.splitlines()
                      if line.startswith("Model name:")), None)
    except (OSError, subprocess.CalledProcessError):
        pass
    flags = set()
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if model is None and line.startswith("model name"):
                    model = "Model name: " + line.split(":", 1)[1].strip()
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    break
    except OSError:
        pass
    return {
        "cpu_model": model or platform.processor() or "unknown",
        "cpu_flags": {flag: flag in flags for flag in CPU_FLAGS},
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        # Which block products bfloat16/float16 calls use here ("native" oneDNN bf16/f16 dot
        # products, or "widened" to float32), and the caps that decided it.
        "block_products": {
            name: torch.ops.causal_attention.block_products(dtype)
            for name, dtype in (("bfloat16", torch.bfloat16), ("float16", torch.float16))
        },
        "onednn_max_cpu_isa": os.environ.get("ONEDNN_MAX_CPU_ISA"),
        "reduced_products_switch": os.environ.get("CAUSAL_ATTENTION_REDUCED_PRODUCTS"),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cores_available": len(os.sched_getaffinity(0)),
        "threads": torch.get_num_threads(),
    }


@functools.cache
def probe(name):
    """torch.ops.causal_attention_bench.<name>, from the probe library (block_gemm_probe.cpp,
    page_read_probe.cpp), loaded once."""
    if not PROBE_LIBRARY.exists():
        raise SystemExit(f"{PROBE_LIBRARY} is missing: configure CMake with "
                         "-DCAUSAL_ATTENTION_BUILD_BENCH_PROBE=ON and build (scripts/setup_env.sh "
                         "does)")
    torch.ops.load_library(str(PROBE_LIBRARY))
    return getattr(torch.ops.causal_attention_bench, name)


def page_reads(caches, table):
    """{prefetching: a call reading every byte of the pages the table lists of each cache, in the
    table's order}: without and with each next page requested into L2 (the faster of the two is
    the memory system's charge for that order). Pages of any dtype are read as float32 words."""
    read = probe("read_pages")
    words = [cache.view(torch.uint8).view(torch.float32) for cache in caches]

    def read_all(prefetch):
        return sum(read(cache, table, prefetch) for cache in words)

    return {prefetch: functools.partial(read_all, prefetch) for prefetch in (False, True)}


def block_gemm_gflops():
    """The block-product probe: GFLOP/s of the kernels' block product, every thread at once."""
    return probe("block_gemm_gflops")


def measure_limit(preset):
    """Aggregate GFLOP/s of the kernels' block product on cache-resident blocks, every thread at
    once: per dtype, the max over preset.limit_shapes (best of preset.limit_rounds)."""
    probe = block_gemm_gflops()
    limit, per_shape = {}, {}
    for name, dtype in DTYPES.items():
        per_shape[name] = {}
        for m, n, k in preset.limit_shapes:
            iterations = max(4, int(preset.limit_flops_per_thread / (2 * m * n * k)))
            per_shape[name][f"{m}x{n}x{k}"] = max(probe(dtype, m, n, k, iterations)
                                                  for _ in range(preset.limit_rounds))
        limit[name] = max(per_shape[name].values())
    return limit, per_shape


def block_product_gflops(quick) -> dict:
    """{dtype name: the chip's block-product rate} (GFLOP/s, every thread at once, the best over
    the preset's probe shapes): multiply-adds take at least their count over the rate of the
    dtype they are done in, however reads overlap them."""
    limit, _ = measure_limit(QUICK if quick else FULL)
    return limit


def measure_copy_bandwidth(preset, threads, rounds, min_run_time):
    """Bytes read + written per second by a large float32 Tensor.copy_."""
    numel = preset.copy_mib * 2**20 // 4
    src, dst = torch.ones(numel), torch.zeros(numel)
    seconds = interleaved_median({"copy": timer(lambda: dst.copy_(src), threads)}, rounds,
                                 min_run_time)["copy"]
    return 2 * src.nbytes / seconds / 1e9
