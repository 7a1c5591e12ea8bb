"""Context parallelism on this machine: N ranks (gloo over loopback, one thread each, each its own
process) running ring and Ulysses attention (causal_attention.distributed) on one sequence of
--seq-len tokens, against one process with N threads running the op on the whole sequence.

Sections (--only):
  memory   the peak memory a forward+backward adds to a process (its VmHWM above its VmRSS
           before the call, the inputs and the output's gradient already allocated, after one
           warm-up call), per rank against the one process
  time     forward+backward wall time, the median over --rounds (each round the slowest rank),
           against the one process at N threads
  bytes    bytes each rank sends in a forward+backward, measured at the socket (the wchar of
           /proc/self/io: gloo writes with writev), per ring step and against the formula
  balance  each rank's CPU time of a causal forward+backward (its main thread, time.thread_time)
           and its exact (query, key) pairs, zigzag against contiguous, at --balance-world ranks

Every process is started fresh (so that its peak memory is its own); in the memory section with
MALLOC_MMAP_THRESHOLD_ fixed at 128 KiB, so that freed tensors leave the resident set.

With --packed, the sequence is a packed batch of documents of seeded random lengths in
--doc-lengths (the last one cut to fill --seq-len), each causal by itself: ring and all-gather
attention in the per-document zigzag and the contiguous layouts and Ulysses, against one process
running varlen_attention on the whole batch; the balance section gives each rank's share of the
batch's causal (query, key) pairs.

    python -m benchmarks.context_parallel                      # L=16384, B=1, H=8, D=64 (minutes)
    python -m benchmarks.context_parallel --quick --out /tmp/cp.json     # seconds
    python -m benchmarks.context_parallel --packed --only memory time balance
"""

import argparse
import json
import os
import socket
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import causal_attention as ca
from causal_attention import distributed as cp

from .proc import cpu_name, status_kib, write_report

SECTIONS = ("memory", "time", "bytes", "balance")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
MALLOC_MMAP_THRESHOLD = str(128 * 1024)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="seconds-long run of every path")
    parser.add_argument("--only", nargs="+", choices=SECTIONS, default=list(SECTIONS))
    parser.add_argument("--world", type=int, default=2, help="N, the ranks")
    parser.add_argument("--balance-world", type=int, default=4, help="N of the balance section")
    parser.add_argument("--seq-len", type=int, default=16384)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=None, help="default: --heads")
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--dtype", choices=list(DTYPES), default="float32")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--packed", action="store_true",
                        help="a packed batch of documents (cu_seqlens) instead of one sequence")
    parser.add_argument("--doc-lengths", type=int, nargs=2, default=(512, 4096),
                        metavar=("MIN", "MAX"), help="--packed: the documents' lengths")
    parser.add_argument("--doc-seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("bench_out/context_parallel.json"))
    args = parser.parse_args(argv)
    if args.quick:
        args.seq_len, args.heads, args.rounds, args.balance_world = 512, 2, 1, 2
    args.kv_heads = args.kv_heads or args.heads
    if args.packed and "bytes" in args.only:
        parser.error("--packed: the bytes section's formula is the dense ring's; use --only")
    return args


def cu_seqlens(args) -> torch.Tensor:
    """The packed batch's document boundaries: seeded lengths in --doc-lengths, the last one cut
    where the batch ends."""
    g = torch.Generator().manual_seed(args.doc_seed)
    low, high = args.doc_lengths
    bounds = [0]
    while bounds[-1] < args.seq_len:
        length = int(torch.randint(low, high + 1, (), generator=g))
        bounds.append(min(bounds[-1] + length, args.seq_len))
    return torch.tensor(bounds, dtype=torch.int32)


def methods(args) -> list:
    """The (method, layout) pairs the sections compare with one process."""
    if args.packed:
        return [("ring", "zigzag"), ("ring", "contiguous"), ("allgather", "zigzag"),
                ("allgather", "contiguous"), ("ulysses", "zigzag")]
    return [("ring", "zigzag"), ("ulysses", "zigzag")]


def label(args, method: str, layout: str) -> str:
    """A method's key in the report: its name, with its layout where --packed compares two."""
    return f"{method} ({layout})" if args.packed else method


# --- in a process -----------------------------------------------------------------------------


def inputs(args, length: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    dtype = DTYPES[args.dtype]
    shape = (args.batch, args.heads, length, args.head_dim)
    kv_shape = (args.batch, args.kv_heads, length, args.head_dim)
    if args.packed:  # varlen_attention's (tokens, H, D)
        shape = (length, args.heads, args.head_dim)
        kv_shape = (length, args.kv_heads, args.head_dim)
    q, k, v = (torch.randn(s, generator=g).to(dtype).requires_grad_()
               for s in (shape, kv_shape, kv_shape))
    return q, k, v, torch.randn(shape, generator=g).to(dtype)



def bytes_written() -> int:
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("wchar:")).split()[1])


def forward_backward(method: str, layout: str, q, k, v, grad_out, cu=None) -> None:
    if method == "single" and cu is not None:
        longest = int(cu.diff().max())
        out = ca.varlen_attention(q, k, v, cu, cu, longest, longest)
    elif method == "single":
        out = ca.attention(q, k, v)
    else:
        attend = {"ring": cp.ring_attention, "ulysses": cp.ulysses_attention,
                  "allgather": cp.allgather_attention}[method]
        out = attend(q, k, v, layout=layout, **({} if cu is None else {"cu_seqlens": cu}))
    out.backward(grad_out)
    q.grad = k.grad = v.grad = None


def measure(args, method: str, layout: str, section: str) -> dict:
    """One process's measurement: this rank's shard (the whole sequence for "single")."""
    whole = inputs(args, args.seq_len)
    cu = cu_seqlens(args) if args.packed else None
    if method == "single":
        tensors = list(whole)
    else:
        tensors = [cp.shard_sequence(t.detach(), layout=layout, cu_seqlens=cu) for t in whole]
        tensors = [t.requires_grad_(i < 3) for i, t in enumerate(tensors)]
    del whole
    tensors.append(cu)
    barrier = dist.barrier if method != "single" else (lambda: None)
    if section == "memory":
        # Warmed up as a training step is: gloo's connections and oneDNN's kernels are made
        # once, not per call.
        forward_backward(method, layout, *tensors)
        barrier()
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current VmRSS
        before = status_kib("VmRSS")
        forward_backward(method, layout, *tensors)
        return {"peak_added_mib": (status_kib("VmHWM") - before) / 1024}
    if section == "bytes":
        forward_backward(method, layout, *tensors)  # warm-up: the gloo pairs connect
        barrier()
        before = bytes_written()
        forward_backward(method, layout, *tensors)
        return {"bytes": bytes_written() - before}
    if section == "balance":
        forward_backward(method, layout, *tensors)
        barrier()
        began = time.thread_time()
        forward_backward(method, layout, *tensors)
        return {"cpu_s": time.thread_time() - began}
    forward_backward(method, layout, *tensors)
    seconds = []
    for _ in range(args.rounds):
        barrier()
        began = time.perf_counter()
        forward_backward(method, layout, *tensors)
        seconds.append(time.perf_counter() - began)
    return {"seconds": seconds}


def _process(rank: int, world: int, port: int, args, method: str, layout: str, section: str,
             out_dir: str) -> None:
    torch.set_num_threads(args.world if method == "single" else 1)
    if method != "single":
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world)
    result = measure(args, method, layout, section)
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    if method != "single":
        dist.barrier()
        dist.destroy_process_group()
    os._exit(0)  # no interpreter teardown (see tests/python/training/test_ddp.py)


def run(args, method: str, layout: str, section: str, world: int, out_dir: Path) -> list:
    """The measurement on ``world`` fresh processes (1 for "single"), one result each."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    processes = 1 if method == "single" else world
    # Only the memory section: a fresh mapping per large tensor costs page faults in the others.
    if section == "memory":
        os.environ["MALLOC_MMAP_THRESHOLD_"] = MALLOC_MMAP_THRESHOLD
    else:
        os.environ.pop("MALLOC_MMAP_THRESHOLD_", None)
    mp.start_processes(_process, args=(processes, port, args, method, layout, section,
                                       str(out_dir)), nprocs=processes, start_method="spawn")
    return [torch.load(out_dir / f"rank{r}.pt") for r in range(processes)]


# --- the sections -----------------------------------------------------------------------------


def element_bytes(args) -> int:
    return torch.empty(0, dtype=DTYPES[args.dtype]).element_size()


def formula_bytes(args, method: str, world: int) -> dict:
    """What a rank sends in a causal forward+backward, by the algorithm."""
    shard = args.seq_len // world
    kv = 2 * args.batch * args.kv_heads * shard * args.head_dim * element_bytes(args)
    kv_acc = 2 * args.batch * args.kv_heads * shard * args.head_dim * 4  # dK, dV in float32
    if method == "ring":
        steps = world  # causal: every step runs
        forward = (steps - 1) * kv
        backward = (steps - 1) * kv + steps * kv_acc
        return {"forward": forward, "backward": backward, "steps": steps,
                "per_step": (forward + backward) / steps}
    # Ulysses: q, k, v in and out back, each all-to-all keeps 1/N of the tensor at home.
    q = args.batch * args.heads * shard * args.head_dim * element_bytes(args)
    moved = (2 * q + kv) * (world - 1) // world
    return {"forward": moved, "backward": moved, "steps": 1, "per_step": 2 * moved}


def ratio(part: float, whole: float):
    """part / whole, or None where whole is no figure to divide by (the quick run's memory: a
    call that adds nothing the kernel counts)."""
    return part / whole if whole > 0 else None


def section_memory(args, scratch: Path) -> dict:
    single = run(args, "single", "zigzag", "memory", 1, scratch)[0]["peak_added_mib"]
    result = {"single_mib": single}
    for method, layout in methods(args):
        ranks = [r["peak_added_mib"] for r in run(args, method, layout, "memory", args.world,
                                                  scratch)]
        result[label(args, method, layout)] = {"per_rank_mib": ranks,
                                               "ratio_to_single": ratio(max(ranks), single)}
    return result


def section_time(args, scratch: Path) -> dict:
    single = statistics.median(run(args, "single", "zigzag", "time", 1, scratch)[0]["seconds"])
    result = {"single_s": single}
    for method, layout in methods(args):
        ranks = run(args, method, layout, "time", args.world, scratch)
        slowest = [max(r["seconds"][i] for r in ranks) for i in range(args.rounds)]
        median = statistics.median(slowest)
        result[label(args, method, layout)] = {"median_s": median,
                                               "ratio_to_single": median / single}
    return result


def section_bytes(args, scratch: Path) -> dict:
    result = {}
    for method in ("ring", "ulysses"):
        ranks = [r["bytes"] for r in run(args, method, "zigzag", "bytes", args.world, scratch)]
        formula = formula_bytes(args, method, args.world)
        total = formula["forward"] + formula["backward"]
        result[method] = {"measured_per_rank": ranks, "formula_per_rank": total,
                          "measured_per_step": max(ranks) / formula["steps"],
                          "formula_per_step": formula["per_step"],
                          "ratio_measured_to_formula": max(ranks) / total}
    return result


def causal_pairs(args, world: int, layout: str) -> list:
    """Each rank's causal (query, key) pairs: a row sees the keys of its document up to itself."""
    bounds = tuple(cu_seqlens(args).tolist()) if args.packed else None
    sharding = cp.Sharding(args.seq_len, world, layout, bounds)
    return [sum(c.length * c.position + c.length * (c.length + 1) // 2
                for c in sharding.chunks(rank)) for rank in range(world)]


def section_balance(args, scratch: Path) -> dict:
    result = {}
    world = args.balance_world
    for layout in ("zigzag", "contiguous"):
        cpu = [r["cpu_s"] for r in run(args, "ring", layout, "balance", world, scratch)]
        pairs = causal_pairs(args, world, layout)
        result[layout] = {"cpu_s_per_rank": cpu, "busiest_over_least_cpu": max(cpu) / min(cpu),
                          "pairs_per_rank": pairs, "busiest_over_least_pairs":
                          max(pairs) / min(pairs),
                          "share_of_pairs_per_rank": [p / sum(pairs) for p in pairs]}
        if args.packed and world != args.world:
            pairs = causal_pairs(args, args.world, layout)
            result[layout][f"share_of_pairs_per_rank_at_{args.world}"] = [
                p / sum(pairs) for p in pairs]
    return result


def main(argv=None) -> dict:
    args = parse_args(argv)
    report = {"config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
              "cpu": cpu_name()}
    if args.packed:
        report["documents"] = cu_seqlens(args).diff().tolist()
    with tempfile.TemporaryDirectory() as scratch:  # where the processes leave their results
        for section in args.only:
            report[section] = globals()[f"section_{section}"](args, Path(scratch))
            print(section, json.dumps(report[section], indent=1))
    write_report(args.out, report)
    return report


if __name__ == "__main__":
    main()
