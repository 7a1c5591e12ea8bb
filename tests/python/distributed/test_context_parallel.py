"""Context parallelism on real processes (gloo on 127.0.0.1): ring attention (zigzag and
contiguous), Ulysses and all-gather attention on 2 and 4 ranks, outputs and every gradient
against the single-process op on the unsharded tensors (float64 within 1e-10; other dtypes
within twice the single-process op's own error against float64, the ring's and the
all-gather's gradients within 1.2x), bitwise the same on a second run at another thread count;
the zigzag layout's balance and the ring's skipped steps; and bad calls raising the same typed
error on every rank, a peer that never calls included, as do ranks that differ in any option of
a call, or call different functions."""

import datetime
import itertools
from typing import Dict, List

import pytest
import torch

import causal_attention as ca
from attention_testing.ranks import assert_every_rank_raised, errors_of, run_ranks, whole_sequence
from attention_testing.tolerances import (SHARDED_FACTOR, SHARDED_GRADIENT_FACTOR,
                                          assert_sharded_result_close)
from causal_attention import distributed as cp
from causal_attention.distributed import call_checks
from causal_attention.distributed.ring_schedule import _Ring

B, HQ, HKV, D, DV = 1, 4, 2, 16, 8

# name -> (function, layout, dtype, sequence length, options)
CASES = {
    "ring-zigzag-causal-f64": ("ring", "zigzag", torch.float64, 64, {}),
    "ring-contiguous-causal-f64": ("ring", "contiguous", torch.float64, 64, {}),
    "ring-zigzag-window-alibi-f64": (
        "ring", "zigzag", torch.float64, 64, {"window": (11, 0), "alibi": True}),
    "ring-contiguous-window-f64": ("ring", "contiguous", torch.float64, 64, {"window": (5, 0)}),
    "ring-zigzag-softcap-sinks-f64": (
        "ring", "zigzag", torch.float64, 64, {"softcap": 2.0, "sinks": True}),
    "ring-contiguous-full-f64": ("ring", "contiguous", torch.float64, 64, {"window": (-1, -1)}),
    "ring-zigzag-f32": ("ring", "zigzag", torch.float32, 128, {"alibi": True, "sinks": True}),
    "ring-zigzag-bf16": ("ring", "zigzag", torch.bfloat16, 128, {}),
    "ring-contiguous-f16": ("ring", "contiguous", torch.float16, 128, {"softcap": 5.0}),
    # Long enough that the backward's K/V shards travel in parts (distributed.MIN_PART_KEYS)
    # and its calls take query rows in parts (MIN_PART_ROWS).
    "ring-zigzag-parts-f64": ("ring", "zigzag", torch.float64, 4096, {"alibi": True}),
    "ring-contiguous-parts-window-f32": (
        "ring", "contiguous", torch.float32, 8192, {"window": (1500, 0), "sinks": True}),
    "ulysses-zigzag-f64": (
        "ulysses", "zigzag", torch.float64, 64, {"alibi": True, "sinks": True, "key_mask": True}),
    "ulysses-contiguous-window-f64": (
        "ulysses", "contiguous", torch.float64, 64, {"window": (9, 0), "softcap": 3.0}),
    "ulysses-zigzag-bf16": ("ulysses", "zigzag", torch.bfloat16, 128, {}),
    "allgather-zigzag-window-sinks-f64": (
        "allgather", "zigzag", torch.float64, 64, {"window": (11, 0), "sinks": True}),
    "allgather-contiguous-f32": ("allgather", "contiguous", torch.float32, 128, {"alibi": True}),
}
CASES_4 = {
    "ring-zigzag-window-alibi-sinks-f64": (
        "ring", "zigzag", torch.float64, 64, {"window": (13, 0), "alibi": True, "sinks": True}),
    "ring-contiguous-f64": ("ring", "contiguous", torch.float64, 64, {"softcap": 2.0}),
    "ring-zigzag-f32": ("ring", "zigzag", torch.float32, 128, {}),
    "ulysses-zigzag-f64": ("ulysses", "zigzag", torch.float64, 64, {"sinks": True}),
    "allgather-zigzag-softcap-f64": ("allgather", "zigzag", torch.float64, 64, {"softcap": 2.0}),
}
ATTEND = {"ring": cp.ring_attention, "ulysses": cp.ulysses_attention,
          "allgather": cp.allgather_attention}


def inputs(dtype: torch.dtype, length: int, options: dict, seed: int = 0) -> Dict[str, object]:
    """The whole sequence's tensors and options of a case, the same on every rank."""
    g = torch.Generator().manual_seed(seed)
    t = {
        "q": torch.randn(B, HQ, length, D, generator=g, dtype=torch.float64).to(dtype),
        "k": torch.randn(B, HKV, length, D, generator=g, dtype=torch.float64).to(dtype),
        "v": torch.randn(B, HKV, length, DV, generator=g, dtype=torch.float64).to(dtype),
        "grad_out": torch.randn(B, HQ, length, DV, generator=g, dtype=torch.float64).to(dtype),
    }
    kwargs = {"window": options.get("window", (-1, 0)), "softcap": options.get("softcap")}
    if options.get("alibi"):
        kwargs["alibi_slopes"] = torch.tensor([0.5 / 2**h for h in range(HQ)])
    if options.get("sinks"):
        t["sinks"] = torch.randn(HQ, generator=g, dtype=torch.float64).to(dtype)
    if options.get("key_mask"):
        kwargs["key_mask"] = torch.rand(B, length, generator=g) > 0.3
    return {"tensors": t, "kwargs": kwargs}


def run_case(function: str, layout: str, dtype, length: int, options: dict) -> dict:
    """On one rank: the case's shard through ring or Ulysses attention, forward and backward."""
    case = inputs(dtype, length, options)
    t, kwargs = case["tensors"], dict(case["kwargs"])
    shard = {name: cp.shard_sequence(x, dim=2, layout=layout)
             for name, x in t.items() if name != "sinks"}
    if "key_mask" in kwargs:
        kwargs["key_mask"] = cp.shard_sequence(kwargs["key_mask"], dim=1, layout=layout)
    leaves = {name: shard[name].clone().requires_grad_() for name in ("q", "k", "v")}
    if "sinks" in t:
        leaves["sinks"] = t["sinks"].clone().requires_grad_()
    out = ATTEND[function](leaves["q"], leaves["k"], leaves["v"], sinks=leaves.get("sinks"),
                 layout=layout, **kwargs)
    out.backward(shard["grad_out"])
    result = {"out": out.detach()}
    result.update({"d" + name: leaf.grad for name, leaf in leaves.items()})
    return result


def cases_worker(rank: int, world: int, cases: dict) -> dict:
    results = {}
    for name, case in cases.items():
        first = run_case(*case)
        torch.set_num_threads(2)
        second = run_case(*case)
        torch.set_num_threads(1)
        results[name] = {"result": first,
                         "bitwise": all(torch.equal(first[k], second[k]) for k in first)}
    return results


def reference(dtype, length: int, options: dict, as_dtype) -> dict:
    """The single-process op on the whole sequence, in ``as_dtype``."""
    case = inputs(dtype, length, options)
    t = {name: x.to(as_dtype) for name, x in case["tensors"].items()}
    leaves = {name: t[name].clone().requires_grad_() for name in ("q", "k", "v")}
    if "sinks" in t:
        leaves["sinks"] = t["sinks"].clone().requires_grad_()
    out = ca.attention(leaves["q"], leaves["k"], leaves["v"], sinks=leaves.get("sinks"),
                       **case["kwargs"])
    out.backward(t["grad_out"])
    result = {"out": out.detach()}
    result.update({"d" + name: leaf.grad for name, leaf in leaves.items()})
    return result


def unsharded(per_rank: List[dict], name: str, layout: str) -> torch.Tensor:
    """A result's whole sequence from the ranks' shards (the sinks' gradient: their sum)."""
    if name == "dsinks":
        return sum(r[name].double() for r in per_rank)
    return whole_sequence([r[name] for r in per_rank], layout, dim=2)


def check_cases(cases: dict, per_rank: List[dict]) -> None:
    for name, (function, layout, dtype, length, options) in cases.items():
        assert all(r[name]["bitwise"] for r in per_rank), f"{name}: a second run differs"
        results = [r[name]["result"] for r in per_rank]
        exact = reference(dtype, length, options, torch.float64)
        single = reference(dtype, length, options, dtype) if dtype != torch.float64 else None
        for key in exact:
            factor = SHARDED_FACTOR
            if function != "ulysses" and key in ("dq", "dk", "dv"):
                factor = SHARDED_GRADIENT_FACTOR
            assert_sharded_result_close(f"{name} {key}", unsharded(results, key, layout),
                                        exact[key], single and single[key], 1e-10, factor)


@pytest.mark.parametrize("world, cases", [(2, CASES), (4, CASES_4)], ids=["2-ranks", "4-ranks"])
def test_context_parallel_equals_the_single_process_op(tmp_path, world, cases):
    check_cases(cases, run_ranks(world, cases_worker, cases, out_dir=tmp_path))


# --- Ulysses' dropout ----------------------------------------------------------------------


def ulysses_dropout_worker(rank: int, world: int) -> dict:
    t = inputs(torch.float64, 64, {})["tensors"]
    shard = {name: cp.shard_sequence(x, dim=2) for name, x in t.items()}
    leaves = {name: shard[name].clone().requires_grad_() for name in ("q", "k", "v")}
    out = cp.ulysses_attention(leaves["q"], leaves["k"], leaves["v"], dropout_p=0.3,
                               generator=torch.Generator().manual_seed(7))
    out.backward(shard["grad_out"])
    return {"out": out.detach(), **{"d" + name: leaf.grad for name, leaf in leaves.items()}}


def test_ulysses_dropout_drops_each_ranks_heads_with_a_generator_of_its_own(tmp_path):
    """Each rank's heads are the op on the whole sequence with its generator
    (distributed.rank_generator), output and gradients bitwise; the ranks' masks differ."""
    per_rank = run_ranks(2, ulysses_dropout_worker, out_dir=tmp_path)
    t = inputs(torch.float64, 64, {})["tensors"]
    whole = {name: whole_sequence([r[name] for r in per_rank], "zigzag", dim=2)
             for name in ("out", "dq", "dk", "dv")}
    for rank in range(2):
        heads_q = slice(rank * HQ // 2, (rank + 1) * HQ // 2)
        heads_kv = slice(rank * HKV // 2, (rank + 1) * HKV // 2)
        q, k, v = (t[name][:, heads].clone().requires_grad_()
                   for name, heads in (("q", heads_q), ("k", heads_kv), ("v", heads_kv)))
        generator = cp.rank_generator(torch.Generator().manual_seed(7), rank, 2)
        out = ca.attention(q, k, v, dropout_p=0.3, generator=generator)
        out.backward(t["grad_out"][:, heads_q])
        assert torch.equal(whole["out"][:, heads_q], out.detach())
        assert torch.equal(whole["dq"][:, heads_q], q.grad)
        assert torch.equal(whole["dk"][:, heads_kv], k.grad)
        assert torch.equal(whole["dv"][:, heads_kv], v.grad)
        assert (out - ca.attention(q, k, v)).abs().max() > 0.1  # it dropped
        # The other rank's generator drops these very inputs otherwise: the ranks' heads do not
        # share a mask.
        other = cp.rank_generator(torch.Generator().manual_seed(7), 1 - rank, 2)
        assert not torch.equal(ca.attention(q, k, v, dropout_p=0.3, generator=other), out)


# --- the layout and the ring's steps --------------------------------------------------------


def visible_pairs(seq_len: int, world: int, layout: str) -> List[int]:
    """Each rank's causal (query, key) pairs."""
    per_rank = []
    for rank in range(world):
        pairs = 0
        for c in cp.shard_chunks(seq_len // world, rank, world, layout):
            for i in range(c.position, c.position + c.length):
                pairs += i + 1
        per_rank.append(pairs)
    return per_rank


def test_zigzag_gives_every_rank_the_same_causal_work():
    zigzag = visible_pairs(4096, 4, "zigzag")
    assert max(zigzag) == min(zigzag)  # exactly: chunks r and 2N-1-r sum to the same
    contiguous = visible_pairs(4096, 4, "contiguous")
    assert max(contiguous) > 5 * min(contiguous)  # what the layout is for


def test_ring_steps_whose_shards_no_row_sees_are_not_run():
    """A sliding window of 16 keys over shards of 64: contiguous rank r needs only shards r and
    r - 1, so 2 of 4 steps run (their shards travel once); causal attention runs all 4."""
    def steps(layout, window):
        return _Ring.steps_needed(cp.Sharding(256, 4, layout), window)

    assert steps("contiguous", (15, 0)) == 2
    assert steps("contiguous", (-1, 0)) == 4
    assert steps("zigzag", (-1, 0)) == 4
    # A window back 64 keys reaches one shard back.
    assert steps("contiguous", (64, 0)) == 2
    assert steps("contiguous", (65, 0)) == 3


# --- bad calls ------------------------------------------------------------------------------


def bad_calls_worker(rank: int, world: int) -> dict:
    def q(length=16, heads=4, dtype=torch.float32):
        return torch.randn(1, heads, length, 8, dtype=dtype)

    kv = lambda length=16: torch.randn(1, 2, length, 8)  # noqa: E731
    calls = {
        "unequal shards": lambda: cp.ring_attention(q(16 if rank == 0 else 12), kv(), kv()),
        "odd zigzag shard": lambda: cp.ring_attention(q(15), kv(15), kv(15)),
        "dtypes": lambda: cp.ring_attention(
            q(dtype=torch.float64 if rank else torch.float32), kv(), kv()),
        "heads": lambda: cp.ulysses_attention(q(heads=4 if rank == 0 else 2), kv(), kv()),
        "window": lambda: cp.ring_attention(q(), kv(), kv(), window=(-1, 0) if rank else (7, 0)),
        "ulysses heads": lambda: cp.ulysses_attention(q(heads=3), kv()[:, :1], kv()[:, :1]),
        "layout": lambda: cp.ring_attention(q(), kv(), kv(), layout="spiral"),
        "lengths of q and k": lambda: cp.ring_attention(q(16), kv(8), kv(8)),
        # Refused on one rank only: the others must not wait for it in a collective.
        "dims on one rank": lambda: cp.ring_attention(q()[0] if rank else q(), kv(), kv()),
        "not a tensor on one rank": lambda: cp.ulysses_attention(
            q().tolist() if rank else q(), kv(), kv()),
    }
    not_member = torch.distributed.new_group([0])
    calls["not a member"] = lambda: cp.ring_attention(q(), kv(), kv(), group=not_member)
    errors = errors_of(calls)
    # A peer that never calls: the caller gives up after the handshake's timeout.
    call_checks.HANDSHAKE_TIMEOUT = datetime.timedelta(seconds=2)
    if rank == 0:
        try:
            cp.ring_attention(q(), kv(), kv())
            errors["peer never calls"] = None
        except RuntimeError as error:
            errors["peer never calls"] = (type(error).__name__, str(error))
    return errors


BAD_CALLS = {
    "unequal shards": ("ValueError", "q must have the same shape on every rank"),
    "odd zigzag shard": ("ValueError", "shard length must be even"),
    "dtypes": ("TypeError", "q must have the same dtype on every rank"),
    "heads": ("ValueError", "q must have the same shape on every rank"),
    "window": ("ValueError", "window must be the same on every rank, got rank 0: (7, 0), "
               "rank 1: (-1, 0)"),
    "ulysses heads": ("ValueError", "Hq must be a multiple of N"),
    "layout": ("ValueError", "layout must be one of"),
    "lengths of q and k": ("ValueError", "q and k must hold the same tokens"),
    "dims on one rank": ("ValueError", "q must have the same shape on every rank"),
    "not a tensor on one rank": ("TypeError", "q must have the same dtype on every rank"),
}


def test_bad_calls_raise_the_same_typed_error_on_every_rank(tmp_path):
    per_rank = run_ranks(2, bad_calls_worker, out_dir=tmp_path, barrier=False)
    assert_every_rank_raised(per_rank, BAD_CALLS)
    # Only rank 1 is outside the group of rank 0.
    assert per_rank[1]["not a member"][0] == "ValueError"
    assert "not a member of group" in per_rank[1]["not a member"][1]
    assert per_rank[0]["peer never calls"][0] == "RuntimeError"
    assert "not every rank of the group called" in per_rank[0]["peer never calls"][1]


# --- the ranks disagreeing: every call, option and pair of calls ----------------------------


def mismatch_calls(rank: int) -> Dict[str, object]:
    """Calls whose arguments differ between rank 0 and rank 1 (``mine(for_0, for_1)``), or that
    are different functions on the two ranks."""
    g = torch.Generator().manual_seed(0)  # the same tensors on both ranks
    q, k, v = (torch.randn(1, h, 16, 8, generator=g) for h in (4, 2, 2))
    slopes, sinks = torch.rand(4, generator=g), torch.randn(4, generator=g)
    mask = torch.rand(1, 16, generator=g) > 0.3

    def mine(for_0, for_1):
        return for_1 if rank else for_0

    ring, ulysses, unshard = cp.ring_attention, cp.ulysses_attention, cp.unshard_sequence
    calls = {"ring: q's dtype": lambda: ring(mine(q, q.double()), k, v),
             "ring: k's length": lambda: ring(q, mine(k, k[..., :8, :]), v)}
    for name, for_0, for_1 in (("scale", 0.25, 0.5), ("window", (-1, 0), (3, 0)),
                               ("softcap", None, 5.0), ("layout", "zigzag", "contiguous"),
                               ("alibi_slopes", None, slopes), ("sinks", sinks, sinks * 2)):
        calls[f"ring: {name}"] = lambda name=name, a=for_0, b=for_1: ring(
            q, k, v, **{name: mine(a, b)})
    calls["ring: alibi_slopes' values"] = lambda: ring(q, k, v, alibi_slopes=mine(slopes,
                                                                                  slopes.flip(0)))
    for name, for_0, for_1 in (("scale", 0.25, 0.5), ("window", (-1, 0), (-1, -1)),
                               ("softcap", 2.0, 3.0), ("dropout_p", 0.0, 0.1),
                               ("layout", "contiguous", "zigzag"), ("key_mask", mask, None),
                               ("sinks", None, sinks)):
        calls[f"ulysses: {name}"] = lambda name=name, a=for_0, b=for_1: ulysses(
            q, k, v, **{name: mine(a, b)})
    calls["ulysses: v's dtype"] = lambda: ulysses(q, k, mine(v, v.bfloat16()))
    calls["unshard: x's length"] = lambda: unshard(mine(q, q[..., :8, :]))
    calls["unshard: x's dtype"] = lambda: unshard(mine(q, q.double()))
    calls["unshard: dim"] = lambda: unshard(q, dim=mine(2, -2))
    calls["unshard: layout"] = lambda: unshard(q, layout=mine("zigzag", "contiguous"))
    methods = {"ring": lambda: ring(q, k, v), "ulysses": lambda: ulysses(q, k, v),
               "unshard": lambda: unshard(q)}
    for first, second in (("ring", "ulysses"), ("ring", "unshard"), ("ulysses", "unshard")):
        calls[f"{first} and {second}"] = mine(methods[first], methods[second])
        calls[f"{second} and {first}"] = mine(methods[second], methods[first])
    # After every refusal the ranks are still in step: a call they agree on is served.
    calls["agreed afterwards"] = lambda: ring(q, k, v, scale=0.5)
    return calls


def mismatch_worker(rank: int, world: int) -> dict:
    return errors_of(mismatch_calls(rank))


# What each rank must raise: the error type and words of its message.
MISMATCHES = {
    "ring: q's dtype": ("TypeError", "q must have the same dtype on every rank"),
    "ring: k's length": ("ValueError", "k must have the same shape on every rank"),
    "ring: scale": ("ValueError", "scale must be the same on every rank, got rank 0: 0.25, "
                    "rank 1: 0.5"),
    "ring: window": ("ValueError", "window must be the same on every rank"),
    "ring: softcap": ("ValueError", "softcap must be the same on every rank, got rank 0: None"),
    "ring: layout": ("ValueError", "layout must be the same on every rank, got rank 0: "
                     "'zigzag', rank 1: 'contiguous'"),
    "ring: alibi_slopes": ("TypeError", "alibi_slopes must have the same dtype on every rank"),
    "ring: sinks": ("ValueError", "sinks must have the same values on every rank"),
    "ring: alibi_slopes' values": ("ValueError",
                                   "alibi_slopes must have the same values on every rank"),
    "ulysses: scale": ("ValueError", "scale must be the same on every rank"),
    "ulysses: window": ("ValueError", "window must be the same on every rank"),
    "ulysses: softcap": ("ValueError", "softcap must be the same on every rank"),
    "ulysses: dropout_p": ("ValueError", "dropout_p must be the same on every rank"),
    "ulysses: layout": ("ValueError", "layout must be the same on every rank"),
    "ulysses: key_mask": ("TypeError", "key_mask must have the same dtype on every rank"),
    "ulysses: sinks": ("TypeError", "sinks must have the same dtype on every rank"),
    "ulysses: v's dtype": ("TypeError", "v must have the same dtype on every rank"),
    "unshard: x's length": ("ValueError", "x must have the same shape on every rank"),
    "unshard: x's dtype": ("TypeError", "x must have the same dtype on every rank"),
    "unshard: dim": ("ValueError", "dim must be the same on every rank, got rank 0: 2, "
                     "rank 1: -2"),
    "unshard: layout": ("ValueError", "layout must be the same on every rank"),
    **{f"{a} and {b}": ("ValueError", "causal_attention.distributed: every rank of the group "
                        "must make the same call, got rank 0: ")
       for a, b in itertools.permutations(("ring", "ulysses", "unshard"), 2)},
}


def test_ranks_that_disagree_raise_the_same_typed_error_on_every_rank(tmp_path):
    """Each option of each call, and each pair of calls, differing between the two ranks: both
    raise the same error, naming what differs (none aborts, hangs or computes), and the ranks
    stay in step for the next call."""
    per_rank = run_ranks(2, mismatch_worker, out_dir=tmp_path, timeout=120)
    assert_every_rank_raised(per_rank, MISMATCHES)
    assert set(per_rank[0]) == set(MISMATCHES) | {"agreed afterwards"}
    assert per_rank[0]["agreed afterwards"] is None and per_rank[1]["agreed afterwards"] is None
