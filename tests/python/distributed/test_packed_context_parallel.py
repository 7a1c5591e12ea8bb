"""Context parallelism over packed documents (cu_seqlens) on real processes (gloo on
127.0.0.1): ring, all-gather and Ulysses attention in both layouts on 2 and 4 ranks, outputs
and every gradient against varlen_attention in one process on the whole packed batch (float64
within 1e-12; other dtypes within twice the single-process op's own error against float64, the
ring's and the all-gather's gradients within 1.2x), bitwise the same on a second run at another
thread count; shard_sequence/unshard_sequence/shard_positions/shard_cu_seqlens of a packed
batch; the per-document zigzag layout's balance; and ranks that disagree on cu_seqlens, or hold
other tokens than it gives them, raising the same error on every rank."""

import random
from typing import Dict, List

import pytest
import torch

import causal_attention as ca
from attention_testing.ranks import assert_every_rank_raised, errors_of, run_ranks
from attention_testing.tolerances import (SHARDED_FACTOR, SHARDED_GRADIENT_FACTOR,
                                          assert_sharded_result_close)
from causal_attention import distributed as cp
from causal_attention.distributed import ring_schedule
from causal_attention.distributed.layout import Sharding, _packed_chunks, _token_index
from causal_attention.distributed.ring_schedule import _Ring

HQ, HKV, D, DV = 4, 2, 16, 8
# Documents of every kind: shorter than 2N chunks (some ranks hold none of their tokens), of
# one token, empty, and not a multiple of 2N.
DOCUMENTS = (37, 5, 64, 1, 21, 0, 50)

# name -> (function, layout, dtype, options); "parts": the backward's K/V shards travel in parts
# that straddle documents, and its calls take query rows in parts.
CASES = {
    "ring-zigzag-causal-f64": ("ring", "zigzag", torch.float64, {}),
    "ring-contiguous-causal-f64": ("ring", "contiguous", torch.float64, {}),
    "ring-zigzag-window-alibi-f64": ("ring", "zigzag", torch.float64,
                                     {"window": (11, 0), "alibi": True}),
    "ring-contiguous-window-softcap-sinks-f64": (
        "ring", "contiguous", torch.float64, {"window": (6, 0), "softcap": 2.0, "sinks": True}),
    "ring-zigzag-full-f64": ("ring", "zigzag", torch.float64, {"window": (-1, -1)}),
    "ring-zigzag-parts-f64": ("ring", "zigzag", torch.float64, {"parts": True, "sinks": True}),
    "ring-zigzag-f32": ("ring", "zigzag", torch.float32, {"alibi": True, "sinks": True}),
    "ring-zigzag-bf16": ("ring", "zigzag", torch.bfloat16, {}),
    "ring-contiguous-f16": ("ring", "contiguous", torch.float16, {"softcap": 5.0}),
    "allgather-zigzag-window-alibi-sinks-f64": (
        "allgather", "zigzag", torch.float64, {"window": (9, 0), "alibi": True, "sinks": True}),
    "allgather-contiguous-causal-f64": ("allgather", "contiguous", torch.float64, {}),
    "allgather-zigzag-parts-softcap-f64": ("allgather", "zigzag", torch.float64,
                                           {"parts": True, "softcap": 3.0}),
    "allgather-zigzag-f32": ("allgather", "zigzag", torch.float32, {"sinks": True}),
    "allgather-contiguous-bf16": ("allgather", "contiguous", torch.bfloat16, {"alibi": True}),
    "ulysses-zigzag-alibi-sinks-f64": ("ulysses", "zigzag", torch.float64,
                                       {"alibi": True, "sinks": True}),
    "ulysses-contiguous-window-softcap-f64": ("ulysses", "contiguous", torch.float64,
                                              {"window": (5, 0), "softcap": 2.0}),
    "ulysses-zigzag-bf16": ("ulysses", "zigzag", torch.bfloat16, {}),
}
CASES_4 = {
    "ring-zigzag-window-alibi-sinks-f64": (
        "ring", "zigzag", torch.float64, {"window": (13, 0), "alibi": True, "sinks": True}),
    "ring-contiguous-softcap-f64": ("ring", "contiguous", torch.float64, {"softcap": 2.0}),
    "ring-zigzag-parts-f32": ("ring", "zigzag", torch.float32, {"parts": True}),
    "allgather-zigzag-parts-alibi-sinks-f64": (
        "allgather", "zigzag", torch.float64, {"parts": True, "alibi": True, "sinks": True}),
    "allgather-contiguous-window-f32": ("allgather", "contiguous", torch.float32,
                                        {"window": (7, 0)}),
    "ulysses-zigzag-sinks-f64": ("ulysses", "zigzag", torch.float64, {"sinks": True}),
}
ATTEND = {"ring": cp.ring_attention, "allgather": cp.allgather_attention,
          "ulysses": cp.ulysses_attention}


def cu_seqlens(documents=DOCUMENTS) -> torch.Tensor:
    return torch.tensor([0, *documents], dtype=torch.int32).cumsum(0, dtype=torch.int32)


def inputs(dtype: torch.dtype, options: dict, seed: int = 0) -> Dict[str, object]:
    """The whole packed batch's tensors and options of a case, the same on every rank."""
    g = torch.Generator().manual_seed(seed)
    tokens = sum(DOCUMENTS)

    def randn(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)

    t = {"q": randn(tokens, HQ, D), "k": randn(tokens, HKV, D), "v": randn(tokens, HKV, DV),
         "grad_out": randn(tokens, HQ, DV)}
    kwargs = {"window": options.get("window", (-1, 0)), "softcap": options.get("softcap")}
    if options.get("alibi"):
        kwargs["alibi_slopes"] = torch.tensor([0.5 / 2**h for h in range(HQ)])
    if options.get("sinks"):
        t["sinks"] = randn(HQ)
    return {"tensors": t, "kwargs": kwargs}


def run_case(function: str, layout: str, dtype, options: dict) -> dict:
    """On one rank: the case's shard through the call, forward and backward."""
    case = inputs(dtype, options)
    t, kwargs, cu = case["tensors"], case["kwargs"], cu_seqlens()
    shard = {name: cp.shard_sequence(x, layout=layout, cu_seqlens=cu)
             for name, x in t.items() if name != "sinks"}
    leaves = {name: shard[name].clone().requires_grad_() for name in ("q", "k", "v")}
    if "sinks" in t:
        leaves["sinks"] = t["sinks"].clone().requires_grad_()
    out = ATTEND[function](leaves["q"], leaves["k"], leaves["v"], sinks=leaves.get("sinks"),
                           layout=layout, cu_seqlens=cu, max_seqlen=max(DOCUMENTS), **kwargs)
    out.backward(shard["grad_out"])
    result = {"out": out.detach()}
    result.update({"d" + name: leaf.grad for name, leaf in leaves.items()})
    return result


def cases_worker(rank: int, world: int, cases: dict) -> dict:
    results = {}
    for name, case in cases.items():
        parts = case[-1].get("parts")
        saved = ring_schedule.MIN_PART_KEYS, ring_schedule.MIN_PART_ROWS
        if parts:  # small parts, so that small shards travel in several
            ring_schedule.MIN_PART_KEYS, ring_schedule.MIN_PART_ROWS = 16, 8
        first = run_case(*case)
        torch.set_num_threads(2)
        second = run_case(*case)
        torch.set_num_threads(1)
        ring_schedule.MIN_PART_KEYS, ring_schedule.MIN_PART_ROWS = saved
        results[name] = {"result": first,
                         "bitwise": all(torch.equal(first[k], second[k]) for k in first)}
    return results


def reference(dtype, options: dict, as_dtype) -> dict:
    """varlen_attention in one process on the whole packed batch, in ``as_dtype``."""
    case = inputs(dtype, options)
    t = {name: x.to(as_dtype) for name, x in case["tensors"].items()}
    leaves = {name: t[name].clone().requires_grad_() for name in ("q", "k", "v")}
    if "sinks" in t:
        leaves["sinks"] = t["sinks"].clone().requires_grad_()
    cu, longest = cu_seqlens(), max(DOCUMENTS)
    out = ca.varlen_attention(leaves["q"], leaves["k"], leaves["v"], cu, cu, longest, longest,
                              sinks=leaves.get("sinks"), **case["kwargs"])
    out.backward(t["grad_out"])
    result = {"out": out.detach()}
    result.update({"d" + name: leaf.grad for name, leaf in leaves.items()})
    return result


def packed_whole(shards: List[torch.Tensor], layout: str) -> torch.Tensor:
    """The whole packed batch from every rank's shard (the sinks' gradient: their sum)."""
    if shards[0].dim() == 1:
        return sum(s.double() for s in shards)
    sharding = Sharding(sum(DOCUMENTS), len(shards), layout, tuple(cu_seqlens().tolist()))
    whole = shards[0].new_empty((sharding.length, *shards[0].shape[1:]))
    for rank, shard in enumerate(shards):
        whole[_token_index(sharding, rank)] = shard
    return whole


def check_cases(cases: dict, per_rank: List[dict]) -> None:
    for name, (function, layout, dtype, options) in cases.items():
        assert all(r[name]["bitwise"] for r in per_rank), f"{name}: a second run differs"
        results = [r[name]["result"] for r in per_rank]
        exact = reference(dtype, options, torch.float64)
        single = reference(dtype, options, dtype) if dtype != torch.float64 else None
        for key in exact:
            factor = SHARDED_FACTOR
            if function != "ulysses" and key in ("dq", "dk", "dv"):
                factor = SHARDED_GRADIENT_FACTOR
            assert_sharded_result_close(f"{name} {key}",
                                        packed_whole([r[key] for r in results], layout),
                                        exact[key], single and single[key], 1e-12, factor)


@pytest.mark.parametrize("world, cases", [(2, CASES), (4, CASES_4)], ids=["2-ranks", "4-ranks"])
def test_packed_context_parallel_equals_varlen_attention_in_one_process(tmp_path, world, cases):
    check_cases(cases, run_ranks(world, cases_worker, cases, out_dir=tmp_path))


# --- the packed layouts ---------------------------------------------------------------------


def test_zigzag_cuts_each_document_into_2n_chunks():
    """Rank r holds chunks r and 2N - 1 - r of every document, near-equal where 2N does not
    divide it, adjacent chunks joined; contiguous cuts the batch where documents end."""
    cu = (0, 10, 13, 21)
    assert _packed_chunks(cu, 0, 2, "zigzag") == (
        cp.Chunk(0, 2, 0, 0), cp.Chunk(2, 3, 7, 0), cp.Chunk(5, 1, 2, 1),
        cp.Chunk(6, 2, 0, 2), cp.Chunk(8, 2, 6, 2))
    assert _packed_chunks(cu, 1, 2, "zigzag") == (
        cp.Chunk(0, 5, 2, 0), cp.Chunk(5, 2, 0, 1), cp.Chunk(7, 4, 2, 2))
    assert _packed_chunks(cu, 1, 2, "contiguous") == (
        cp.Chunk(0, 3, 0, 1), cp.Chunk(3, 8, 0, 2))


def causal_pairs(sharding: Sharding) -> List[int]:
    return [sum(c.length * c.position + c.length * (c.length + 1) // 2
                for c in sharding.chunks(r)) for r in range(sharding.world)]


def test_zigzag_per_document_balances_the_causal_work():
    """Documents of 512-4096 tokens packed into 16384: each rank's share of the causal pairs is
    within 1 % of 1/N in the zigzag layout, further from it in the contiguous one (whose
    imbalance is smaller than a dense sequence's: each document is triangular by itself)."""
    rng = random.Random(0)
    lengths = []
    while sum(lengths) < 16384:
        lengths.append(min(rng.randint(512, 4096), 16384 - sum(lengths)))
    cu = tuple(torch.tensor([0, *lengths]).cumsum(0).tolist())
    for world in (2, 4):
        zigzag = causal_pairs(Sharding(16384, world, "zigzag", cu))
        assert max(zigzag) <= 1.01 * sum(zigzag) / world, zigzag
        contiguous = causal_pairs(Sharding(16384, world, "contiguous", cu))
        assert max(contiguous) > 1.05 * sum(contiguous) / world > max(zigzag), contiguous


def test_packed_ring_steps_whose_shards_hold_no_document_a_row_sees_are_not_run():
    """Documents each inside one rank's contiguous shard: only the rank's own step runs."""
    cu = (0, 30, 64, 100, 128, 128, 192, 256)
    assert _Ring.steps_needed(Sharding(256, 4, "contiguous", cu), (-1, 0)) == 1
    assert _Ring.steps_needed(Sharding(256, 4, "contiguous", (0, 60, 256)), (-1, 0)) == 4
    assert _Ring.steps_needed(Sharding(256, 4, "contiguous", (0, 60, 256)), (10, 0)) == 2


# --- the helpers and bad calls --------------------------------------------------------------


def helper_input() -> torch.Tensor:
    return torch.randn(sum(DOCUMENTS), 3, dtype=torch.float64,
                       generator=torch.Generator().manual_seed(1))


def helpers_worker(rank: int, world: int) -> dict:
    cu = cu_seqlens()
    x = helper_input()
    result = {}
    for layout in ("zigzag", "contiguous"):
        shard = cp.shard_sequence(x, layout=layout, cu_seqlens=cu).requires_grad_()
        whole = cp.unshard_sequence(shard, layout=layout, cu_seqlens=cu)
        whole.backward(torch.ones_like(whole))
        result[layout] = {
            "unsharded": torch.equal(whole, x), "grad": shard.grad,
            "positions": cp.shard_positions(sum(DOCUMENTS), layout=layout, cu_seqlens=cu),
            "local_cu": cp.shard_cu_seqlens(cu, layout=layout), "shard": shard.detach()}
    return result


def test_packed_shard_helpers(tmp_path):
    """unshard_sequence inverts shard_sequence (its gradient: one per rank's use);
    shard_positions are the tokens' positions within their documents; shard_cu_seqlens bounds
    each document's tokens in the shard."""
    world = 2
    per_rank = run_ranks(world, helpers_worker, out_dir=tmp_path)
    cu = cu_seqlens().tolist()
    x = helper_input()
    within = torch.cat([torch.arange(b - a) for a, b in zip(cu, cu[1:])])
    document = torch.cat([torch.full((b - a,), i) for i, (a, b) in enumerate(zip(cu, cu[1:]))])
    for layout in ("zigzag", "contiguous"):
        sharding = Sharding(sum(DOCUMENTS), world, layout, tuple(cu))
        for rank, r in enumerate(per_rank):
            index = _token_index(sharding, rank)
            assert r[layout]["unsharded"]
            assert torch.equal(r[layout]["grad"], torch.full_like(r[layout]["grad"], world))
            assert torch.equal(r[layout]["shard"], x[index])
            assert torch.equal(r[layout]["positions"], within[index])
            local = r[layout]["local_cu"]
            assert local.dtype == torch.int32
            counts = torch.bincount(document[index], minlength=len(DOCUMENTS))
            assert torch.equal(local.diff(), counts.int())
            # A document's tokens lie in sequence order within the shard.
            for i in range(len(DOCUMENTS)):
                rows = r[layout]["positions"][local[i]:local[i + 1]]
                assert torch.equal(rows, rows.sort().values)


def packed_mismatch_worker(rank: int, world: int) -> dict:
    g = torch.Generator().manual_seed(0)
    cu = cu_seqlens()
    whole = {name: torch.randn(sum(DOCUMENTS), h, 8, generator=g) for name, h in
             (("q", 4), ("k", 2), ("v", 2))}
    q, k, v = (cp.shard_sequence(whole[n], cu_seqlens=cu) for n in ("q", "k", "v"))
    other = cu_seqlens((36, 6, *DOCUMENTS[2:]))

    def mine(for_0, for_1):
        return for_1 if rank else for_0

    ring = cp.ring_attention
    calls = {
        "cu_seqlens' values": lambda: ring(q, k, v, cu_seqlens=mine(cu, other)),
        "cu_seqlens' length": lambda: ring(q, k, v, cu_seqlens=mine(cu, cu[:-1])),
        "cu_seqlens on one rank": lambda: ring(q, k, v, cu_seqlens=mine(cu, None)),
        "cu_seqlens' dtype": lambda: ring(q, k, v, cu_seqlens=cu.long()),
        "cu_seqlens decreasing": lambda: ring(q, k, v, cu_seqlens=cu.flip(0)),
        "tokens not the shard's": lambda: ring(q[:-1] if rank else q, k, v, cu_seqlens=cu),
        "contiguous shard in zigzag": lambda: ring(q, k, v, cu_seqlens=cu, layout="contiguous"),
        "max_seqlen": lambda: ring(q, k, v, cu_seqlens=cu, max_seqlen=10),
        "max_seqlen on one rank": lambda: ring(q, k, v, cu_seqlens=cu,
                                               max_seqlen=mine(64, 65)),
        "unshard: cu_seqlens": lambda: cp.unshard_sequence(q, cu_seqlens=mine(cu, other)),
        "unshard: tokens": lambda: cp.unshard_sequence(q[:-1] if rank else q, cu_seqlens=cu),
        "allgather: cu_seqlens": lambda: cp.allgather_attention(q, k, v,
                                                                cu_seqlens=mine(cu, other)),
        "ring and allgather": mine(lambda: ring(q, k, v, cu_seqlens=cu),
                                   lambda: cp.allgather_attention(q, k, v, cu_seqlens=cu)),
        "ulysses: key_mask": lambda: cp.ulysses_attention(
            q, k, v, cu_seqlens=cu, key_mask=torch.ones(1, 8, dtype=torch.bool)),
        "ulysses: cu_seqlens": lambda: cp.ulysses_attention(q, k, v,
                                                            cu_seqlens=mine(cu, other)),
    }
    errors = errors_of(calls)
    errors["agreed afterwards"] = errors_of({"ring": lambda: ring(q, k, v, cu_seqlens=cu)})
    return errors


PACKED_MISMATCHES = {
    "cu_seqlens' values": ("ValueError", "cu_seqlens must have the same values on every rank"),
    "cu_seqlens' length": ("ValueError", "cu_seqlens must have the same shape on every rank"),
    "cu_seqlens on one rank": ("TypeError", "cu_seqlens must have the same dtype on every rank"),
    "cu_seqlens' dtype": ("TypeError", "cu_seqlens must be an int32 Tensor, got torch.int64"),
    "cu_seqlens decreasing": ("ValueError", "cu_seqlens must be 1-D (documents + 1,), from 0 and "
                              "never decreasing"),
    "tokens not the shard's": ("ValueError", "q must hold this rank's tokens of the packed batch"),
    "contiguous shard in zigzag": ("ValueError", "must hold this rank's tokens of the packed"),
    "max_seqlen": ("ValueError", "max_seqlen must be at least the longest document's length "
                   "(64, from cu_seqlens), got max_seqlen=10"),
    "max_seqlen on one rank": ("ValueError", "max_seqlen must be the same on every rank"),
    "unshard: cu_seqlens": ("ValueError", "cu_seqlens must have the same values on every rank"),
    "unshard: tokens": ("ValueError", "x must hold this rank's tokens of the packed batch"),
    "allgather: cu_seqlens": ("ValueError", "allgather_attention: cu_seqlens must have the same "
                              "values on every rank"),
    "ring and allgather": ("ValueError", "every rank of the group must make the same call, got "
                           "rank 0: ring_attention, rank 1: allgather_attention"),
    "ulysses: key_mask": ("ValueError", "key_mask must be None with cu_seqlens"),
    "ulysses: cu_seqlens": ("ValueError", "ulysses_attention: cu_seqlens must have the same "
                            "values on every rank"),
}


def test_packed_calls_that_disagree_raise_the_same_typed_error_on_every_rank(tmp_path):
    per_rank = run_ranks(2, packed_mismatch_worker, out_dir=tmp_path, timeout=120)
    assert_every_rank_raised(per_rank, PACKED_MISMATCHES)
    assert all(r["agreed afterwards"] == {"ring": None} for r in per_rank)
