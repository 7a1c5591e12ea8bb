"""The kernel ops' query_offset (the key position of query row 0, for a call that holds a chunk of
the keys, as a ring step does) and the backward ops' delta (the rows' rowsum(dO o O) over all
their keys): against a float64 reference of the scores at those positions, a sequence's keys split
into chunks whose (out, lse) merge into the whole call's and whose gradients sum to its
gradients, in every dtype; rows that see nothing; opcheck; typed errors."""

import math

import pytest
import torch

import causal_attention as ca
from attention_testing.tolerances import UNIT_ROUNDOFF, max_abs_diff

OPS = torch.ops.causal_attention
DTYPES = [torch.float64, torch.float32, torch.bfloat16, torch.float16]
OPTIONS = {
    "causal": {},
    "window": {"window": [9, 0]},
    "window-right": {"window": [3, 5]},
    "full": {"window": [-1, -1]},
    "alibi-softcap": {"alibi_slopes": torch.tensor([0.25, 0.0625]), "softcap": 2.0},
    "window-alibi": {"window": [12, 0], "alibi_slopes": torch.tensor([0.5, 0.125])},
}


def inputs(dtype, lq=24, lk=40, heads_q=2, heads_kv=1, d=16, dv=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    make = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)  # noqa
    return (make(2, heads_q, lq, d), make(2, heads_kv, lk, d), make(2, heads_kv, lk, dv),
            make(2, heads_q, lq, dv))


def reference(q, k, v, scale, offset, window=(-1, 0), softcap=None, alibi_slopes=None):
    """Float64 attention with query row i at key position i + offset: (out, lse)."""
    q, k, v = (t.double() for t in (q, k, v))
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s = q @ k.transpose(-1, -2) * scale
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    rows = torch.arange(q.shape[2]).view(-1, 1) + offset
    keys = torch.arange(k.shape[2]).view(1, -1)
    if alibi_slopes is not None:
        s = s - alibi_slopes.double().view(-1, 1, 1) * (rows - keys).abs()
    left, right = window
    seen = torch.ones_like(rows - keys, dtype=torch.bool)
    if left >= 0:
        seen &= keys >= rows - left
    if right >= 0:
        seen &= keys <= rows + right
    s = s.masked_fill(~seen, -math.inf)
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - torch.where(torch.isinf(lse), 0, lse).unsqueeze(-1))
    return p @ v, lse


def tolerance(dtype, magnitude):
    return 1e-12 if dtype == torch.float64 else 16 * UNIT_ROUNDOFF[dtype] * magnitude


@pytest.mark.parametrize("options", OPTIONS.values(), ids=OPTIONS.keys())
@pytest.mark.parametrize("offset", [-30, -5, 0, 7, 16, 40, 70])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_forward_places_query_row_0_at_query_offset(dtype, offset, options):
    q, k, v, _ = inputs(dtype)
    out, lse = OPS.attention_forward(q, k, v, 0.3, **options, query_offset=offset)
    want_out, want_lse = reference(q, k, v, 0.3, offset, **options)
    assert (out.double() - want_out).abs().max() <= tolerance(dtype, want_out.abs().max() + 1)
    finite = torch.isfinite(want_lse)
    assert torch.equal(torch.isfinite(lse), finite)
    assert max_abs_diff(lse[finite], want_lse[finite]) <= tolerance(dtype, 10)
    # A row that sees no key: zeros and lse -inf, never NaN.
    assert torch.all(out[~finite] == 0) and torch.all(torch.isneginf(lse[~finite]))


def test_without_query_offset_rows_are_aligned_bottom_right():
    q, k, v, _ = inputs(torch.float32)
    assert all(torch.equal(a, b) for a, b in zip(
        OPS.attention_forward(q, k, v, 0.3, window=[9, 0]),
        OPS.attention_forward(q, k, v, 0.3, window=[9, 0], query_offset=40 - 24)))


def merge(parts):
    """The (out, lse) over the union of disjoint key sets from each one's (out, lse)."""
    lse = torch.logsumexp(torch.stack([l.double() for _, l in parts]), 0)
    safe = torch.where(torch.isinf(lse), 0, lse)
    out = sum(o.double() * torch.exp(l.double() - safe).unsqueeze(-1) for o, l in parts)
    return out, lse


@pytest.mark.parametrize("options", OPTIONS.values(), ids=OPTIONS.keys())
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_key_chunks_with_their_offsets_merge_into_the_whole_call(dtype, options):
    """What a ring step does: chunks of the keys, each called with its offset; the merged
    outputs are the whole call's, and the backward given the whole call's lse and delta gives
    gradients that sum to the whole call's."""
    q, k, v, grad_out = inputs(dtype)
    lq, lk = q.shape[2], k.shape[2]
    out, lse = OPS.attention_forward(q, k, v, 0.3, **options)
    dq, dk, dv, _ = OPS.attention_backward(grad_out, q, k, v, out, lse, 0.3, **options)
    acc = lse.dtype
    delta = (grad_out.to(acc) * out.to(acc)).sum(-1)
    parts, dq_sum, dk_parts, dv_parts = [], torch.zeros_like(dq, dtype=torch.float64), [], []
    for begin, end in [(0, 13), (13, 29), (29, lk)]:
        offset = (lk - lq) - begin
        chunk_k, chunk_v = k[:, :, begin:end], v[:, :, begin:end]
        parts.append(OPS.attention_forward(q, chunk_k, chunk_v, 0.3, **options,
                                           query_offset=offset))
        g = OPS.attention_backward(grad_out, q, chunk_k, chunk_v, out, lse, 0.3, **options,
                                   query_offset=offset, delta=delta)
        # A step's shares, summed by the caller: in the accumulation dtype, unrounded.
        assert all(share.dtype == acc for share in g[:3])
        dq_sum += g[0].double()
        dk_parts.append(g[1].double())
        dv_parts.append(g[2].double())
    merged_out, merged_lse = merge(parts)
    magnitude = 1 + out.double().abs().max()
    assert (merged_out - out.double()).abs().max() <= tolerance(dtype, magnitude)
    finite = torch.isfinite(lse)
    assert max_abs_diff(merged_lse[finite], lse[finite]) <= tolerance(dtype, 10)
    for name, got, want in [("dq", dq_sum, dq), ("dk", torch.cat(dk_parts, 2), dk),
                            ("dv", torch.cat(dv_parts, 2), dv)]:
        # Reduced precision: the whole call recomputes its rows' statistics, the chunks take the
        # delta of its rounded output; both within the gradients' rounding.
        bound = tolerance(dtype, 1 + want.double().abs().max()) * (2 if dtype.itemsize == 2 else 1)
        assert (got - want.double()).abs().max() <= bound, name


def test_delta_is_taken_as_given():
    """The backward reads delta where it is given: doubling it changes dS = P o (dP - delta)."""
    q, k, v, grad_out = inputs(torch.float64)
    out, lse = OPS.attention_forward(q, k, v, 0.3)
    delta = (grad_out * out).sum(-1)
    given = OPS.attention_backward(grad_out, q, k, v, out, lse, 0.3, delta=delta)
    computed = OPS.attention_backward(grad_out, q, k, v, out, lse, 0.3)
    for a, b in zip(given[:3], computed[:3]):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    other = OPS.attention_backward(grad_out, q, k, v, out, lse, 0.3, delta=2 * delta)
    assert (other[0] - given[0]).abs().max() > 1e-3
    torch.testing.assert_close(other[2], given[2])  # dV = P^T dO does not read delta


@pytest.mark.parametrize("requires_grad", [False, True], ids=["no-grad", "grad"])
def test_opcheck_attention_forward_with_query_offset(requires_grad):
    q, k, v, _ = inputs(torch.float32, lq=8, lk=12)
    q, k, v = (t.requires_grad_(requires_grad) for t in (q, k, v))
    report = torch.library.opcheck(OPS.attention_forward.default, (q, k, v, 0.5),
                                   {"window": [5, 0], "query_offset": 9})
    assert report and all(r == "SUCCESS" for r in report.values()), report


@pytest.mark.parametrize("op", ["attention_backward", "attention_gradients"])
def test_opcheck_backward_ops_with_query_offset_and_delta(op):
    q, k, v, grad_out = inputs(torch.float32, lq=8, lk=12)
    out, lse = OPS.attention_forward(q, k, v, 0.5, query_offset=9)
    delta = (grad_out * out).sum(-1)
    report = torch.library.opcheck(getattr(OPS, op).default, (grad_out, q, k, v, out, lse, 0.5),
                                   {"query_offset": 9, "delta": delta})
    assert report and all(r == "SUCCESS" for r in report.values()), report


def test_bad_query_offset_and_delta_raise_typed_errors():
    q, k, v, grad_out = inputs(torch.float32)
    out, lse = OPS.attention_forward(q, k, v, 0.5)
    with pytest.raises(ValueError, match="delta must have lse's shape"):
        OPS.attention_backward(grad_out, q, k, v, out, lse, 0.5, delta=lse[..., :3])
    with pytest.raises(TypeError, match="delta must have lse's dtype"):
        OPS.attention_backward(grad_out, q, k, v, out, lse, 0.5, delta=lse.double())
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    packed = torch.randn(12, 2, 16)
    with pytest.raises(ValueError, match="query_offset is for dense calls"):
        ca.attention_forward(packed, packed, packed, 0.5, cu_seqlens_q=cu, cu_seqlens_k=cu,
                             max_seqlen_q=7, max_seqlen_k=7, query_offset=3)
