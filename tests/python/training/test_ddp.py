"""DistributedDataParallel (gloo, 2 processes on 127.0.0.1) with training.train's model, data and
sharding: after backward both ranks hold the same gradients, equal to one process's gradients on
the whole batch; and `torchrun --nproc-per-node 2 -m training.train --ddp` trains as one process
does."""

import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from attention_testing.ranks import free_port
from training_testing import TINY_RUN, tiny_args, torchrun, train

WORLD = 2
BATCH = 4  # global; 2 sequences per rank


def first_batch(args):
    return train.RandomWindows(train.stdlib_source_bytes(), args.batch_size, args.seq_len, 0).next()


def gradients(model):
    return {name: p.grad.clone() for name, p in model.named_parameters()}


def ddp_worker(rank: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD
    )
    try:
        args = tiny_args("--batch-size", str(BATCH))
        model = train.build_model(args)
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        inputs, targets = first_batch(args)
        shard = [train.shard(t, rank, WORLD) for t in (inputs, targets)]
        train.loss_on(ddp, *shard, torch.float32).backward()
        torch.save(gradients(model), os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()
    # Leave without Python's teardown. Freeing the DDP reducer runs torch 2.13's
    # ProcessGroupGloo destructor, which joins the group's worker threads while holding the GIL,
    # and a worker still freeing its last work item waits for the GIL: a deadlock (seen once, in
    # a full test run: ~ProcessGroupGloo in std::thread::join, the worker in gil_scoped_acquire).
    # The gradients are saved and the group destroyed; an exception above still propagates.
    os._exit(0)


def test_ddp_gradients_equal_single_process_gradients_on_the_whole_batch(tmp_path):
    mp.spawn(ddp_worker, args=(free_port(), str(tmp_path)), nprocs=WORLD, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(WORLD)]

    args = tiny_args("--batch-size", str(BATCH))
    model = train.build_model(args)
    train.loss_on(model, *first_batch(args), torch.float32).backward()
    whole_batch = gradients(model)

    assert ranks[0].keys() == ranks[1].keys() == whole_batch.keys()
    for name, grad in whole_batch.items():
        assert torch.equal(ranks[0][name], ranks[1][name]), name
        # The mean of two half-batch means: the whole batch's gradient up to rounding.
        torch.testing.assert_close(ranks[0][name], grad, rtol=1e-5, atol=1e-7, msg=name)
        assert grad.abs().max() > 0, name


def test_torchrun_ddp_training_matches_one_process(tmp_path):
    flags = [*TINY_RUN, "--batch-size", str(BATCH), "--steps", "4"]
    ddp = torchrun(WORLD, ["--ddp", *flags], tmp_path / "ddp")
    single = train.main([*flags, "--out", str(tmp_path / "single")])
    assert len(ddp) == len(single) == 4
    torch.testing.assert_close(torch.tensor(ddp), torch.tensor(single), rtol=1e-5, atol=0)
