"""CausalSelfAttention under context parallelism (set_context_parallel) on 2 real processes
(gloo, 127.0.0.1): its output and input gradient on each rank's shard, and the ranks' parameter
gradients summed, against the module on the whole sequence, for ring (zigzag) and Ulysses
(contiguous), with GQA, a sliding window, sinks and ALiBi in float64."""

import pytest
import torch

import causal_attention as ca
from attention_testing.ranks import run_ranks, whole_sequence
from causal_attention import distributed as cp

MODULE_OPTIONS = {"num_kv_heads": 2, "window": (23, 0), "sinks": True, "alibi": True,
                  "dtype": torch.float64}


def module_and_input(length: int = 64):
    torch.manual_seed(0)
    module = ca.CausalSelfAttention(32, 4, **MODULE_OPTIONS)
    with torch.no_grad():
        module.sinks.normal_()
    x = torch.randn(2, length, 32, dtype=torch.float64)
    return module, x, torch.randn_like(x)


def module_worker(rank: int, world: int, method: str, layout: str) -> dict:
    module, x, grad = module_and_input()
    module.set_context_parallel(torch.distributed.group.WORLD, method=method, layout=layout)
    shard = cp.shard_sequence(x, dim=1, layout=layout).requires_grad_()
    out = module(shard)
    out.backward(cp.shard_sequence(grad, dim=1, layout=layout))
    return {"out": out.detach(), "dx": shard.grad,
            "grads": {n: p.grad for n, p in module.named_parameters()}}


@pytest.mark.parametrize("method, layout", [("ring", "zigzag"), ("ulysses", "contiguous")])
def test_module_on_shards_equals_the_module_on_the_whole_sequence(tmp_path, method, layout):
    per_rank = run_ranks(2, module_worker, method, layout, out_dir=tmp_path)
    module, x, grad = module_and_input()
    x.requires_grad_()
    want = module(x)
    want.backward(grad)
    for name, whole in (("out", want), ("dx", x.grad)):
        got = whole_sequence([r[name] for r in per_rank], layout, dim=1)
        assert (got - whole).abs().max() < 1e-10, name
    for name, p in module.named_parameters():
        # Each rank's parameter gradients are its tokens' share: their sum is the whole's.
        total = sum(r["grads"][name] for r in per_rank)
        assert (total - p.grad).abs().max() < 1e-10, name
        assert p.grad.abs().max() > 0, name


def test_set_context_parallel_checks_its_arguments():
    module = ca.CausalSelfAttention(32, 4)
    with pytest.raises(ValueError, match="torch.distributed is not initialized"):
        module.set_context_parallel(object())
    assert module.set_context_parallel(None) is module and not module.context_parallel_on
