"""causal_attention.integrations.flash_attn: flash-attn 2's functions in its (batch, seqlen,
heads, headdim) and packed layouts give what SDPA gives with flash-attn's mask (causal, sliding
and local windows, rewritten as flash-attn rewrites them) written out as a boolean mask and its
ALiBi bias as a float one, what a float64 reference gives with softcapping, and what our op's
attention_weights give with dropout under the same generator state, forward and backward;
flash_attn_with_kvcache writes the new keys into the cache in place and honours per-row lengths,
cache rows, left padding, pages, rotary embeddings, windows, ALiBi and softcapping; the qkv- and
kv-packed functions are the unpacked ones on views of the packed tensor, forward, lse, dropout
and gradients; window_size may be a tuple, a list or an int tensor; the little it does not serve
is refused by name, and bad input gets a typed error naming it."""

import inspect
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import causal_attention
from attention_testing.paged import paged
from attention_testing.parameters import dtype_params
from causal_attention._masks import visible_keys
from nn_testing import run_reference_example
from causal_attention.integrations.flash_attn import (
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
    flash_attn_with_kvcache,
)
from causal_attention.integrations.flash_attn import _dense, _varlen

FLOATS = dtype_params((torch.float64, torch.float32))


def masked_sdpa(q, k, v, visible, scale=None, bias=None):
    """SDPA in flash-attn's layout (..., L, H, D) with an explicit boolean mask ``visible``
    (..., Lq, Lk) (True: may attend) and, where given, a float ``bias`` (..., H, Lq, Lk) added
    to the visible scores; rows with no visible key set to zero as flash-attn does (SDPA would
    give NaN there; the mask is opened for them only to keep its softmax finite, and their
    zeroed output sends no gradient back)."""
    qh, kh, vh = (t.transpose(-3, -2) for t in (q, k, v))
    empty = ~visible.any(-1, keepdim=True)
    attn_mask = (visible | empty).unsqueeze(-3)
    if bias is not None:
        attn_mask = torch.where(attn_mask, bias.to(q.dtype), -math.inf)
    out = F.scaled_dot_product_attention(
        qh, kh, vh, attn_mask=attn_mask, scale=scale, enable_gqa=qh.size(-3) != kh.size(-3),
    )
    return torch.where(empty.unsqueeze(-3), 0.0, out).transpose(-3, -2)


def masked_lse(q, k, visible, scale, bias=None):
    """log-sum-exp of each row's visible scaled scores (plus ``bias`` (..., H, Lq, Lk)), float64,
    (..., H, Lq); -inf for a row with no visible key."""
    qh, kh = (t.transpose(-3, -2).double() for t in (q, k))
    kh = kh.repeat_interleave(qh.size(-3) // kh.size(-3), dim=-3)
    scores = qh @ kh.transpose(-2, -1) * scale
    if bias is not None:
        scores = scores + bias.double()
    scores = scores.masked_fill(~visible.unsqueeze(-3), -math.inf)
    return torch.logsumexp(scores, -1)


def softcapped_reference(q, k, v, visible, scale, softcap):
    """float64 attention in flash-attn's layout with scores ``softcap * tanh(s / softcap)``,
    materialized; differentiable in the float64 copies of q, k, v it returns with the output."""
    leaves = [t.detach().double().requires_grad_(True) for t in (q, k, v)]
    qh, kh, vh = (t.transpose(-3, -2) for t in leaves)
    kh, vh = (t.repeat_interleave(qh.size(-3) // kh.size(-3), dim=-3) for t in (kh, vh))
    scores = softcap * torch.tanh(qh @ kh.transpose(-2, -1) * scale / softcap)
    scores = scores.masked_fill(~visible.unsqueeze(-3), -math.inf)
    probs = torch.softmax(scores, -1).nan_to_num(0.0)  # rows with no visible key: zeros
    return (probs @ vh).transpose(-3, -2), leaves


def alibi_bias(slopes, lq, lk):
    """``-slope * |i + lk - lq - j|`` as (..., H, lq, lk) for slopes (..., H)."""
    distance = (torch.arange(lq).unsqueeze(1) + (lk - lq) - torch.arange(lk)).abs()
    return -slopes[..., None, None].double() * distance


def grads(out, inputs, grad_out):
    return torch.autograd.grad(out, inputs, grad_out)


def bshd(batch, length, heads, dim, dtype, requires_grad=False):
    return torch.randn(batch, length, heads, dim, dtype=dtype).requires_grad_(requires_grad)


# ---------------------------------------------------------------------------------------------
# flash_attn_func


FUNC_CASES = [
    pytest.param(2, 17, 17, 2, 2, 16, 16, id="self"),
    pytest.param(2, 5, 23, 4, 2, 16, 16, id="gqa-Lq<Lk"),
    pytest.param(1, 19, 6, 4, 1, 8, 8, id="mqa-Lq>Lk"),
    pytest.param(3, 1, 40, 6, 3, 16, 8, id="decode-Dv8"),
    pytest.param(1, 70, 70, 2, 1, 8, 8, id="two-blocks"),
]


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("batch,lq,lk,hq,hkv,d,dv", FUNC_CASES)
def test_flash_attn_func_matches_masked_sdpa_and_our_op(batch, lq, lk, hq, hkv, d, dv, dtype):
    q = bshd(batch, lq, hq, d, dtype, True)
    k = bshd(batch, lk, hkv, d, dtype, True)
    v = bshd(batch, lk, hkv, dv, dtype, True)
    out = flash_attn_func(q, k, v, causal=True)
    assert out.shape == (batch, lq, hq, dv) and out.is_contiguous()
    ref = masked_sdpa(q, k, v, visible_keys(lq, lk))
    torch.testing.assert_close(out, ref)
    grad_out = torch.randn_like(out)
    for ours, theirs in zip(grads(out, (q, k, v), grad_out), grads(ref, (q, k, v), grad_out)):
        torch.testing.assert_close(ours, theirs)
    op = causal_attention.attention(*(t.transpose(1, 2) for t in (q, k, v))).transpose(1, 2)
    assert torch.equal(out, op)


@pytest.mark.parametrize("dtype", FLOATS)
def test_flash_attn_func_lse_and_empty_dropout_mask(dtype):
    q, k, v = bshd(2, 9, 4, 16, dtype), bshd(2, 6, 2, 16, dtype), bshd(2, 6, 2, 16, dtype)
    out, lse, s_dmask = flash_attn_func(q, k, v, softmax_scale=0.3, causal=True,
                                        return_attn_probs=True)
    assert torch.equal(out, flash_attn_func(q, k, v, softmax_scale=0.3, causal=True))
    assert lse.shape == (2, 4, 9)
    torch.testing.assert_close(lse.double(), masked_lse(q, k, visible_keys(9, 6), 0.3))
    # Rows 0-2 see no key (Lq > Lk): log of an empty sum.
    assert torch.all(lse[:, :, :3] == -math.inf)
    # flash-attn's S_dmask without dropout is an empty tensor of q's dtype.
    assert s_dmask.shape == (0,) and s_dmask.dtype == dtype


def test_flash_attn_func_scale_and_positional_arguments():
    q, k, v = bshd(2, 11, 4, 8, torch.float64), bshd(2, 11, 2, 8, torch.float64), \
        bshd(2, 11, 2, 8, torch.float64)
    out = flash_attn_func(q, k, v, 0.0, 0.7, True)
    torch.testing.assert_close(out, masked_sdpa(q, k, v, visible_keys(11, 11), scale=0.7))
    assert torch.equal(out, flash_attn_func(q, k, v, softmax_scale=0.7, causal=True))


# Calls whose flash-attn mask is causality itself: windows that hide nothing, and non-causal
# calls with one query row.
NON_BITING = [
    pytest.param(8, 12, dict(causal=True, window_size=(-1, -1)), id="causal"),
    pytest.param(8, 12, dict(causal=True, window_size=[-1, 0]), id="causal-(-1,0)-list"),
    pytest.param(8, 12, dict(causal=True, window_size=(11, 0)), id="left=Lk-1"),
    pytest.param(8, 12, dict(causal=True, window_size=(40, 3)), id="left>Lk-right-ignored"),
    pytest.param(8, 12, dict(causal=False, window_size=(-1, 0)), id="noncausal-(-1,0)"),
    pytest.param(8, 12, dict(causal=False, window_size=(11, 0)), id="noncausal-(Lk-1,0)"),
    pytest.param(1, 12, dict(causal=False), id="noncausal-one-row"),
    pytest.param(1, 12, dict(causal=False, window_size=(-1, 4)), id="noncausal-one-row-right"),
    pytest.param(12, 5, dict(causal=True, window_size=(4, 0)), id="Lq>Lk-left=Lk-1"),
]


@pytest.mark.parametrize("lq,lk,kwargs", NON_BITING)
def test_windows_that_do_not_bite_are_served(lq, lk, kwargs):
    q, k, v = bshd(2, lq, 2, 8, torch.float64), bshd(2, lk, 2, 8, torch.float64), \
        bshd(2, lk, 2, 8, torch.float64)
    out = flash_attn_func(q, k, v, **kwargs)
    torch.testing.assert_close(out, masked_sdpa(q, k, v, visible_keys(lq, lk)))
    assert torch.equal(out, flash_attn_func(q, k, v, causal=True))


def test_deterministic_changes_nothing():
    q, k, v = (bshd(1, 9, 2, 8, torch.float32) for _ in range(3))
    assert torch.equal(
        flash_attn_func(q, k, v, causal=True, deterministic=True),
        flash_attn_func(q, k, v, causal=True, deterministic=False),
    )


# flash_attn_func's windows: (lq, lk, hq, hkv, causal, window_size), each computed as the
# documented window (left, right), causal setting right = 0.
WINDOWS = [
    pytest.param(20, 20, 2, 2, True, (5, -1), id="sliding"),
    pytest.param(6, 25, 4, 2, True, (7, 0), id="sliding-chunk-on-cache"),
    pytest.param(19, 6, 2, 1, True, (2, 3), id="sliding-Lq>Lk"),
    pytest.param(20, 20, 2, 2, False, (3, 2), id="local"),
    pytest.param(12, 17, 4, 2, False, (-1, 2), id="right-bounded"),
    pytest.param(17, 17, 2, 2, False, (4, -1), id="left-bounded-noncausal"),
    pytest.param(9, 14, 2, 2, False, (-1, -1), id="full"),
    pytest.param(14, 5, 4, 1, False, (-1, -1), id="full-Lq>Lk"),
    pytest.param(70, 70, 2, 1, True, (20, 0), id="sliding-two-blocks"),
]


def window_of(lq, lk, causal, window_size):
    left, right = window_size
    return visible_keys(lq, lk, (left, 0 if causal else right))


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("lq,lk,hq,hkv,causal,window_size", WINDOWS)
def test_flash_attn_func_windows_match_masked_sdpa(lq, lk, hq, hkv, causal, window_size, dtype):
    q, k, v = bshd(2, lq, hq, 16, dtype, True), bshd(2, lk, hkv, 16, dtype, True), \
        bshd(2, lk, hkv, 8, dtype, True)
    out = flash_attn_func(q, k, v, causal=causal, window_size=window_size)
    ref = masked_sdpa(q, k, v, window_of(lq, lk, causal, window_size))
    torch.testing.assert_close(out, ref)
    grad_out = torch.randn_like(out)
    for ours, theirs in zip(grads(out, (q, k, v), grad_out), grads(ref, (q, k, v), grad_out)):
        torch.testing.assert_close(ours, theirs)


def rows_seeing(lq, lk, keys_of_row):
    """(lq, lk) visibility from {row: (first, last)} (inclusive), other rows seeing nothing."""
    visible = torch.zeros(lq, lk, dtype=torch.bool)
    for row, (first, last) in keys_of_row.items():
        visible[row, first : last + 1] = True
    return visible


# flash-attn's rewriting of the window (flash_api.cpp), written out by hand: (lq, lk, kwargs,
# {row: (first key, last key)} for the rows that see any key).
REWRITTEN = [
    # A one-sided window gets seqlen_k for its open side: with Lq = 10 > Lk + 1 = 3 that cuts
    # rows 0-5, which sit more than seqlen_k = 2 keys before the last one (row i: [i-9, i-6]).
    pytest.param(10, 2, dict(window_size=(1, -1)), {6: (0, 0), 7: (0, 1), 8: (0, 1), 9: (0, 1)},
                 id="open-right-becomes-seqlen_k"),
    # Bounds of at least seqlen_k are unbounded: full attention, every row sees both keys.
    pytest.param(10, 2, dict(window_size=(100, 2)), {i: (0, 1) for i in range(10)},
                 id="bounds>=seqlen_k-are-unbounded"),
    # Any negative bound is unbounded: (-3, 0) is causality.
    pytest.param(4, 6, dict(window_size=(-3, 0)), {i: (0, i + 2) for i in range(4)},
                 id="negative-is-unbounded"),
    # One query row without ALiBi: causal is dropped, and the row sees every key either way.
    pytest.param(1, 6, dict(causal=True, window_size=(2, 5)), {0: (3, 5)}, id="one-row"),
]


@pytest.mark.parametrize("lq,lk,kwargs,keys_of_row", REWRITTEN)
def test_flash_attn_func_rewrites_the_window_as_flash_attn(lq, lk, kwargs, keys_of_row):
    q, k, v = bshd(2, lq, 2, 8, torch.float64), bshd(2, lk, 2, 8, torch.float64), \
        bshd(2, lk, 2, 8, torch.float64)
    out = flash_attn_func(q, k, v, **kwargs)
    torch.testing.assert_close(out, masked_sdpa(q, k, v, rows_seeing(lq, lk, keys_of_row)))


# ALiBi: (lq, lk, causal, window_size, slopes per batch row or shared)
ALIBI = [
    pytest.param(11, 11, True, (-1, -1), False, id="causal-kernel"),
    pytest.param(5, 13, True, (-1, -1), True, id="causal-kernel-on-cache-per-batch"),
    pytest.param(11, 11, True, (4, 0), True, id="sliding"),
    pytest.param(9, 14, False, (-1, -1), False, id="full"),
    pytest.param(1, 9, True, (-1, -1), True, id="one-row-stays-causal"),
]


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("lq,lk,causal,window_size,per_batch", ALIBI)
def test_flash_attn_func_alibi_matches_biased_sdpa(lq, lk, causal, window_size, per_batch, dtype):
    batch, heads = 2, 4
    slopes = torch.rand(batch, heads) if per_batch else torch.rand(heads)
    q, k, v = bshd(batch, lq, heads, 16, dtype, True), bshd(batch, lk, 2, 16, dtype, True), \
        bshd(batch, lk, 2, 16, dtype, True)
    kwargs = dict(causal=causal, window_size=window_size, alibi_slopes=slopes)
    out, lse, _ = flash_attn_func(q, k, v, return_attn_probs=True, **kwargs)
    assert torch.equal(out, flash_attn_func(q, k, v, **kwargs))
    visible = window_of(lq, lk, causal, window_size)
    bias = alibi_bias(slopes if per_batch else slopes.expand(batch, -1), lq, lk)
    ref = masked_sdpa(q, k, v, visible, bias=bias)
    torch.testing.assert_close(out, ref)
    grad_out = torch.randn_like(out)
    for ours, theirs in zip(grads(out, (q, k, v), grad_out), grads(ref, (q, k, v), grad_out)):
        torch.testing.assert_close(ours, theirs)
    if causal and window_size[0] < 0:
        # flash-attn's causal kernel adds slope * j (the same probabilities): its lse is of that.
        bias = (slopes if per_batch else slopes.expand(batch, -1))[..., None, None] * \
            torch.arange(lk)
    torch.testing.assert_close(lse, masked_lse(q, k, visible, 16 ** -0.5, bias).to(lse.dtype))


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("causal,window_size", [(True, (-1, -1)), (True, (6, 0)), (False, (3, 3))])
def test_flash_attn_func_softcap_matches_float64_reference(causal, window_size, dtype):
    lq, lk, softcap = 13, 17, 0.7  # scores of randn inputs are about 1: the cap bites
    q, k, v = bshd(2, lq, 4, 16, dtype, True), bshd(2, lk, 2, 16, dtype, True), \
        bshd(2, lk, 2, 8, dtype, True)
    out = flash_attn_func(q, k, v, causal=causal, window_size=window_size, softcap=softcap)
    ref, leaves = softcapped_reference(q, k, v, window_of(lq, lk, causal, window_size),
                                       16 ** -0.5, softcap)
    torch.testing.assert_close(out, ref.to(dtype))
    grad_out = torch.randn_like(out)
    for ours, theirs in zip(grads(out, (q, k, v), grad_out),
                            grads(ref, leaves, grad_out.double())):
        torch.testing.assert_close(ours, theirs.to(dtype))
    # softcap <= 0 is off, as in flash-attn.
    assert torch.equal(flash_attn_func(q, k, v, causal=causal, window_size=window_size,
                                       softcap=-1.0),
                       flash_attn_func(q, k, v, causal=causal, window_size=window_size))


def dropped_reference(q, k, v, dropout_p, **kwargs):
    """attention_weights (dropped as attention drops them, for the same generator state) times
    v, in flash-attn's layout; differentiable."""
    qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))
    weights = causal_attention.attention_weights(qh, kh, vh, dropout_p=dropout_p, **kwargs)
    return (weights @ vh.repeat_interleave(qh.size(1) // vh.size(1), dim=1)).transpose(1, 2)


def test_flash_attn_func_dropout_is_attention_weights_dropout_for_the_same_seed():
    q, k, v = bshd(2, 15, 4, 16, torch.float64, True), bshd(2, 15, 2, 16, torch.float64, True), \
        bshd(2, 15, 2, 16, torch.float64, True)
    kwargs = dict(dropout_p=0.3, causal=True, window_size=(6, 0), softcap=2.0,
                  alibi_slopes=torch.rand(4))
    torch.manual_seed(7)
    out = flash_attn_func(q, k, v, **kwargs)
    torch.manual_seed(7)
    ref = dropped_reference(q, k, v, 0.3, window=(6, 0), softcap=2.0,
                            alibi_slopes=kwargs["alibi_slopes"])
    torch.testing.assert_close(out, ref)
    grad_out = torch.randn_like(out)
    for ours, theirs in zip(grads(out, (q, k, v), grad_out), grads(ref, (q, k, v), grad_out)):
        torch.testing.assert_close(ours, theirs)
    # The same seed gives the same result bit for bit, another seed another dropout mask.
    torch.manual_seed(7)
    assert torch.equal(flash_attn_func(q, k, v, **kwargs), out)
    assert not torch.allclose(flash_attn_func(q, k, v, **kwargs), out)


# ---------------------------------------------------------------------------------------------
# flash_attn_varlen_func


def packed(lengths_q, lengths_k, hq, hkv, d, dv, dtype):
    q = torch.randn(sum(lengths_q), hq, d, dtype=dtype, requires_grad=True)
    k = torch.randn(sum(lengths_k), hkv, d, dtype=dtype, requires_grad=True)
    v = torch.randn(sum(lengths_k), hkv, dv, dtype=dtype, requires_grad=True)
    cu_q = torch.tensor([0] + lengths_q, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    cu_k = torch.tensor([0] + lengths_k, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    return q, k, v, cu_q, cu_k


def packed_visible(lengths_q, lengths_k):
    """(total_q, total_k): each sequence sees itself, bottom-right causal."""
    visible = torch.zeros(sum(lengths_q), sum(lengths_k), dtype=torch.bool)
    row = col = 0
    for lq, lk in zip(lengths_q, lengths_k):
        visible[row : row + lq, col : col + lk] = visible_keys(lq, lk)
        row, col = row + lq, col + lk
    return visible


VARLEN_CASES = [
    pytest.param([5, 0, 9, 1], [5, 0, 9, 1], 2, 2, id="self-with-empty"),
    pytest.param([2, 3, 0, 4], [6, 3, 4, 9], 4, 2, id="chunks-on-caches-gqa"),
    pytest.param([4, 1, 3], [2, 0, 3], 4, 1, id="Lq>Lk-mqa"),
    pytest.param([0, 0], [0, 3], 2, 2, id="no-queries"),
    pytest.param([70, 33], [70, 40], 2, 1, id="longer"),
]


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("lengths_q,lengths_k,hq,hkv", VARLEN_CASES)
def test_flash_attn_varlen_func_matches_masked_sdpa_and_our_op(lengths_q, lengths_k, hq, hkv,
                                                              dtype):
    q, k, v, cu_q, cu_k = packed(lengths_q, lengths_k, hq, hkv, 16, 8, dtype)
    max_q, max_k = max(lengths_q), max(lengths_k)
    out = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, causal=True)
    assert out.shape == (sum(lengths_q), hq, 8)
    ref = masked_sdpa(q, k, v, packed_visible(lengths_q, lengths_k))
    torch.testing.assert_close(out, ref)
    grad_out = torch.randn_like(out)
    for ours, theirs in zip(grads(out, (q, k, v), grad_out), grads(ref, (q, k, v), grad_out)):
        torch.testing.assert_close(ours, theirs)
    op = causal_attention.varlen_attention(q, k, v, cu_q, cu_k, max_q, max_k)
    assert torch.equal(out, op)


@pytest.mark.parametrize("dtype", FLOATS)
def test_flash_attn_varlen_func_lse(dtype):
    lengths_q, lengths_k = [3, 0, 5, 2], [1, 2, 5, 0]
    q, k, v, cu_q, cu_k = packed(lengths_q, lengths_k, 4, 2, 16, 16, dtype)
    out, lse, s_dmask = flash_attn_varlen_func(
        q, k, v, cu_q, cu_k, 5, 5, softmax_scale=0.25, causal=True, return_attn_probs=True
    )
    assert torch.equal(out, flash_attn_varlen_func(q, k, v, cu_q, cu_k, 5, 5,
                                                   softmax_scale=0.25, causal=True))
    assert lse.shape == (4, 10)
    visible = packed_visible(lengths_q, lengths_k)
    torch.testing.assert_close(lse.double(), masked_lse(q, k, visible, 0.25))
    assert s_dmask.numel() == 0
    # Out of graph: lse is not differentiable, out is.
    out.sum().backward()
    assert q.grad is not None


def test_flash_attn_varlen_func_served_windows_and_one_row_sequences():
    q, k, v, cu_q, cu_k = packed([1, 1, 0], [4, 6, 2], 2, 2, 8, 8, torch.float64)
    causal = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 1, 6, causal=True)
    # At most one query row per sequence: non-causal is causal.
    assert torch.equal(flash_attn_varlen_func(q, k, v, cu_q, cu_k, 1, 6), causal)
    assert torch.equal(
        flash_attn_varlen_func(q, k, v, cu_q, cu_k, 1, 6, causal=True, window_size=(5, 0)), causal
    )


def packed_window_visible(lengths_q, lengths_k, window):
    """(total_q, total_k): each sequence sees itself through ``visible_keys``' window."""
    visible = torch.zeros(sum(lengths_q), sum(lengths_k), dtype=torch.bool)
    row = col = 0
    for lq, lk in zip(lengths_q, lengths_k):
        visible[row : row + lq, col : col + lk] = visible_keys(lq, lk, window)
        row, col = row + lq, col + lk
    return visible


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize(
    "causal,window_size,window",
    [(True, (-1, -1), (-1, 0)), (True, (3, -1), (3, 0)), (False, (2, 1), (2, 1)),
     (False, (-1, -1), (-1, -1))],
    ids=["causal-kernel", "sliding", "local", "full"],
)
def test_flash_attn_varlen_func_windows_and_alibi_per_sequence(causal, window_size, window,
                                                              dtype):
    lengths_q, lengths_k = [5, 0, 9, 3], [8, 2, 9, 3]
    q, k, v, cu_q, cu_k = packed(lengths_q, lengths_k, 4, 2, 16, 8, dtype)
    slopes = torch.rand(len(lengths_q), 4)
    kwargs = dict(causal=causal, window_size=window_size, alibi_slopes=slopes)
    out, lse, _ = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 9, 9, return_attn_probs=True,
                                         **kwargs)
    assert torch.equal(out, flash_attn_varlen_func(q, k, v, cu_q, cu_k, 9, 9, **kwargs))
    # The reference: each sequence alone, through flash_attn_func's own reference.
    visible = packed_window_visible(lengths_q, lengths_k, window)
    bias = torch.zeros(4, sum(lengths_q), sum(lengths_k), dtype=torch.float64)
    lse_bias = bias.clone()
    row = col = 0
    for n, (lq, lk) in enumerate(zip(lengths_q, lengths_k)):
        block = (slice(None), slice(row, row + lq), slice(col, col + lk))
        bias[block] = alibi_bias(slopes[n], lq, lk)
        # flash-attn's causal kernel adds slope * j, j counted from the sequence's first key.
        lse_bias[block] = slopes[n, :, None, None].double() * torch.arange(lk) \
            if window == (-1, 0) else bias[block]
        row, col = row + lq, col + lk
    ref = masked_sdpa(q, k, v, visible, bias=bias)
    torch.testing.assert_close(out, ref)
    grad_out = torch.randn_like(out)
    for ours, theirs in zip(grads(out, (q, k, v), grad_out), grads(ref, (q, k, v), grad_out)):
        torch.testing.assert_close(ours, theirs)
    expected_lse = masked_lse(q, k, visible, 16 ** -0.5, lse_bias)
    torch.testing.assert_close(lse, expected_lse.to(lse.dtype))


def test_flash_attn_varlen_func_softcap_and_dropout():
    lengths = [6, 6, 6]
    q, k, v, cu_q, cu_k = packed(lengths, lengths, 4, 2, 16, 16, torch.float64)
    out = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 6, 6, causal=True, softcap=0.5)
    ref, _ = softcapped_reference(q, k, v, packed_visible(lengths, lengths), 16 ** -0.5, 0.5)
    torch.testing.assert_close(out, ref)
    # Dropout keys each sequence's mask by its index: equal sequences are a dense batch.
    torch.manual_seed(3)
    out = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 6, 6, dropout_p=0.4, causal=True)
    torch.manual_seed(3)
    dense = (t.unflatten(0, (3, 6)) for t in (q, k, v))
    torch.testing.assert_close(out, dropped_reference(*dense, 0.4).flatten(0, 1))


# ---------------------------------------------------------------------------------------------
# flash_attn_with_kvcache


def expected_cache(cache, new, rows, seqlens):
    """The cache after flash-attn's append: row rows[b] gets new[b] at seqlens[b] onwards."""
    expected = cache.clone()
    for b, (row, start) in enumerate(zip(rows, seqlens)):
        expected[row, start : start + new.size(1)] = new[b]
    return expected


def kv_visible(lq, capacity, starts, ends, window=(-1, 0)):
    """(batch, Lq, capacity): row b, query i sees cache position j iff starts[b] <= j < ends[b]
    and ``visible_keys``' window (causal by default) aligned to the row's own length,
    ends[b] - Lq + i the diagonal."""
    j = torch.arange(capacity)
    masks = [
        (j >= s) & (j < e) & F.pad(visible_keys(lq, e, window), (0, capacity - e))
        for s, e in zip(starts, ends)
    ]
    return torch.stack(masks) if masks else torch.zeros(0, lq, capacity, dtype=torch.bool)


KV_CASES = [
    # batch, lq, new, seqlens, leftpad, batch_idx (None: rows 0..B-1), cache rows
    pytest.param(3, 2, 2, [3, 0, 7], None, None, 3, id="append-per-row-lengths"),
    pytest.param(3, 1, 1, [5, 0, 11], None, None, 3, id="decode-append"),
    pytest.param(4, 1, 0, [6, 1, 12, 0], None, None, 4, id="decode-no-append"),
    pytest.param(2, 3, 3, [4, 4], None, None, 2, id="equal-lengths"),
    pytest.param(3, 4, 4, [2, 6, 6], None, None, 3, id="chunk-two-groups"),
    pytest.param(3, 5, 2, [1, 6, 9], None, None, 3, id="Lq>new-empty-rows"),
    pytest.param(3, 2, 2, [5, 8, 3], [2, 0, 3], None, 3, id="leftpad"),
    pytest.param(2, 3, 3, [6, 6], [1, 4], None, 2, id="leftpad-same-end"),
    pytest.param(3, 1, 1, [4, 9, 2], [1, 5, 2], None, 3, id="decode-leftpad"),
    pytest.param(3, 2, 2, [4, 7, 1], None, [4, 0, 2], 5, id="cache_batch_idx"),
    pytest.param(2, 1, 1, [3, 6], None, [3, 1], 4, id="decode-cache_batch_idx"),
    pytest.param(2, 2, 2, [60, 100], None, None, 2, id="longer"),
]


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("batch,lq,new,seqlens,leftpad,batch_idx,cache_rows", KV_CASES)
def test_kvcache_appends_in_place_and_matches_masked_sdpa(
    batch, lq, new, seqlens, leftpad, batch_idx, cache_rows, dtype
):
    capacity, hq, hkv, d, dv = 112, 4, 2, 16, 8
    k_cache = bshd(cache_rows, capacity, hkv, d, dtype)
    v_cache = bshd(cache_rows, capacity, hkv, dv, dtype)
    before_k, before_v = k_cache.clone(), v_cache.clone()
    q = bshd(batch, lq, hq, d, dtype)
    k, v = bshd(batch, new, hkv, d, dtype), bshd(batch, new, hkv, dv, dtype)
    kwargs = dict(cache_seqlens=torch.tensor(seqlens, dtype=torch.int32), causal=True)
    if leftpad is not None:
        kwargs["cache_leftpad"] = torch.tensor(leftpad, dtype=torch.int32)
    if batch_idx is not None:
        kwargs["cache_batch_idx"] = torch.tensor(batch_idx, dtype=torch.int32)
    out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, k, v, return_softmax_lse=True,
                                       **kwargs)
    assert out.shape == (batch, lq, hq, dv) and lse.shape == (batch, hq, lq)
    rows = batch_idx if batch_idx is not None else list(range(batch))
    if new:
        before_k = expected_cache(before_k, k, rows, seqlens)
        before_v = expected_cache(before_v, v, rows, seqlens)
    assert torch.equal(k_cache, before_k) and torch.equal(v_cache, before_v)

    starts = leftpad if leftpad is not None else [0] * batch
    ends = [s + new for s in seqlens]
    visible = kv_visible(lq, capacity, starts, ends)
    ref = masked_sdpa(q, k_cache[rows], v_cache[rows], visible)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(lse.double(), masked_lse(q, k_cache[rows], visible, d ** -0.5))
    # Once written, the new keys are the cache's: the same call without them gives the same.
    kwargs["cache_seqlens"] = torch.tensor(ends, dtype=torch.int32)
    assert torch.equal(out, flash_attn_with_kvcache(q, k_cache, v_cache, **kwargs))
    # Each row is our op on that row's own keys.
    for b in range(batch):
        keys = slice(starts[b], ends[b])
        row = causal_attention.attention(
            q[b].transpose(0, 1), k_cache[rows[b], keys].transpose(0, 1),
            v_cache[rows[b], keys].transpose(0, 1),
        )
        torch.testing.assert_close(out[b], row.transpose(0, 1))


# Windows, ALiBi and softcapping on a cache with per-row lengths and left padding:
# (lq, new, causal, window_size, with ALiBi, softcap)
KV_SCORES = [
    pytest.param(2, 2, True, (3, 0), False, 0.0, id="sliding"),
    pytest.param(1, 1, True, (3, 0), False, 0.0, id="decode-sliding"),
    pytest.param(3, 3, False, (2, 1), False, 0.0, id="local"),
    pytest.param(2, 2, True, (-1, -1), True, 0.0, id="alibi-causal-kernel"),
    pytest.param(1, 1, True, (4, 0), True, 0.0, id="decode-alibi-sliding"),
    pytest.param(2, 0, True, (-1, -1), False, 0.6, id="softcap"),
]


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("lq,new,causal,window_size,alibi,softcap", KV_SCORES)
def test_kvcache_windows_alibi_and_softcap_per_row(lq, new, causal, window_size, alibi, softcap,
                                                  dtype):
    batch, capacity, hq, hkv, d = 3, 24, 4, 2, 16
    seqlens, leftpad = [5, 0, 11], [2, 0, 4]
    k_cache, v_cache = bshd(batch, capacity, hkv, d, dtype), bshd(batch, capacity, hkv, d, dtype)
    q = bshd(batch, lq, hq, d, dtype)
    k, v = bshd(batch, new, hkv, d, dtype), bshd(batch, new, hkv, d, dtype)
    slopes = torch.rand(batch, hq) if alibi else None
    out, lse = flash_attn_with_kvcache(
        q, k_cache, v_cache, k, v, cache_seqlens=torch.tensor(seqlens, dtype=torch.int32),
        cache_leftpad=torch.tensor(leftpad, dtype=torch.int32), causal=causal,
        window_size=window_size, softcap=softcap, alibi_slopes=slopes, return_softmax_lse=True,
    )
    ends = [s + new for s in seqlens]
    window = (window_size[0], 0 if causal else window_size[1])
    visible = kv_visible(lq, capacity, leftpad, ends, window)
    scale = d ** -0.5
    if softcap:
        ref, _ = softcapped_reference(q, k_cache, v_cache, visible, scale, softcap)
        torch.testing.assert_close(out, ref.to(dtype))
        return
    bias = lse_bias = None
    if alibi:
        bias = torch.stack([F.pad(alibi_bias(slopes[b], lq, e), (0, capacity - e))
                            for b, e in enumerate(ends)])
        lse_bias = bias
        if window[0] < 0:
            # The causal kernel's slope * j, j counted from the row's first key (after leftpad).
            lse_bias = slopes[..., None, None] * (torch.arange(capacity) -
                                                  torch.tensor(leftpad)[:, None, None, None])
    torch.testing.assert_close(out, masked_sdpa(q, k_cache, v_cache, visible, bias=bias))
    expected_lse = masked_lse(q, k_cache, visible, scale, lse_bias)
    torch.testing.assert_close(lse, expected_lse.to(lse.dtype))


def test_kvcache_int_seqlens_and_no_seqlens():
    k_cache, v_cache = bshd(2, 20, 2, 8, torch.float64), bshd(2, 20, 2, 8, torch.float64)
    q, k, v = (bshd(2, 3, 2, 8, torch.float64) for _ in range(3))
    lengths = torch.tensor([9, 9], dtype=torch.int32)
    reference_cache = (k_cache.clone(), v_cache.clone())
    by_tensor = flash_attn_with_kvcache(q, *reference_cache, k, v, cache_seqlens=lengths,
                                        causal=True)
    assert torch.equal(flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=9,
                                               causal=True), by_tensor)
    assert torch.equal(k_cache, reference_cache[0])
    # Without cache_seqlens every row attends to the whole cache.
    whole = flash_attn_with_kvcache(q, k_cache, v_cache, causal=True)
    torch.testing.assert_close(whole, masked_sdpa(q, k_cache, v_cache, visible_keys(3, 20)))


def test_kvcache_unused_slots_never_reach_the_output():
    """Slots past a row's length and before its left padding may hold anything (a cache made
    with torch.empty): NaN there changes nothing."""
    q = bshd(3, 1, 4, 16, torch.float32)
    clean_k, clean_v = bshd(3, 50, 2, 16, torch.float32), bshd(3, 50, 2, 16, torch.float32)
    lengths, leftpad = [10, 33, 4], [0, 7, 2]
    dirty_k, dirty_v = clean_k.clone(), clean_v.clone()
    for b, (s, e) in enumerate(zip(leftpad, lengths)):
        for cache in (dirty_k, dirty_v):
            cache[b, :s] = math.nan
            cache[b, e:] = math.nan
    kwargs = dict(cache_seqlens=torch.tensor(lengths, dtype=torch.int32),
                  cache_leftpad=torch.tensor(leftpad, dtype=torch.int32), causal=True)
    dirty = flash_attn_with_kvcache(q, dirty_k, dirty_v, **kwargs)
    assert torch.isfinite(dirty).all()
    assert torch.equal(dirty, flash_attn_with_kvcache(q, clean_k, clean_v, **kwargs))


def test_kvcache_is_not_differentiable_as_in_flash_attn():
    q = bshd(1, 1, 2, 8, torch.float32, requires_grad=True)
    k_cache, v_cache = bshd(1, 6, 2, 8, torch.float32), bshd(1, 6, 2, 8, torch.float32)
    assert not flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=4).requires_grad


def rotate_reference(x, cos, sin, positions, interleaved):
    """Rotary embedding as complex multiplication, float64: the pair (x_a, x_b) is x_a + i x_b
    times cos + i sin; pairs (2j, 2j+1) interleaved, else (j, j + rotary_dim / 2)."""
    half = cos.size(1)
    part = x.double()[..., : 2 * half]
    if interleaved:
        pairs = part.unflatten(-1, (half, 2))
    else:
        pairs = torch.stack((part[..., :half], part[..., half:]), dim=-1)
    angle = torch.complex(cos.double()[positions], sin.double()[positions]).unsqueeze(2)
    turned = torch.view_as_real(torch.view_as_complex(pairs.contiguous()) * angle)
    turned = turned.flatten(-2) if interleaved else torch.cat((turned[..., 0], turned[..., 1]), -1)
    return torch.cat((turned, x.double()[..., 2 * half :]), dim=-1)


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("interleaved", [True, False], ids=["interleaved", "neox"])
@pytest.mark.parametrize("lq,new", [(1, 1), (3, 3), (4, 2)])
@pytest.mark.parametrize("causal,window", [(True, (-1, -1)), (False, (-1, -1)), (False, (3, 1))],
                         ids=["causal", "full", "local"])
def test_kvcache_rotary_turns_q_and_new_keys_at_their_positions(causal, window, lq, new,
                                                                interleaved, dtype):
    batch, capacity, hq, hkv, d, rotary_dim = 3, 24, 4, 2, 16, 8
    seqlens, leftpad = [5, 0, 11], [2, 0, 4]
    # flash-attn's rule: token i of row b is at position cache_seqlens[b] + i (left padding and
    # all) for the new keys, and for q where the mask is causal or local; with neither, every
    # query row is at cache_seqlens[b]. Values are not rotated. The table is as long as the
    # rotated tokens reach, no longer.
    query_steps = torch.arange(lq) if causal or window != (-1, -1) else torch.zeros(lq).long()
    positions = torch.tensor(seqlens).unsqueeze(1)
    seqlen_ro = int(positions.max()) + max(new, int(query_steps.max()) + 1)
    theta = torch.rand(seqlen_ro, rotary_dim // 2, dtype=torch.float64) * 6
    cos, sin = theta.cos().to(dtype), theta.sin().to(dtype)
    k_cache, v_cache = bshd(batch, capacity, hkv, d, dtype), bshd(batch, capacity, hkv, d, dtype)
    q, k, v = bshd(batch, lq, hq, d, dtype), bshd(batch, new, hkv, d, dtype), \
        bshd(batch, new, hkv, d, dtype)
    before_k, before_v = k_cache.clone(), v_cache.clone()
    out = flash_attn_with_kvcache(
        q, k_cache, v_cache, k, v, cos, sin, torch.tensor(seqlens, dtype=torch.int32),
        cache_leftpad=torch.tensor(leftpad, dtype=torch.int32), causal=causal,
        window_size=window, rotary_interleaved=interleaved,
    )
    k_rot = rotate_reference(k, cos, sin, positions + torch.arange(new), interleaved).to(dtype)
    q_rot = rotate_reference(q, cos, sin, positions + query_steps, interleaved).to(dtype)
    rows = list(range(batch))
    expected_k = expected_cache(before_k, k_rot, rows, seqlens)
    torch.testing.assert_close(k_cache, expected_k, rtol=0, atol=4 * torch.finfo(dtype).eps)
    assert torch.equal(v_cache, expected_cache(before_v, v, rows, seqlens))
    ends = [s + new for s in seqlens]
    visible = kv_visible(lq, capacity, leftpad, ends, (-1, 0) if causal else window)
    torch.testing.assert_close(out, masked_sdpa(q_rot, expected_k, v_cache, visible))


def paged_copy(k_cache, v_cache, page, spare_pages=3):
    """A paged cache holding ``k_cache``/``v_cache`` (batch, capacity, H, D): pages shuffled, the
    spare ones NaN, and a block table whose rows end in a column naming no page."""
    batch, capacity = k_cache.shape[:2]
    per_row = capacity // page
    total = batch * per_row + spare_pages
    order = torch.randperm(total)
    table = torch.full((batch, per_row + 1), 10**6, dtype=torch.int32)
    table[:, :per_row] = order[: batch * per_row].view(batch, per_row)
    paged = []
    for cache in (k_cache, v_cache):
        pages = cache.new_full((total, page) + tuple(cache.shape[2:]), math.nan)
        pages[table[:, :per_row].long()] = cache.unflatten(1, (per_row, page))
        paged.append(pages)
    return paged[0], paged[1], table


def unpage(pages, table, capacity):
    return pages[table[:, : capacity // pages.size(1)].long()].flatten(1, 2)


PAGED_SCORES = {
    "causal": dict(causal=True),
    "window": dict(causal=True, window_size=(5, 0)),
    "local": dict(causal=False, window_size=(6, 2)),
    "full": dict(causal=False),
    "softcap": dict(causal=True, softcap=2.0),
    "alibi": dict(causal=True, alibi_slopes=torch.tensor([0.5, 0.25, 0.125, 0.0625])),
    "alibi-full": dict(causal=False, alibi_slopes=torch.rand(3, 4)),
}


@pytest.mark.parametrize("scores", list(PAGED_SCORES))
@pytest.mark.parametrize("lq,new", [(1, 1), (2, 2), (1, 0), (9, 2)])
def test_kvcache_block_table_is_the_contiguous_cache(lq, new, scores):
    """The pages, read in place (paged_attention), give the contiguous cache's output and
    softmax_lse, for every score option; (9, 2): more queries than the first row's keys."""
    batch, capacity, page = 3, 32, 8
    k_cache, v_cache = bshd(batch, capacity, 2, 16, torch.float64), \
        bshd(batch, capacity, 2, 16, torch.float64)
    k_pages, v_pages, table = paged_copy(k_cache, v_cache, page)
    q = bshd(batch, lq, 4, 16, torch.float64)
    k, v = bshd(batch, new, 2, 16, torch.float64), bshd(batch, new, 2, 16, torch.float64)
    lengths = torch.tensor([7, 16, 30 - new], dtype=torch.int32)  # ends inside and at pages
    # Columns past the pages a row uses are not read: flash-attn leaves them unspecified.
    used = table.clone()
    for b, end in enumerate((lengths + new).tolist()):
        used[b, -(-end // page) :] = 10**6
    options = PAGED_SCORES[scores]
    paged, paged_lse = flash_attn_with_kvcache(q, k_pages, v_pages, k, v, cache_seqlens=lengths,
                                               block_table=used, return_softmax_lse=True,
                                               **options)
    contiguous, lse = flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lengths,
                                              return_softmax_lse=True, **options)
    torch.testing.assert_close(paged, contiguous, rtol=0, atol=1e-13)
    torch.testing.assert_close(paged_lse, lse, rtol=0, atol=1e-12)
    assert torch.isfinite(paged).all()
    assert torch.equal(unpage(k_pages, table, capacity), k_cache)
    assert torch.equal(unpage(v_pages, table, capacity), v_cache)


def test_kvcache_positional_arguments_follow_flash_attn_signature():
    k_cache, v_cache = bshd(2, 12, 2, 8, torch.float64), bshd(2, 12, 2, 8, torch.float64)
    q, k, v = (bshd(2, 1, 2, 8, torch.float64) for _ in range(3))
    lengths = torch.tensor([3, 5], dtype=torch.int32)
    by_keyword = flash_attn_with_kvcache(q, k_cache.clone(), v_cache.clone(), k=k, v=v,
                                         cache_seqlens=lengths, causal=True)
    by_position = flash_attn_with_kvcache(q, k_cache, v_cache, k, v, None, None, lengths, None,
                                          None, None, None, True)
    assert torch.equal(by_keyword, by_position)


# ---------------------------------------------------------------------------------------------
# The qkv- and kv-packed functions


class PackedCase:
    """One packed function's call on fresh data and the unpacked function's call on copies of
    the same q, k, v: ``packed(**kwargs)`` and ``unpacked(**kwargs)`` run them, ``packed_grad()``
    and ``unpacked_grad()`` give the gradient in the packed tensor's layout (the unpacked
    gradients stacked as the packed tensor stacks its parts)."""

    def __init__(self, function, dtype):
        self.function = function
        self.batch, self.heads = 3, 4
        if function == "flash_attn_qkvpacked_func":
            self.leaf = torch.randn(3, 13, 3, 4, 16, dtype=dtype, requires_grad=True)
            self.axis, self.split = 2, 0
            self._packed = lambda **kw: flash_attn_qkvpacked_func(self.leaf, **kw)
            self._unpacked = lambda q, k, v, **kw: flash_attn_func(q, k, v, **kw)
        elif function == "flash_attn_kvpacked_func":  # GQA, Lq < Lk
            self.q = torch.randn(3, 9, 4, 16, dtype=dtype, requires_grad=True)
            self.leaf = torch.randn(3, 14, 2, 2, 16, dtype=dtype, requires_grad=True)
            self.axis, self.split = 2, 1
            self._packed = lambda **kw: flash_attn_kvpacked_func(self.q, self.leaf, **kw)
            self._unpacked = lambda q, k, v, **kw: flash_attn_func(q, k, v, **kw)
        elif function == "flash_attn_varlen_qkvpacked_func":  # uneven lengths, an empty one
            lengths = [5, 0, 11]
            cu = torch.tensor([0] + lengths, dtype=torch.int32).cumsum(0, dtype=torch.int32)
            self.leaf = torch.randn(sum(lengths), 3, 4, 16, dtype=dtype, requires_grad=True)
            self.axis, self.split = 1, 0
            self._packed = lambda **kw: flash_attn_varlen_qkvpacked_func(self.leaf, cu, 11, **kw)
            self._unpacked = lambda q, k, v, **kw: flash_attn_varlen_func(q, k, v, cu, cu, 11,
                                                                          11, **kw)
        else:  # flash_attn_varlen_kvpacked_func: GQA, chunks on caches and Lq > Lk
            lengths_q, lengths_k = [2, 6, 4], [7, 3, 12]
            cu_q = torch.tensor([0] + lengths_q, dtype=torch.int32).cumsum(0, dtype=torch.int32)
            cu_k = torch.tensor([0] + lengths_k, dtype=torch.int32).cumsum(0, dtype=torch.int32)
            self.q = torch.randn(sum(lengths_q), 4, 16, dtype=dtype, requires_grad=True)
            self.leaf = torch.randn(sum(lengths_k), 2, 2, 16, dtype=dtype, requires_grad=True)
            self.axis, self.split = 1, 1
            self._packed = lambda **kw: flash_attn_varlen_kvpacked_func(
                self.q, self.leaf, cu_q, cu_k, 6, 12, **kw)
            self._unpacked = lambda q, k, v, **kw: flash_attn_varlen_func(
                q, k, v, cu_q, cu_k, 6, 12, **kw)
        parts = [t.detach().clone().requires_grad_(True) for t in self.leaf.unbind(self.axis)]
        own_q = [self.q.detach().clone().requires_grad_(True)] if self.split else []
        self.unpacked_leaves = own_q + parts  # q, k, v

    def packed(self, **kwargs):
        return self._packed(**kwargs)

    def unpacked(self, **kwargs):
        return self._unpacked(*self.unpacked_leaves, **kwargs)

    def packed_leaves(self):
        return ([self.q] if self.split else []) + [self.leaf]

    def grads(self, packed_out, unpacked_out, grad_out):
        """(gradients of the packed call's leaves, the unpacked call's in the same layout)."""
        ours = grads(packed_out, self.packed_leaves(), grad_out)
        theirs = grads(unpacked_out, self.unpacked_leaves, grad_out)
        stacked = torch.stack(theirs[self.split :], dim=self.axis)
        return ours, list(theirs[: self.split]) + [stacked]


PACKED_FUNCTIONS = ["flash_attn_qkvpacked_func", "flash_attn_kvpacked_func",
                    "flash_attn_varlen_qkvpacked_func", "flash_attn_varlen_kvpacked_func"]

# Options every packed call takes, ALiBi slopes added by the test ("shared": (nheads,),
# "per-batch": (batch, nheads)).
PACKED_OPTIONS = [
    pytest.param(dict(causal=True), id="causal"),
    pytest.param(dict(causal=False), id="full"),
    pytest.param(dict(causal=True, window_size=(3, 0)), id="sliding"),
    pytest.param(dict(causal=False, window_size=(2, 1)), id="local"),
    pytest.param(dict(causal=True, softcap=0.6, softmax_scale=0.3), id="softcap-scale"),
    pytest.param(dict(causal=True, alibi="shared"), id="alibi-causal-kernel"),
    pytest.param(dict(causal=False, window_size=(4, 2), softcap=1.5, alibi="per-batch"),
                 id="alibi-local-softcap"),
]


def with_alibi(kwargs, case):
    kwargs = dict(kwargs)
    alibi = kwargs.pop("alibi", None)
    if alibi == "shared":
        kwargs["alibi_slopes"] = torch.rand(case.heads)
    elif alibi == "per-batch":
        kwargs["alibi_slopes"] = torch.rand(case.batch, case.heads)
    return kwargs


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("kwargs", PACKED_OPTIONS)
@pytest.mark.parametrize("function", PACKED_FUNCTIONS)
def test_packed_functions_are_the_unpacked_ones_on_the_same_data(function, kwargs, dtype):
    case = PackedCase(function, dtype)
    kwargs = with_alibi(kwargs, case)
    out, lse, s_dmask = case.packed(return_attn_probs=True, **kwargs)
    ref_out, ref_lse, ref_s_dmask = case.unpacked(return_attn_probs=True, **kwargs)
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)
    assert s_dmask.shape == ref_s_dmask.shape == (0,) and s_dmask.dtype == dtype
    out, ref_out = case.packed(**kwargs), case.unpacked(**kwargs)
    assert torch.equal(out, ref_out)
    ours, theirs = case.grads(out, ref_out, torch.randn_like(out))
    for mine, reference in zip(ours, theirs):
        assert mine.shape == reference.shape
        assert torch.equal(mine, reference)


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("function", PACKED_FUNCTIONS)
def test_packed_functions_dropout_is_the_unpacked_ones_for_the_same_seed(function, dtype):
    case = PackedCase(function, dtype)
    kwargs = dict(dropout_p=0.3, causal=True, window_size=(5, 0), softcap=2.0,
                  alibi_slopes=torch.rand(case.heads), deterministic=True)
    torch.manual_seed(11)
    out = case.packed(**kwargs)
    torch.manual_seed(11)
    ref = case.unpacked(**kwargs)
    assert torch.equal(out, ref)
    ours, theirs = case.grads(out, ref, torch.randn_like(out))
    for mine, reference in zip(ours, theirs):
        assert torch.equal(mine, reference)
    # The dropout bites: another seed drops other probabilities.
    torch.manual_seed(12)
    assert not torch.equal(case.packed(**kwargs), out)


@pytest.mark.parametrize("function", PACKED_FUNCTIONS)
def test_packed_functions_hand_views_of_the_packed_tensor_to_the_unpacked_code(function,
                                                                             monkeypatch):
    """No copy of the packed tensor: its parts reach the shared code as views of its storage."""
    case = PackedCase(function, torch.float32)
    module, shared = (_varlen, "_varlen_call") if "varlen" in function else (_dense, "_dense_call")
    seen = []
    original = getattr(module, shared)

    def spy(fn, q, k, v, *args, **kwargs):
        seen.append((fn, q, k, v))
        return original(fn, q, k, v, *args, **kwargs)

    monkeypatch.setattr(module, shared, spy)
    case.packed(causal=True)
    (fn, q, k, v), = seen
    assert fn.endswith(f".{function}")
    parts = (q, k, v)[case.split :]
    storage = case.leaf.untyped_storage().data_ptr()
    assert all(t.untyped_storage().data_ptr() == storage for t in parts)
    for index, part in enumerate(parts):
        assert torch.equal(part, case.leaf.select(case.axis, index))


def test_packed_signatures_are_flash_attn_2s():
    """Names, order and defaults of flash-attn 2's packed functions."""
    options = [("dropout_p", 0.0), ("softmax_scale", None), ("causal", False),
               ("window_size", (-1, -1)), ("softcap", 0.0), ("alibi_slopes", None),
               ("deterministic", False), ("return_attn_probs", False)]
    assert parameters(flash_attn_qkvpacked_func) == [("qkv", REQUIRED)] + options
    assert parameters(flash_attn_kvpacked_func) == [("q", REQUIRED), ("kv", REQUIRED)] + options
    assert parameters(flash_attn_varlen_qkvpacked_func) == [
        (name, REQUIRED) for name in ("qkv", "cu_seqlens", "max_seqlen")
    ] + options
    assert parameters(flash_attn_varlen_kvpacked_func) == [
        (name, REQUIRED) for name in ("q", "kv", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q",
                                      "max_seqlen_k")
    ] + options


def test_packed_functions_take_their_options_by_position():
    qkv = torch.randn(2, 7, 3, 2, 8, dtype=torch.float64)
    by_keyword = flash_attn_qkvpacked_func(qkv, softmax_scale=0.4, causal=True,
                                           window_size=(2, 0), softcap=1.0)
    assert torch.equal(flash_attn_qkvpacked_func(qkv, 0.0, 0.4, True, (2, 0), 1.0), by_keyword)
    q, kv = qkv[:, :, 0], qkv[:, :, 1:]
    assert torch.equal(flash_attn_kvpacked_func(q, kv, 0.0, 0.4, True, (2, 0), 1.0), by_keyword)
    cu = torch.tensor([0, 7, 14], dtype=torch.int32)
    varlen = flash_attn_varlen_qkvpacked_func(qkv.flatten(0, 1), cu, 7, 0.0, 0.4, True, (2, 0),
                                              1.0)
    assert torch.equal(varlen.unflatten(0, (2, 7)), by_keyword)
    varlen = flash_attn_varlen_kvpacked_func(q.flatten(0, 1), kv.flatten(0, 1), cu, cu, 7, 7,
                                             0.0, 0.4, True, (2, 0), 1.0)
    assert torch.equal(varlen.unflatten(0, (2, 7)), by_keyword)


# ---------------------------------------------------------------------------------------------
# window_size as a tuple, a list or a tensor


def window_call(function):
    """A call of the flash-attn function named ``function`` on fresh data with the
    ``window_size`` it is given (a causal sliding window of 3 keys, or what stands for one)."""
    if function in PACKED_FUNCTIONS:
        case = PackedCase(function, torch.float64)
        return lambda window_size: case.packed(causal=True, window_size=window_size)
    if function == "flash_attn_with_kvcache":
        q, k_cache, v_cache, _, _ = kv_arguments()
        lengths = torch.tensor([4, 9], dtype=torch.int32)
        return lambda window_size: flash_attn_with_kvcache(
            q, k_cache, v_cache, cache_seqlens=lengths, causal=True, window_size=window_size)
    if function == "flash_attn_func":
        q, k, v = bshd(2, 9, 4, 8, torch.float64), bshd(2, 9, 2, 8, torch.float64), \
            bshd(2, 9, 2, 8, torch.float64)
        return lambda window_size: flash_attn_func(q, k, v, causal=True, window_size=window_size)
    q, k, v, cu_q, cu_k = packed([3, 5], [3, 5], 2, 2, 8, 8, torch.float64)
    return lambda window_size: flash_attn_varlen_func(q, k, v, cu_q, cu_k, 5, 5, causal=True,
                                                      window_size=window_size)


ALL_FUNCTIONS = ["flash_attn_func", "flash_attn_varlen_func", "flash_attn_with_kvcache"] + \
    PACKED_FUNCTIONS

WINDOW_FORMS = [
    pytest.param([2, 0], id="list"),
    pytest.param(torch.tensor([2, 0]), id="int64-tensor"),
    pytest.param(torch.tensor([2, 0], dtype=torch.int32), id="int32-tensor"),
    pytest.param(torch.tensor([2, 0], dtype=torch.uint8), id="uint8-tensor"),
    pytest.param((np.int64(2), np.int32(0)), id="numpy-ints"),
    pytest.param((torch.tensor(2), torch.tensor(0)), id="0d-int-tensors"),
]


@pytest.mark.parametrize("window_size", WINDOW_FORMS)
@pytest.mark.parametrize("function", ALL_FUNCTIONS)
def test_window_size_as_a_list_or_tensor_is_the_tuple(function, window_size):
    call = window_call(function)
    by_tuple = call((2, 0))
    assert torch.equal(call(window_size), by_tuple)
    assert not torch.equal(call((-1, -1)), by_tuple)  # the window bites


BAD_WINDOWS = [
    pytest.param(torch.tensor([2.0, 0.0]), r"tensor of shape \(2,\) and dtype torch.float32",
                 id="float-tensor"),
    pytest.param(torch.tensor([2, 0, 1]), r"tensor of shape \(3,\) and dtype torch.int64",
                 id="3-element-tensor"),
    pytest.param(torch.tensor([[2, 0]]), r"tensor of shape \(1, 2\)", id="2d-tensor"),
    pytest.param(torch.tensor([True, False]), "dtype torch.bool", id="bool-tensor"),
    pytest.param((2, 0, 1), r"tuple \(2, 0, 1\)", id="3-tuple"),
    pytest.param([2], r"list \[2\]", id="1-list"),
    pytest.param(2, "got 2", id="int"),
    pytest.param("20", "got '20'", id="str"),
]


@pytest.mark.parametrize("window_size,given", BAD_WINDOWS)
@pytest.mark.parametrize("function", ALL_FUNCTIONS)
def test_bad_window_size_is_a_type_error_naming_it_and_what_was_given(function, window_size,
                                                                      given):
    with pytest.raises(TypeError, match=rf"{function}: window_size must be a pair .*{given}"):
        window_call(function)(window_size)


@pytest.mark.parametrize("element", [1.0, True, None, torch.tensor(1.0)],
                         ids=["float", "bool", "None", "0d-float-tensor"])
def test_bad_window_size_element_is_a_type_error_naming_it(element):
    with pytest.raises(TypeError, match=r"flash_attn_kvpacked_func: window_size\[1\] must be "
                                        "an int"):
        window_call("flash_attn_kvpacked_func")((2, element))


# ---------------------------------------------------------------------------------------------
# Signatures, refusals and bad input


def parameters(fn):
    return [(p.name, p.default) for p in inspect.signature(fn).parameters.values()]


REQUIRED = inspect.Parameter.empty


def test_signatures_are_flash_attn_2s():
    """Names, order and defaults of flash-attn 2's flash_attn_interface."""
    scores = [("dropout_p", 0.0), ("softmax_scale", None), ("causal", False),
              ("window_size", (-1, -1)), ("softcap", 0.0), ("alibi_slopes", None),
              ("deterministic", False), ("return_attn_probs", False)]
    assert parameters(flash_attn_func) == [("q", REQUIRED), ("k", REQUIRED), ("v", REQUIRED)] + \
        scores
    assert parameters(flash_attn_varlen_func) == [
        (name, REQUIRED) for name in ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k",
                                      "max_seqlen_q", "max_seqlen_k")
    ] + scores + [("block_table", None)]
    # flash-attn 2's, then flash-attn 3's descales of 8-bit caches, keyword-only (flash-attn 3
    # places them elsewhere among its own positional arguments), then spec_mask (ours: a tree of
    # draft tokens' mask).
    assert parameters(flash_attn_with_kvcache) == [
        ("q", REQUIRED), ("k_cache", REQUIRED), ("v_cache", REQUIRED), ("k", None), ("v", None),
        ("rotary_cos", None), ("rotary_sin", None), ("cache_seqlens", None),
        ("cache_batch_idx", None), ("cache_leftpad", None), ("block_table", None),
        ("softmax_scale", None), ("causal", False), ("window_size", (-1, -1)), ("softcap", 0.0),
        ("rotary_interleaved", True), ("alibi_slopes", None), ("num_splits", 0),
        ("return_softmax_lse", False), ("q_descale", None), ("k_descale", None),
        ("v_descale", None), ("spec_mask", None),
    ]
    keyword_only = [p.name for p in inspect.signature(flash_attn_with_kvcache).parameters.values()
                    if p.kind is inspect.Parameter.KEYWORD_ONLY]
    assert keyword_only == ["q_descale", "k_descale", "v_descale", "spec_mask"]


def func_call(lq=8, lk=8, **kwargs):
    q, k, v = bshd(2, lq, 4, 8, torch.float32), bshd(2, lk, 2, 8, torch.float32), \
        bshd(2, lk, 2, 8, torch.float32)
    return lambda: flash_attn_func(q, k, v, **kwargs)


def varlen_call(**kwargs):
    q, k, v, cu_q, cu_k = packed([3, 5], [3, 5], 2, 2, 8, 8, torch.float32)
    return lambda: flash_attn_varlen_func(q, k, v, cu_q, cu_k, 5, 5, **kwargs)


def paged_varlen_call(requires_grad=False, max_seqlen_k=8, table=((0, 1), (2, 3)), **kwargs):
    q = torch.randn(5, 2, 8, requires_grad=requires_grad)
    pages = torch.randn(4, 4, 2, 8)
    table = torch.tensor(table, dtype=torch.int32)
    cu_q, cu_k = (torch.tensor(c, dtype=torch.int32) for c in ([0, 2, 5], [0, 6, 14]))
    return lambda: flash_attn_varlen_func(q, pages, pages, cu_q, cu_k, 3, max_seqlen_k,
                                          causal=True, block_table=table, **kwargs)


@pytest.mark.parametrize("scores", list(PAGED_SCORES))
def test_varlen_block_table_reads_the_pages_as_their_keys(scores):
    """flash_attn_varlen_func with block_table: k and v are pages, sequence b's keys the first
    cu_seqlens_k[b + 1] - cu_seqlens_k[b] rows of its pages; the output and softmax_lse are the
    varlen call's on those keys gathered."""
    lengths_q, lengths_k, page = [1, 5, 4], [9, 5, 30], 8
    q, k, v, cu_q, cu_k = (t.detach() for t in packed(lengths_q, lengths_k, 4, 2, 16, 16,
                                                       torch.float64))
    k_pages, v_pages, table = paged([k[cu_k[b]:cu_k[b + 1]] for b in range(3)],
                                    [v[cu_k[b]:cu_k[b + 1]] for b in range(3)], page)
    options = PAGED_SCORES[scores]
    out, lse, _ = flash_attn_varlen_func(q, k_pages, v_pages, cu_q, cu_k, 5, 30,
                                         return_attn_probs=True, block_table=table, **options)
    ref, ref_lse, _ = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 5, 30, return_attn_probs=True,
                                             **options)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-13)
    torch.testing.assert_close(lse, ref_lse, rtol=0, atol=1e-12)


def kv_arguments(lq=2, new=2):
    k_cache, v_cache = bshd(2, 16, 2, 8, torch.float32), bshd(2, 16, 2, 8, torch.float32)
    q = bshd(2, lq, 4, 8, torch.float32)
    k, v = bshd(2, new, 2, 8, torch.float32), bshd(2, new, 2, 8, torch.float32)
    return q, k_cache, v_cache, k, v


def kv_call(**kwargs):
    q, k_cache, v_cache, k, v = kv_arguments()
    defaults = dict(k=k, v=v, cache_seqlens=torch.tensor([4, 9], dtype=torch.int32), causal=True)
    return lambda: flash_attn_with_kvcache(q, k_cache, v_cache, **{**defaults, **kwargs})


def qkvpacked_call(**kwargs):
    qkv = torch.randn(2, 8, 3, 2, 8)
    return lambda: flash_attn_qkvpacked_func(qkv, **kwargs)


def kvpacked_call(**kwargs):
    q, kv = bshd(2, 6, 4, 8, torch.float32), torch.randn(2, 8, 2, 2, 8)
    return lambda: flash_attn_kvpacked_func(q, kv, **kwargs)


def varlen_qkvpacked_call(**kwargs):
    qkv, cu = torch.randn(8, 3, 2, 8), torch.tensor([0, 3, 8], dtype=torch.int32)
    return lambda: flash_attn_varlen_qkvpacked_func(qkv, cu, 5, **kwargs)


def varlen_kvpacked_call(**kwargs):
    q, kv = torch.randn(6, 4, 8), torch.randn(8, 2, 2, 8)
    cu_q, cu_k = torch.tensor([0, 2, 6], dtype=torch.int32), torch.tensor([0, 3, 8],
                                                                         dtype=torch.int32)
    return lambda: flash_attn_varlen_kvpacked_func(q, kv, cu_q, cu_k, 4, 5, **kwargs)


PACKED_CALLS = {"flash_attn_qkvpacked_func": qkvpacked_call,
                "flash_attn_kvpacked_func": kvpacked_call,
                "flash_attn_varlen_qkvpacked_func": varlen_qkvpacked_call,
                "flash_attn_varlen_kvpacked_func": varlen_kvpacked_call}


REFUSED = [
    pytest.param(func_call(causal=True, dropout_p=0.1, return_attn_probs=True),
                 "return_attn_probs=True with dropout_p=0.1", id="func-probs-with-dropout"),
    pytest.param(varlen_call(causal=True, dropout_p=0.5, return_attn_probs=True),
                 "return_attn_probs=True with dropout_p=0.5", id="varlen-probs-with-dropout"),
    pytest.param(paged_varlen_call(dropout_p=0.5), "dropout_p=0.5 with block_table",
                 id="varlen-block_table-dropout"),
    pytest.param(paged_varlen_call(requires_grad=True), "inference only",
                 id="varlen-block_table-grad"),
    pytest.param(
        kv_call(block_table=torch.zeros(2, 2, dtype=torch.int32),
                cache_batch_idx=torch.tensor([0, 1], dtype=torch.int32)),
        "cache_batch_idx", id="kv-paged-batch_idx",
    ),
    pytest.param(
        kv_call(block_table=torch.zeros(2, 2, dtype=torch.int32),
                cache_leftpad=torch.tensor([0, 1], dtype=torch.int32)),
        "cache_leftpad", id="kv-paged-leftpad",
    ),
] + [
    pytest.param(call(causal=True, dropout_p=0.2, return_attn_probs=True),
                 f"{function}: return_attn_probs=True with dropout_p=0.2",
                 id=f"{function}-probs-with-dropout")
    for function, call in PACKED_CALLS.items()
]


@pytest.mark.parametrize("call,named", REFUSED)
def test_unserved_arguments_are_refused_by_name(call, named):
    with pytest.raises(NotImplementedError, match=named):
        call()


# The flash-attn functions and the scalar options each takes.
SCALAR_OPTIONS = [
    pytest.param(function, name, id=f"{function}-{name}")
    for function, names in (
        ("flash_attn_func", ("softmax_scale", "softcap", "dropout_p")),
        ("flash_attn_varlen_func", ("softmax_scale", "softcap", "dropout_p")),
        ("flash_attn_with_kvcache", ("softmax_scale", "softcap")),
    ) + tuple((function, ("softmax_scale", "softcap", "dropout_p")) for function in PACKED_CALLS)
    for name in names
]


def served_call(function, **kwargs):
    """A served causal call of the flash-attn function named ``function``, on fresh inputs."""
    calls = {"flash_attn_func": func_call, "flash_attn_varlen_func": varlen_call,
             "flash_attn_with_kvcache": kv_call, **PACKED_CALLS}
    return calls[function](causal=True, **kwargs)


@pytest.mark.parametrize("function,name", SCALAR_OPTIONS)
@pytest.mark.parametrize("shape", [(), (1,)], ids=["0d", "1-element"])
def test_scalar_options_given_as_tensors_requiring_grad_are_refused(function, name, shape):
    # The float such a tensor would become gets no gradient: refused, never silently dropped.
    value = torch.full(shape, 0.25, requires_grad=True)
    with pytest.raises(TypeError,
                       match=f"{function}: {name} must be a float, got a tensor that requires "
                             "grad"):
        served_call(function, **{name: value})()


# (value, the float it stands for): ints and one-number tensors without grad, which flash-attn
# takes as floats too.
AS_FLOATS = [
    pytest.param(0, 0.0, id="int"),
    pytest.param(torch.tensor(0.25), 0.25, id="0d-tensor"),
    pytest.param(torch.tensor([0.25], dtype=torch.float64), 0.25, id="1-element-float64-tensor"),
    pytest.param(np.float32(0.25), 0.25, id="numpy-float32"),
]


@pytest.mark.parametrize("function,name", SCALAR_OPTIONS)
@pytest.mark.parametrize("value,number", AS_FLOATS)
def test_scalar_options_given_as_ints_or_tensors_without_grad_are_their_float(function, name,
                                                                              value, number):
    results = []
    for given in (value, number):
        torch.manual_seed(7)  # the same inputs and, for dropout, the same dropout seed
        results.append(served_call(function, **{name: given})())
    assert torch.equal(results[0], results[1])


def test_refused_and_failed_calls_leave_the_cache_untouched():
    q, k_cache, v_cache, k, v = kv_arguments()
    saved = k_cache.clone(), v_cache.clone()
    lengths = torch.tensor([4, 9], dtype=torch.int32)
    with pytest.raises(NotImplementedError):
        flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lengths, causal=True,
                                block_table=torch.zeros(2, 2, dtype=torch.int32),
                                cache_leftpad=torch.zeros(2, dtype=torch.int32))
    with pytest.raises(ValueError):
        flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lengths, causal=True,
                                alibi_slopes=torch.ones(3))  # not (nheads,)
    with pytest.raises(ValueError):
        flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=15, causal=True)
    with pytest.raises(ValueError):
        flash_attn_with_kvcache(q, k_cache, v_cache, k, v, torch.ones(3, 2), torch.ones(3, 2),
                                cache_seqlens=lengths, causal=True)  # too few rotary positions
    with pytest.raises(TypeError):
        flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lengths, causal=True,
                                softmax_scale=torch.tensor(0.5, requires_grad=True))
    with pytest.raises(TypeError):
        flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lengths, causal=True,
                                softmax_scale="0.5")
    assert torch.equal(k_cache, saved[0]) and torch.equal(v_cache, saved[1])


def bad_kv(**kwargs):
    q, k_cache, v_cache, k, v = kv_arguments()
    arguments = dict(q=q, k_cache=k_cache, v_cache=v_cache, k=k, v=v,
                     cache_seqlens=torch.tensor([4, 9], dtype=torch.int32), causal=True)
    arguments.update(kwargs)
    return lambda: flash_attn_with_kvcache(**arguments)


F32 = torch.float32
BAD = [
    pytest.param(lambda: flash_attn_func([1.0], None, None, causal=True), TypeError, "q",
                 id="func-q-not-tensor"),
    pytest.param(lambda: flash_attn_func(torch.ones(4, 2, 8), torch.ones(4, 2, 8),
                                         torch.ones(4, 2, 8), causal=True),
                 ValueError, r"q must be \(batch, seqlen_q, nheads, headdim\)", id="func-3d"),
    pytest.param(lambda: flash_attn_func(bshd(2, 4, 2, 8, F32), bshd(3, 4, 2, 8, F32),
                                         bshd(3, 4, 2, 8, F32), causal=True),
                 ValueError, r"k.shape=\(3, 4, 2, 8\)", id="func-batch"),
    pytest.param(lambda: flash_attn_func(bshd(1, 4, 2, 8, F32), bshd(1, 4, 2, 4, F32),
                                         bshd(1, 4, 2, 4, F32), causal=True),
                 ValueError, "headdim", id="func-headdim"),
    pytest.param(lambda: flash_attn_func(bshd(1, 4, 3, 8, F32), bshd(1, 4, 2, 8, F32),
                                         bshd(1, 4, 2, 8, F32), causal=True),
                 ValueError, "multiple of k's nheads_k", id="func-heads"),
    pytest.param(lambda: flash_attn_func(bshd(1, 4, 2, 8, F32), bshd(1, 4, 2, 8, F32),
                                         bshd(1, 4, 2, 8, torch.float64), causal=True),
                 TypeError, "dtype", id="func-dtype"),
    pytest.param(func_call(causal=True, window_size=(-1,)), TypeError, "window_size",
                 id="func-window-length"),
    pytest.param(func_call(causal=True, alibi_slopes=torch.ones(4, dtype=torch.float64)),
                 TypeError, "alibi_slopes must have dtype torch.float32", id="func-alibi-dtype"),
    pytest.param(func_call(causal=True, alibi_slopes=torch.ones(2, 2)), ValueError,
                 r"alibi_slopes.shape=\(2, 2\)", id="func-alibi-shape"),
    pytest.param(func_call(causal=True, alibi_slopes=[1.0] * 4), TypeError,
                 "alibi_slopes must be a tensor", id="func-alibi-list"),
    pytest.param(func_call(causal=True, softcap="30"), TypeError, "softcap must be a float",
                 id="func-softcap-str"),
    pytest.param(func_call(causal=True, dropout_p=None), TypeError, "dropout_p must be a float",
                 id="func-dropout-none"),
    pytest.param(func_call(causal=True, softmax_scale="x"), TypeError,
                 "flash_attn_func: softmax_scale must be a float", id="func-scale-str"),
    pytest.param(func_call(causal=True, softmax_scale=True), TypeError,
                 "flash_attn_func: softmax_scale must be a float", id="func-scale-bool"),
    pytest.param(func_call(causal=True, softmax_scale=torch.ones(2)), TypeError,
                 "flash_attn_func: softmax_scale must be a float", id="func-scale-2-elements"),
    pytest.param(varlen_call(causal=True, softmax_scale="x"), TypeError,
                 "flash_attn_varlen_func: softmax_scale must be a float", id="varlen-scale-str"),
    pytest.param(bad_kv(softmax_scale="x"), TypeError,
                 "flash_attn_with_kvcache: softmax_scale must be a float", id="kv-scale-str"),
    pytest.param(func_call(causal=True, dropout_p=1.0), ValueError, "dropout_p",
                 id="func-dropout-1"),
    pytest.param(varlen_call(causal=True, alibi_slopes=torch.ones(3, 2)), ValueError,
                 r"\(batch, nheads\) = \(2, 2\)", id="varlen-alibi-batch"),
    pytest.param(lambda: flash_attn_varlen_func(*packed([3], [3], 2, 2, 8, 8, F32)[:3], None,
                                                None, 3, 3, causal=True),
                 TypeError, "cu_seqlens_q must be a tensor", id="varlen-cu-none"),
    pytest.param(func_call(causal=True, window_size=(-1.5, 0)), TypeError, r"window_size\[0\]",
                 id="func-window-float"),
    pytest.param(lambda: flash_attn_varlen_func(*packed([3], [3], 2, 2, 8, 8, F32), None, 3,
                                                causal=True),
                 TypeError, "max_seqlen_q must be an int", id="varlen-max-none"),
    pytest.param(lambda: flash_attn_varlen_func(*packed([3], [3], 2, 2, 8, 8, F32)[:3],
                                                torch.tensor([0, 3]), torch.tensor([0, 3]),
                                                3, 3, causal=True),
                 TypeError, "cu_seqlens_q", id="varlen-cu-int64"),
    pytest.param(lambda: flash_attn_varlen_func(torch.ones(2, 3, 2, 8), None, None, None, None,
                                                1, 1, causal=True),
                 ValueError, r"q must be \(total, nheads, headdim\)", id="varlen-4d"),
    pytest.param(bad_kv(cache_seqlens=torch.tensor([4, 9])), TypeError,
                 "cache_seqlens must have dtype torch.int32", id="kv-seqlens-int64"),
    pytest.param(bad_kv(cache_seqlens=torch.tensor([4, 9, 1], dtype=torch.int32)), ValueError,
                 r"cache_seqlens.shape=\(3,\)", id="kv-seqlens-shape"),
    pytest.param(bad_kv(cache_seqlens=4.0), TypeError, "cache_seqlens", id="kv-seqlens-float"),
    pytest.param(bad_kv(cache_seqlens=torch.tensor([-1, 3], dtype=torch.int32)), ValueError,
                 "cache_seqlens must be >= 0", id="kv-seqlens-negative"),
    pytest.param(bad_kv(cache_seqlens=torch.tensor([4, 15], dtype=torch.int32)), ValueError,
                 "does not fit the cache", id="kv-overflow"),
    pytest.param(bad_kv(v=None), ValueError, "k and v go together", id="kv-k-without-v"),
    pytest.param(bad_kv(cache_seqlens=None), ValueError, "cache_seqlens must be given",
                 id="kv-k-without-seqlens"),
    pytest.param(bad_kv(k=bshd(2, 2, 2, 8, torch.float64)), TypeError, "k must have the cache's",
                 id="kv-k-dtype"),
    pytest.param(bad_kv(q=bshd(2, 2, 4, 8, torch.float64)), TypeError, "k_cache must have q's",
                 id="kv-q-dtype"),
    pytest.param(bad_kv(k=bshd(2, 2, 1, 8, F32)), ValueError, r"k.shape=\(2, 2, 1, 8\)",
                 id="kv-k-shape"),
    pytest.param(bad_kv(k_cache=bshd(2, 16, 2, 4, F32)), ValueError, "k_cache and v_cache",
                 id="kv-cache-headdim"),
    pytest.param(bad_kv(k_cache=bshd(1, 16, 2, 8, F32), v_cache=bshd(1, 16, 2, 8, F32)),
                 ValueError, "cache_batch_idx", id="kv-cache-too-few-rows"),
    pytest.param(bad_kv(cache_batch_idx=torch.tensor([0, 2], dtype=torch.int32)), ValueError,
                 "cache_batch_idx entries", id="kv-batch_idx-range"),
    pytest.param(bad_kv(cache_leftpad=torch.tensor([5, 0], dtype=torch.int32)), ValueError,
                 "cache_leftpad", id="kv-leftpad-past-length"),
    pytest.param(bad_kv(rotary_cos=torch.ones(16, 4), rotary_sin=torch.ones(16, 4), k=None,
                        v=None), ValueError, "need new keys", id="kv-rotary-without-k"),
    pytest.param(bad_kv(rotary_cos=torch.ones(16, 4)), ValueError, "go together",
                 id="kv-rotary-cos-only"),
    pytest.param(bad_kv(rotary_cos=torch.ones(16, 5), rotary_sin=torch.ones(16, 5)), ValueError,
                 "rotary_dim <= headdim", id="kv-rotary-too-wide"),
    pytest.param(bad_kv(rotary_cos=torch.ones(16, 4, dtype=torch.int32),
                        rotary_sin=torch.ones(16, 4, dtype=torch.int32)),
                 TypeError, "rotary_cos must be a floating", id="kv-rotary-int"),
    pytest.param(bad_kv(block_table=torch.tensor([[9, 0], [1, 0]], dtype=torch.int32)),
                 ValueError, r"block_table row 0 names pages \[9\]", id="kv-page-range"),
    # flash-attn raises RuntimeError for a page outside the pool (its tests expect one): the
    # error is both.
    pytest.param(bad_kv(block_table=torch.tensor([[9, 0], [1, 0]], dtype=torch.int32)),
                 RuntimeError, r"block_table row 0 names pages \[9\]", id="kv-page-range-runtime"),
    pytest.param(paged_varlen_call(table=((0, 1), (2, 4))), RuntimeError,
                 r"flash_attn_varlen_func: block_table row 1 names pages \[4\] outside \[0, 4\)",
                 id="varlen-block_table-page-range-runtime"),
    pytest.param(paged_varlen_call(table=((0, -1), (2, 3))), ValueError,
                 r"flash_attn_varlen_func: block_table row 0 names pages \[-1\]",
                 id="varlen-block_table-page-range"),
    # As without block_table: the window is rewritten by max_seqlen_k, which must bound them.
    pytest.param(paged_varlen_call(max_seqlen_k=7), ValueError,
                 r"flash_attn_varlen_func: sequence 1 has length 8 \(cu_seqlens_k\[2\] - "
                 r"cu_seqlens_k\[1\]\), more than max_seqlen_k=7", id="varlen-block_table-max-k"),
    # Pages of no token (page_size 0): refused, never a division by zero (issue 41, D15).
    pytest.param(bad_kv(k_cache=torch.randn(4, 0, 2, 8), v_cache=torch.randn(4, 0, 2, 8),
                        k=None, v=None, cache_seqlens=torch.zeros(2, dtype=torch.int32),
                        block_table=torch.zeros(2, 0, dtype=torch.int32)),
                 ValueError, r"flash_attn_with_kvcache: the pages must hold at least one token",
                 id="kv-page-size-0"),
    pytest.param(lambda: flash_attn_varlen_func(
        torch.randn(2, 2, 8), torch.randn(4, 0, 2, 8), torch.randn(4, 0, 2, 8),
        torch.tensor([0, 1, 2], dtype=torch.int32), torch.tensor([0, 0, 0], dtype=torch.int32),
        1, 0, causal=True, block_table=torch.zeros(2, 0, dtype=torch.int32)),
                 ValueError, r"flash_attn_varlen_func: the pages must hold at least one token",
                 id="varlen-block_table-page-size-0"),
    pytest.param(bad_kv(num_splits=1.5), TypeError, "num_splits", id="kv-num_splits"),
    # The packed functions: their own arguments named, with the packed function.
    pytest.param(lambda: flash_attn_qkvpacked_func(torch.ones(2, 5, 2, 4, 8)), ValueError,
                 r"flash_attn_qkvpacked_func: qkv must be \(batch, seqlen, 3, nheads, headdim\), "
                 r"its dim 2 of size 3, got qkv.shape=\(2, 5, 2, 4, 8\)", id="qkv-dim2-is-2"),
    pytest.param(lambda: flash_attn_qkvpacked_func(torch.ones(5, 3, 4, 8)), ValueError,
                 r"flash_attn_qkvpacked_func: qkv must be \(batch, seqlen, 3, nheads, headdim\), "
                 r"got qkv.shape=\(5, 3, 4, 8\)", id="qkv-rank-4"),
    pytest.param(lambda: flash_attn_qkvpacked_func([1.0]), TypeError,
                 "flash_attn_qkvpacked_func: qkv must be a tensor", id="qkv-not-tensor"),
    pytest.param(lambda: flash_attn_qkvpacked_func(torch.ones(2, 5, 3, 4, 0)), ValueError,
                 r"flash_attn_qkvpacked_func: headdim must be positive, got qkv.shape",
                 id="qkv-headdim-0"),
    pytest.param(qkvpacked_call(alibi_slopes=torch.ones(3)), ValueError,
                 r"flash_attn_qkvpacked_func: alibi_slopes must be \(nheads,\) = \(2,\)",
                 id="qkv-alibi-shape"),
    pytest.param(qkvpacked_call(softcap="1"), TypeError,
                 "flash_attn_qkvpacked_func: softcap must be a float", id="qkv-softcap-str"),
    pytest.param(lambda: flash_attn_kvpacked_func(bshd(2, 4, 4, 8, F32),
                                                  torch.ones(2, 6, 3, 2, 8)), ValueError,
                 r"flash_attn_kvpacked_func: kv must be \(batch, seqlen_k, 2, nheads_k, "
                 r"headdim\), its dim 2 of size 2, got kv.shape=\(2, 6, 3, 2, 8\)",
                 id="kv-dim2-is-3"),
    pytest.param(lambda: flash_attn_kvpacked_func(bshd(2, 4, 4, 8, F32), torch.ones(2, 6, 2, 8)),
                 ValueError, r"flash_attn_kvpacked_func: kv must be .*got kv.shape=\(2, 6, 2, 8\)",
                 id="kv-rank-4"),
    pytest.param(lambda: flash_attn_kvpacked_func(torch.ones(4, 4, 8), torch.ones(2, 6, 2, 2, 8)),
                 ValueError, r"flash_attn_kvpacked_func: q must be \(batch, seqlen_q, nheads, "
                 r"headdim\)", id="kvpacked-q-rank-3"),
    pytest.param(lambda: flash_attn_kvpacked_func(bshd(2, 4, 4, 8, F32),
                                                  torch.ones(3, 6, 2, 2, 8)), ValueError,
                 r"flash_attn_kvpacked_func: kv must be .* with q's batch and headdim, got "
                 r"q.shape=\(2, 4, 4, 8\), kv.shape=\(3, 6, 2, 2, 8\)", id="kv-batch"),
    pytest.param(lambda: flash_attn_kvpacked_func(bshd(2, 4, 4, 8, F32),
                                                  torch.ones(2, 6, 2, 2, 4)), ValueError,
                 r"flash_attn_kvpacked_func: kv must be .* with q's batch and headdim",
                 id="kv-headdim"),
    pytest.param(lambda: flash_attn_kvpacked_func(bshd(2, 4, 3, 8, F32),
                                                  torch.ones(2, 6, 2, 2, 8)), ValueError,
                 "flash_attn_kvpacked_func: q's nheads must be a multiple of kv's nheads_k",
                 id="kv-heads"),
    pytest.param(lambda: flash_attn_kvpacked_func(bshd(2, 4, 4, 8, F32),
                                                  torch.ones(2, 6, 2, 2, 8, dtype=torch.float64)),
                 TypeError, "flash_attn_kvpacked_func: kv must have q's dtype torch.float32",
                 id="kv-dtype"),
    pytest.param(lambda: flash_attn_varlen_qkvpacked_func(
        torch.ones(8, 2, 2, 8), torch.tensor([0, 8], dtype=torch.int32), 8), ValueError,
                 r"flash_attn_varlen_qkvpacked_func: qkv must be \(total, 3, nheads, headdim\), "
                 r"its dim 1 of size 3, got qkv.shape=\(8, 2, 2, 8\)", id="varlen-qkv-dim1-is-2"),
    pytest.param(lambda: flash_attn_varlen_qkvpacked_func(
        torch.ones(1, 8, 3, 2, 8), torch.tensor([0, 8], dtype=torch.int32), 8), ValueError,
                 r"flash_attn_varlen_qkvpacked_func: qkv must be \(total, 3, nheads, headdim\), "
                 r"got qkv.shape=\(1, 8, 3, 2, 8\)", id="varlen-qkv-rank-5"),
    pytest.param(lambda: flash_attn_varlen_qkvpacked_func(torch.ones(8, 3, 2, 8),
                                                          torch.tensor([0, 8]), 8), TypeError,
                 "cu_seqlens_q must be int32", 
                 id="varlen-qkv-cu-int64"),
    pytest.param(lambda: flash_attn_varlen_qkvpacked_func(torch.ones(8, 3, 2, 8), None, 8),
                 TypeError, "flash_attn_varlen_qkvpacked_func: cu_seqlens_q must be a tensor",
                 id="varlen-qkv-cu-none"),
    pytest.param(lambda: flash_attn_varlen_qkvpacked_func(
        torch.ones(8, 3, 2, 8), torch.tensor([[0, 8]], dtype=torch.int32), 8), ValueError,
                 r"flash_attn_varlen_qkvpacked_func: cu_seqlens_q must be \(batch \+ 1,\), got "
                 r"cu_seqlens_q.shape=\(1, 2\)", id="varlen-qkv-cu-2d"),
    pytest.param(lambda: flash_attn_varlen_qkvpacked_func(
        torch.ones(8, 3, 2, 8), torch.tensor([0, 3, 7], dtype=torch.int32), 8), ValueError,
                 r"attention_forward: the last entry of cu_seqlens_q must be the "
                 r"number of packed rows 8, got cu_seqlens_q\[2\]=7", id="varlen-qkv-cu-total"),
    pytest.param(lambda: flash_attn_varlen_qkvpacked_func(
        torch.ones(8, 3, 2, 8), torch.tensor([1, 3, 8], dtype=torch.int32), 8), ValueError,
                 r"attention_forward: cu_seqlens_q must start at 0",
                 id="varlen-qkv-cu-start"),
    pytest.param(lambda: flash_attn_varlen_qkvpacked_func(
        torch.ones(8, 3, 2, 8), torch.tensor([0, 5, 3, 8], dtype=torch.int32), 8), ValueError,
                 r"attention_forward: cu_seqlens_q must be non-decreasing",
                 id="varlen-qkv-cu-decreasing"),
    pytest.param(lambda: flash_attn_varlen_qkvpacked_func(
        torch.ones(8, 3, 2, 8), torch.tensor([0, 3, 8], dtype=torch.int32), 4), ValueError,
                 r"attention_forward: sequence 1 has length 5 \(cu_seqlens_q\[2\] "
                 r"- cu_seqlens_q\[1\]\), more than max_seqlen_q=4", id="varlen-qkv-max-too-small"),
    pytest.param(lambda: flash_attn_varlen_qkvpacked_func(
        torch.ones(8, 3, 2, 8), torch.tensor([0, 8], dtype=torch.int32), 8.0), TypeError,
                 "flash_attn_varlen_qkvpacked_func: max_seqlen_q must be an int",
                 id="varlen-qkv-max-float"),
    pytest.param(lambda: flash_attn_varlen_qkvpacked_func(
        torch.ones(8, 3, 2, 8), torch.tensor([0, 8], dtype=torch.int32), -1), ValueError,
                 "varlen_attention: max_seqlen_q and max_seqlen_k must be non-negative",
                 id="varlen-qkv-max-negative"),
    pytest.param(lambda: flash_attn_varlen_kvpacked_func(
        torch.ones(6, 4, 8), torch.ones(8, 3, 2, 8), *varlen_lengths()), ValueError,
                 r"flash_attn_varlen_kvpacked_func: kv must be \(total_k, 2, nheads_k, headdim\), "
                 r"its dim 1 of size 2, got kv.shape=\(8, 3, 2, 8\)", id="varlen-kv-dim1-is-3"),
    pytest.param(lambda: flash_attn_varlen_kvpacked_func(
        torch.ones(6, 4, 8), torch.ones(8, 2, 8), *varlen_lengths()), ValueError,
                 r"flash_attn_varlen_kvpacked_func: kv must be \(total_k, 2, nheads_k, headdim\), "
                 r"got kv.shape=\(8, 2, 8\)", id="varlen-kv-rank-3"),
    pytest.param(lambda: flash_attn_varlen_kvpacked_func(
        torch.ones(6, 4, 8), torch.ones(8, 2, 2, 16), *varlen_lengths()), ValueError,
                 r"flash_attn_varlen_kvpacked_func: kv must be .* with q's headdim",
                 id="varlen-kv-headdim"),
    pytest.param(lambda: flash_attn_varlen_kvpacked_func(
        torch.ones(6, 4, 8), torch.ones(8, 2, 3, 8), *varlen_lengths()), ValueError,
                 "flash_attn_varlen_kvpacked_func: q's nheads must be a multiple of kv's nheads_k",
                 id="varlen-kv-heads"),
    pytest.param(lambda: flash_attn_varlen_kvpacked_func(
        torch.ones(6, 4, 8), torch.ones(8, 2, 2, 8), None, None, 4, 5), TypeError,
                 "flash_attn_varlen_kvpacked_func: cu_seqlens_q must be a tensor",
                 id="varlen-kv-cu-none"),
    pytest.param(varlen_kvpacked_call(window_size=torch.tensor([1.0, 0.0])), TypeError,
                 "flash_attn_varlen_kvpacked_func: window_size must be a pair",
                 id="varlen-kv-window-float-tensor"),
]


def varlen_lengths():
    """cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k for total_q 6, total_k 8."""
    return (torch.tensor([0, 2, 6], dtype=torch.int32), torch.tensor([0, 3, 8], dtype=torch.int32),
            4, 5)


@pytest.mark.parametrize("call,error,named", BAD)
def test_bad_input_gets_a_typed_error_naming_it(call, error, named):
    with pytest.raises(error, match=named):
        call()


def test_reference_example_runs():
    names = run_reference_example("### flash-attn's functions", "\n### ")
    assert names["out"].shape == (2, 9, 8, 64)
    # Row 1 had 4 keys cached: the 9 new ones went in after them.
    assert torch.equal(names["k_cache"][1, 4:13], names["k"][1])
    assert not names["k_cache"][1, 13:].any()
