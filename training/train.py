"""Trains a small byte-level GPT (causal_attention.models.GPT) on the sources of Python's standard
library, with our attention op or, for comparison, torch's SDPA in the attention call.

    python -m training.train --out runs/ours                      # our attention
    python -m training.train --attention sdpa --out runs/sdpa     # the same run on SDPA
    python -m training.train --out runs/ours --resume --steps 400 --sample
    torchrun --nproc-per-node 2 -m training.train --ddp --out runs/ddp
    torchrun --nproc-per-node 2 -m training.train --context-parallel 2 --out runs/cp
    torchrun --nproc-per-node 4 -m training.train --ddp --context-parallel 2 --out runs/dp_cp
    torchrun --nproc-per-node 2 -m training.train --context-parallel 2 --pack-documents \
        --out runs/packed

Writes into --out: log.csv (step, loss, lr, tokens/s, elapsed), loss.png, checkpoint.pt (every
--checkpoint-every steps and at the end) and, with --sample, sample.txt. --resume continues from
checkpoint.pt: model, optimizer, RNG and data position are restored, so the resumed run's losses
equal an uninterrupted run's bit for bit. --batch-size is the global batch: with --ddp each of the
N processes takes 1/N of every batch, and the averaged gradients are the whole batch's.
--context-parallel C shards every sequence over C ranks (causal_attention.distributed: ring or
Ulysses attention, zigzag or contiguous shards), which train as one process does on the same
data; with --ddp the N processes form a 2-D mesh of N/C data-parallel groups of C.
--pack-documents trains on packed documents: each step one row of --batch-size x --seq-len bytes
cut where the corpus' files begin (and every --seq-len bytes), each document's positions from 0
and attending only to itself (varlen_attention; under --context-parallel the ring, all-gather
or Ulysses over cu_seqlens, each document in zigzag chunks); the loss is the mean over the row's bytes but
each document's last, whose next byte begins another document.
"""

import argparse
import os
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any, Dict, Iterator, List, NamedTuple, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.device_mesh import init_device_mesh
from tqdm import tqdm

from causal_attention.distributed import shard_sequence
from causal_attention.distributed.layout import _check_divisible
from causal_attention.models import GPT
from causal_attention.models.gpt import ATTENTION_MODULES

from .byte_corpus import (VOCAB_SIZE, PackedWindows, RandomWindows, decode, encode,
                          stdlib_source_bytes, stdlib_source_documents)
from .training_log import CsvLog, plot_losses, read_log

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}

# The flags that define what a run computes: resuming with any of them changed would not continue
# the same run, so --resume refuses. (--attention may change: the parameters are the same.)
RUN_FLAGS = ("seq_len", "batch_size", "embed_dim", "num_heads", "num_kv_heads", "num_layers",
             "lr", "warmup_steps", "dtype", "seed", "pack_documents")


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m training.train", description=__doc__,
        formatter_class=argparse.RawTextHelpFormatter,
    )
    p.add_argument("--attention", choices=sorted(ATTENTION_MODULES), default="causal_attention")
    p.add_argument("--out", type=Path, default=Path("runs/train"), help="output directory")
    p.add_argument("--steps", type=int, default=300, help="total optimizer steps")
    p.add_argument("--batch-size", type=int, default=8, help="global batch, in sequences")
    p.add_argument("--seq-len", type=int, default=256, help="bytes per sequence (= max_len)")
    p.add_argument("--embed-dim", type=int, default=128)
    p.add_argument("--num-heads", type=int, default=4)
    p.add_argument("--num-kv-heads", type=int, default=2, help="fewer than --num-heads: GQA")
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup-steps", type=int, default=20, help="linear learning-rate warmup")
    p.add_argument(
        "--dtype", choices=sorted(DTYPES), default="float32",
        help="bfloat16: autocast (mixed precision, float32 weights and optimizer)",
    )
    p.add_argument("--seed", type=int, default=0, help="model init, data order and sampling")
    p.add_argument("--compile", action="store_true", help="torch.compile(model, fullgraph=True)")
    p.add_argument("--checkpoint-every", type=int, default=100, help="0: only at the end")
    p.add_argument("--resume", action="store_true", help="continue from --out/checkpoint.pt")
    p.add_argument("--sample", action="store_true", help="after training, generate text")
    p.add_argument("--prompt", default="def ", help="what --sample continues")
    p.add_argument("--ddp", action="store_true", help="DistributedDataParallel (gloo); torchrun")
    p.add_argument("--context-parallel", type=int, default=1, metavar="C",
                   help="shard each sequence over C ranks (torchrun); with --ddp, N/C groups")
    p.add_argument("--context-parallel-method", choices=["ring", "ulysses", "allgather"],
                   default="ring")
    p.add_argument("--context-parallel-layout", choices=["zigzag", "contiguous"],
                   default="zigzag")
    p.add_argument("--pack-documents", action="store_true",
                   help="packed documents, positions restarted per document (no --ddp)")
    args = p.parse_args(argv)
    if args.pack_documents and (args.ddp or args.compile or args.attention != "causal_attention"):
        p.error("--pack-documents takes our attention, eager, alone or with --context-parallel, "
                "not --ddp, --compile or --attention sdpa")
    if args.steps < 0 or args.batch_size <= 0 or args.seq_len <= 0:
        p.error("--steps must be >= 0, --batch-size and --seq-len positive")
    if args.context_parallel < 1:
        p.error("--context-parallel must be >= 1")
    if args.context_parallel > 1 and args.compile:
        p.error("--compile traces no context-parallel attention (its ring runs in eager Python)")
    return args


def build_model(args: argparse.Namespace) -> GPT:
    """The GPT for these flags, initialized from --seed (identically on every DDP rank)."""
    torch.manual_seed(args.seed)
    return GPT(
        VOCAB_SIZE,
        args.seq_len,
        args.embed_dim,
        args.num_heads,
        args.num_layers,
        num_kv_heads=args.num_kv_heads,
        attention=args.attention,
    )


def distributed(args: argparse.Namespace) -> bool:
    return args.ddp or args.context_parallel > 1


def init_distributed(args: argparse.Namespace) -> Tuple[int, int]:
    """``(rank, world_size)``; with --ddp or --context-parallel, joins the gloo process group
    torchrun describes."""
    if not distributed(args):
        return 0, 1
    if "RANK" not in os.environ:
        raise SystemExit("--ddp and --context-parallel need torchrun's environment: "
                         "torchrun --nproc-per-node N ...")
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    cp = args.context_parallel
    if world % cp or (cp != world and not args.ddp):
        raise SystemExit(f"{world} processes: --context-parallel {cp} alone needs exactly {cp} "
                         f"processes, and with --ddp a multiple of {cp}")
    if args.batch_size % (world // cp):
        raise SystemExit(f"--batch-size {args.batch_size} must be a multiple of the "
                         f"{world // cp} data-parallel groups")
    return rank, world


class DataParallel(NamedTuple):
    """Where this rank's data comes from: its data-parallel group's share of the batch, and the
    shard of each sequence its context-parallel group gives it (mesh None without one)."""

    rank: int
    size: int
    mesh: Optional[Any] = None
    layout: str = "zigzag"

    def local(self, batch: Tensor) -> Tensor:
        batch = shard(batch, self.rank, self.size)
        if self.mesh is None:
            return batch
        return shard_sequence(batch, self.mesh["cp"], dim=1, layout=self.layout)

    def local_packed(self, row: Tensor, cu_seqlens: Tensor) -> Tensor:
        """This rank's tokens of a packed row (all of them without context parallelism)."""
        if self.mesh is None:
            return row
        return shard_sequence(row, self.mesh["cp"], dim=0, layout=self.layout,
                              cu_seqlens=cu_seqlens)


def context_parallel(args: argparse.Namespace, model: GPT, rank: int, world: int) -> DataParallel:
    """With --context-parallel, the (dp, cp) mesh, the model attending sharded sequences over its
    cp groups; else this rank's share of the batch."""
    cp = args.context_parallel
    if cp == 1:
        return DataParallel(rank, world)
    try:
        if not args.pack_documents:  # a packed row's documents are cut at any lengths
            _check_divisible("training.train", "--seq-len", args.seq_len, cp,
                             args.context_parallel_layout)
    except ValueError as error:
        raise SystemExit(str(error)) from None
    mesh = init_device_mesh("cpu", (world // cp, cp), mesh_dim_names=("dp", "cp"))
    model.set_context_parallel(mesh["cp"], method=args.context_parallel_method,
                               layout=args.context_parallel_layout)
    return DataParallel(mesh["dp"].get_local_rank(), world // cp, mesh,
                        args.context_parallel_layout)


def shard(batch: Tensor, rank: int, world: int) -> Tensor:
    """This rank's contiguous share of the global batch."""
    per_rank = batch.size(0) // world
    return batch[rank * per_rank : (rank + 1) * per_rank]


def lr_at(step: int, args: argparse.Namespace) -> float:
    """A function of the step only, so there is no scheduler state to checkpoint."""
    return args.lr * min(1.0, (step + 1) / max(1, args.warmup_steps))


def loss_on(model: nn.Module, inputs: Tensor, targets: Tensor, dtype: torch.dtype) -> Tensor:
    """Mean next-byte cross-entropy; the forward runs under bfloat16 autocast if asked."""
    with autocast(dtype):
        logits = model(inputs)
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def autocast(dtype: torch.dtype):
    return torch.autocast("cpu", dtype=dtype) if dtype != torch.float32 else nullcontext()


class PackedGPT(nn.Module):
    """The GPT's ``forward_packed`` as a module's forward, for DDP (whose hooks run there)."""

    def __init__(self, gpt: GPT):
        super().__init__()
        self.gpt = gpt

    def forward(self, tokens: Tensor, cu_seqlens: Tensor) -> Tensor:
        return self.gpt.forward_packed(tokens, cu_seqlens)


def packed_loss_on(model: nn.Module, data: DataParallel, batch, dtype: torch.dtype,
                   ranks: int) -> Tensor:
    """This rank's share of a packed row's mean next-byte cross-entropy: the sum over its
    tokens' counted targets over the row's count, times ``ranks``, so that the mean over the
    ranks (what DDP takes of the gradients, and the logged loss) is the row's mean."""
    inputs, targets, cu_seqlens = batch
    counted = int((targets != -100).sum())
    with autocast(dtype):
        logits = model(data.local_packed(inputs, cu_seqlens), cu_seqlens)
    local_targets = data.local_packed(targets, cu_seqlens)
    return F.cross_entropy(logits.float(), local_targets, ignore_index=-100,
                           reduction="sum") * (ranks / counted)


def save_checkpoint(path: Path, step: int, model, optimizer, batches, args) -> None:
    state = {
        "step": step,
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "torch_rng": torch.get_rng_state(),
        "data": batches.state_dict(),
        "run": {flag: getattr(args, flag) for flag in RUN_FLAGS},
    }
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)  # an interrupted save never leaves a torn checkpoint behind


def load_checkpoint(path: Path, model, optimizer, batches, args) -> int:
    """Restores everything a run's future depends on; returns the step to continue from."""
    if not path.exists():
        raise SystemExit(f"--resume: no checkpoint at {path}")
    state: Dict[str, Any] = torch.load(path, weights_only=True)
    changed = {f: (v, getattr(args, f)) for f, v in state["run"].items() if getattr(args, f) != v}
    if changed:
        raise SystemExit(
            "--resume: these flags differ from the checkpoint's run (checkpoint, now): "
            + ", ".join(f"--{f.replace('_', '-')} {a!r} vs {b!r}" for f, (a, b) in changed.items())
        )
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    torch.set_rng_state(state["torch_rng"])
    batches.load_state_dict(state["data"])
    return state["step"]


def train(args: argparse.Namespace) -> List[float]:
    """Runs training as the flags say; returns this invocation's per-step losses."""
    rank, world = init_distributed(args)
    dtype = DTYPES[args.dtype]
    model = build_model(args)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95))
    if args.pack_documents:
        batches = PackedWindows(*stdlib_source_documents(), args.batch_size, args.seq_len,
                                args.seed)
    else:
        batches = RandomWindows(stdlib_source_bytes(), args.batch_size, args.seq_len, args.seed)
    checkpoint = args.out / "checkpoint.pt"
    start = load_checkpoint(checkpoint, model, optimizer, batches, args) if args.resume else 0

    step_model: nn.Module = PackedGPT(model) if args.pack_documents else model
    if args.compile:
        step_model = torch.compile(step_model, fullgraph=True)
    data = context_parallel(args, model, rank, world)
    if distributed(args):
        # DDP's hooks sit on the parameters, so wrapping the compiled module keeps fullgraph.
        # Over every rank: each one's loss is the mean over its tokens (equal shards), and the
        # mean of their gradients is the whole batch's, context-parallel ranks included (their
        # backward already sent each shard's dK/dV home).
        step_model = nn.parallel.DistributedDataParallel(step_model)

    log = None
    if rank == 0:
        args.out.mkdir(parents=True, exist_ok=True)
        log = CsvLog(args.out / "log.csv", start)
    losses: List[float] = []
    tokens_per_step = args.batch_size * args.seq_len
    elapsed = log.elapsed_s if log is not None else 0.0
    model.train()
    progress = tqdm(
        range(start, args.steps), initial=start, total=args.steps, disable=rank != 0,
        desc=args.attention, unit="step", mininterval=1.0,
    )
    for step in progress:
        began = time.perf_counter()
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, args)
        if args.pack_documents:
            loss = packed_loss_on(step_model, data, batches.next(), dtype, world)
        else:
            inputs, targets = batches.next()
            loss = loss_on(step_model, data.local(inputs), data.local(targets), dtype)
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss = loss.detach()
        if world > 1:  # the logged loss is the whole batch's: the mean of equal shards' means
            dist.all_reduce(loss)
            loss /= world
        seconds = time.perf_counter() - began
        elapsed += seconds
        losses.append(loss.item())
        if log is not None:
            log.write(
                step=step + 1, loss=losses[-1], lr=lr_at(step, args),
                tokens_per_s=tokens_per_step / seconds, elapsed_s=elapsed,
            )
            progress.set_postfix(loss=f"{losses[-1]:.4f}", tok_s=f"{tokens_per_step / seconds:.0f}")
            if args.checkpoint_every and (step + 1) % args.checkpoint_every == 0:
                save_checkpoint(checkpoint, step + 1, model, optimizer, batches, args)
    progress.close()

    if log is not None:
        log.close()
        if args.steps > start:
            save_checkpoint(checkpoint, args.steps, model, optimizer, batches, args)
        title = f"byte-level GPT on the Python stdlib ({args.attention})"
        plot_losses({args.attention: read_log(args.out / "log.csv")}, args.out / "loss.png", title)
        if args.sample:
            model.set_context_parallel(None)
            text = sample(model, args)
            (args.out / "sample.txt").write_text(text)
            print(f"--- sample ---\n{text}\n--------------")
    if distributed(args):
        with leaving_process_groups():
            del step_model  # DDP's reducer, the default group's last holder
    return losses


@contextmanager
def leaving_process_groups() -> Iterator[None]:
    """Meets the other ranks and destroys the process groups; the last holders of a group (DDP's
    reducer) are to be freed in the block.

    Rank 0 writes the log, checkpoint and plot first: a rank that destroyed the group meanwhile
    was seen to hang in it after rank 0 had exited (gloo on loopback). And torch 2.13's gloo
    worker thread frees a collective's tensors after its wait() has returned, taking the GIL to
    do so, while a group's destructor joins its workers holding the GIL: the reducer freed as
    train() returned, just after the barrier, deadlocked 1 run in 4 on a 2-D mesh (the main
    thread in ~ProcessGroupGloo's join, the worker in ~AsyncBarrierWork's gil_scoped_acquire).
    The barrier's work, held here until the groups are gone, is not the worker's to free.
    """
    barrier = dist.barrier(async_op=True)
    barrier.wait()
    dist.destroy_process_group()
    yield
    del barrier


def sample(model: GPT, args: argparse.Namespace) -> str:
    """Continues --prompt up to --seq-len bytes, decoding with the attention modules' KV cache."""
    prompt = encode(args.prompt)[None, : args.seq_len - 1]
    model.eval()
    out = model.generate(
        prompt, args.seq_len - prompt.size(1), temperature=0.8, top_k=40,
        generator=torch.Generator().manual_seed(args.seed),
    )
    return decode(out[0])


def main(argv: Optional[List[str]] = None) -> List[float]:
    return train(parse_args(argv))


if __name__ == "__main__":
    main()
