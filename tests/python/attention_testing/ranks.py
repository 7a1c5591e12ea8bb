"""Running a function on N real processes joined in a gloo process group on 127.0.0.1, bounded
in time: what the tests of context parallelism (and the training job's) need."""

import os
import socket
import time
from typing import Any, Callable, Dict, List, Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import Tensor

from causal_attention.distributed import shard_chunks


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, world: int, port: int, fn: Callable, args: Sequence[Any],
               out_dir: str, barrier: bool) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    try:
        result = fn(rank, world, *args)
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
        if not barrier:  # fn left a collective unfinished on purpose: leave the group as it is
            os._exit(0)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    # Leave without Python's teardown (see tests/python/training/test_ddp.py: torch 2.13's
    # ProcessGroupGloo destructor can deadlock on the GIL at exit).
    os._exit(0)


def run_ranks(world: int, fn: Callable, *args: Any, out_dir, timeout: float = 240,
              barrier: bool = True) -> list:
    """``[fn(rank, world, *args) for each rank]``, each run in its own process (one thread) of a
    gloo group of ``world`` ranks; ``fn`` must be importable (a module-level function) and return
    what torch.save takes. The ranks meet at a barrier before they leave, unless ``barrier`` is
    False (``fn`` leaves a collective unfinished). Raises if a rank fails or the group outlives
    ``timeout`` seconds."""
    context = mp.start_processes(_rank_main,
                                 args=(world, free_port(), fn, args, str(out_dir), barrier),
                                 nprocs=world, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout
    try:
        # join returns when a process exits (raising if it failed), or after the timeout.
        while not context.join(timeout=max(0.0, deadline - time.monotonic())):
            if time.monotonic() >= deadline:
                raise TimeoutError(f"the {world} ranks did not finish within {timeout} s")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
    return [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False)
            for r in range(world)]


def whole_sequence(shards: Sequence[Tensor], layout: str, dim: int) -> Tensor:
    """The whole sequence along ``dim`` from every rank's shard, in rank order."""
    world, length = len(shards), shards[0].shape[dim]
    shape = list(shards[0].shape)
    shape[dim] = length * world
    whole = shards[0].new_empty(shape)
    for rank, shard in enumerate(shards):
        for c in shard_chunks(length, rank, world, layout):
            whole.narrow(dim, c.position, c.length).copy_(shard.narrow(dim, c.start, c.length))
    return whole


def errors_of(calls: Dict[str, object]) -> dict:
    """What each call raised on this rank, (type name, message), or None."""
    errors = {}
    for name, call in calls.items():
        try:
            call()
            errors[name] = None
        except Exception as error:  # noqa: BLE001 - the test compares what each rank raised
            errors[name] = (type(error).__name__, str(error))
    return errors


def assert_every_rank_raised(per_rank: List[dict], expected: Dict[str, tuple]) -> None:
    """Each call named in ``expected`` raised its (type name, words of the message) on every
    rank, the same error on each."""
    for name, (kind, words) in expected.items():
        for rank, errors in enumerate(per_rank):
            assert errors[name] is not None, f"{name}: rank {rank} raised nothing"
            assert errors[name][0] == kind and words in errors[name][1], (name, errors[name])
        assert all(errors[name] == per_rank[0][name] for errors in per_rank), name
