"""Python wrappers around the ``torch.ops.causal_attention`` operators: typed ones for the
differentiable ops (:func:`attention`, :func:`varlen_attention`, :func:`attention_weights`) and
thin aliases for the kernel ops, all checking what the schema parser would let through.

The kernel ops: ``attention_forward(q, k, v, scale, key_mask=None, <score options>,
dropout_seed=None, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None)
-> (out, lse)``, ``lse`` ``(..., Hq, Lq)`` (packed: ``(Hq, total_q)``) the natural-log sum of
each row's exponentiated scores and its sink (``-inf`` for a row that sees nothing), in the
accumulation dtype, not differentiable; ``dropout_seed`` the int64 ``(2,)`` ``(seed, offset)``,
required when ``dropout_p > 0``. ``attention_backward(grad_out, q, k, v, out, lse, scale,
<the forward's options>) -> (dq, dk, dv, dsinks)``, ``dsinks`` ``(0,)`` without sinks; double
backward raises. Both take ``attn_mask`` last (after the packed lengths), and
``attention_gradients(<attention_backward's arguments>, attn_mask_grad=False) -> (dq, dk, dv,
dsinks, dattn_mask)`` also returns a floating ``attn_mask``'s gradient (``(0,)`` without
``attn_mask_grad``); ``attention_backward`` is it without that result.
All three take ``query_offset=None`` after them (dense calls): the key position of query row 0,
so that row ``i`` sits at key position ``i + query_offset`` for the window and ALiBi (default
``Lk - Lq``, bottom-right): a call that holds one chunk of a sequence's keys, as a ring step of
:mod:`causal_attention.distributed` does, keeps the sequence's positions. The backward ops then
take ``delta=None``: each row's ``rowsum(dO o O)`` over every key it sees (lse's shape and dtype),
with ``lse`` over every key too; given, the backward uses both as they are instead of deriving
its rows' statistics from the call's own keys, and returns ``dq``, ``dk``, ``dv`` in the
accumulation dtype: the call's shares, which its caller sums, unrounded.
``varlen_attention_forward`` and ``varlen_attention_backward`` are the packed
calls under their former names (lengths after ``v`` resp. ``lse``), kept for saved programs.
"""

import inspect
from typing import Any, Optional, Sequence, Union

import torch
from torch import Tensor

# ScoreOptions and check_window are this module's names too: callers and tests import them here.
from ._op_arguments import ScoreOptions, call_op, check_window  # noqa: F401
from ._quantized_kv import eight_bit_attention, wants_eight_bit_path


def _kernel_alias(name: str):
    def kernel_op(*args: Any, **kwargs: Any) -> Any:
        return call_op(name, *args, **kwargs)

    kernel_op.__name__ = kernel_op.__qualname__ = name
    kernel_op.__doc__ = f"``torch.ops.causal_attention.{name}``: see the module's docstring."
    return kernel_op


attention_forward = _kernel_alias("attention_forward")
attention_backward = _kernel_alias("attention_backward")
attention_gradients = _kernel_alias("attention_gradients")
varlen_attention_forward = _kernel_alias("varlen_attention_forward")
varlen_attention_backward = _kernel_alias("varlen_attention_backward")


def _dense_op(name: str, doc: str):
    """The typed wrapper of a dense differentiable op (attention_weights; attention takes its
    options, and 8-bit K/V besides)."""

    def dense_op(
        q: Tensor,
        k: Tensor,
        v: Tensor,
        *,
        scale: Optional[float] = None,
        key_mask: Optional[Tensor] = None,
        attn_mask: Optional[Tensor] = None,
        window: Sequence[int] = (-1, 0),
        softcap: Optional[float] = None,
        alibi_slopes: Optional[Tensor] = None,
        sinks: Optional[Tensor] = None,
        dropout_p: float = 0.0,
        generator: Optional[torch.Generator] = None,
    ) -> Tensor:
        return call_op(name, q, k, v, scale=scale, key_mask=key_mask, attn_mask=attn_mask,
                       window=window, softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks,
                       dropout_p=dropout_p, generator=generator)

    dense_op.__name__ = dense_op.__qualname__ = name
    dense_op.__doc__ = doc
    return dense_op


attention_weights = _dense_op(
    "attention_weights",
    """The attention probabilities that :func:`attention` applies to ``v``, materialized.

    Returns ``(..., Hq, Lq, Lk)`` in the inputs' dtype: row ``i`` is the softmax (with the sink
    in its denominator) of the modified scores over the keys of its window that ``key_mask``
    keeps, zero elsewhere, and all zeros for a row with no visible key. With ``dropout_p > 0``,
    the dropped probabilities are zero and the kept ones scaled by ``1 / (1 - p)``: with the same
    generator state, ``attention(...) == attention_weights(...) @ v`` up to rounding, with exactly
    the mask :func:`attention` uses.
    Arguments and errors are those of :func:`attention` (without its 8-bit K/V and their scales);
    ``v`` is only validated.

    This is for inspection: it takes O(Lq * Lk) memory, which :func:`attention` never does.
    Differentiable in ``q``, ``k``, ``sinks`` and a floating ``attn_mask``.
    """,
)


def varlen_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    **options: Any,
) -> Tensor:
    """Causal attention over packed sequences (FlashAttention's varlen layout), differentiable.

    ``q`` ``(total_q, Hq, D)``, ``k`` ``(total_k, Hkv, D)``, ``v`` ``(total_k, Hkv, Dv)``: the
    rows of every sequence one after the other; sequence ``i`` is rows
    ``cu_seqlens_q[i]:cu_seqlens_q[i + 1]`` of ``q`` and ``cu_seqlens_k[i]:cu_seqlens_k[i + 1]``
    of ``k`` and ``v`` (int32 ``(N + 1,)`` from 0), at most ``max_seqlen_q`` / ``max_seqlen_k``
    long. The options are :func:`attention`'s but the key mask, per sequence (``alibi_slopes``
    ``(Hq,)`` or ``(N, Hq)``; dropout's batch index is the sequence's).

    Returns ``(total_q, Hq, Dv)``. Each sequence attends only to itself, windowed and
    bottom-right aligned as :func:`attention` (a sequence with fewer queries than keys is a chunk
    against its own cache). The work is proportional to the sum of the sequences' squared
    lengths, never to ``N * max_seqlen ** 2``. Bad cumulative lengths raise ``ValueError``
    (``TypeError`` if not int32).
    """
    return call_op("varlen_attention", q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                   max_seqlen_k, **options)



# attention's options are attention_weights' (keyword-only, with their defaults), then the 8-bit
# K/V's scales: its signature says so (help, IDEs), from theirs rather than written out again.
_DENSE_PARAMETERS = list(inspect.signature(attention_weights).parameters.values())
_DENSE_OPTIONS = frozenset(p.name for p in _DENSE_PARAMETERS
                           if p.kind is inspect.Parameter.KEYWORD_ONLY)


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    k_scale: Union[float, Tensor, None] = None,
    v_scale: Union[float, Tensor, None] = None,
    **options: Any,
) -> Tensor:
    """Exact causal scaled-dot-product attention, differentiable, without an L x L matrix.

    Args:
        q, k, v: ``(..., Hq, Lq, D)``, ``(..., Hkv, Lk, D)``, ``(..., Hkv, Lk, Dv)`` (``(L, D)``
            for one head); query head ``h`` reads K/V head ``h // (Hq // Hkv)`` (GQA/MQA, K/V
            not copied).
        scale: multiplies ``q @ k^T`` before the softmax; defaults to ``1 / sqrt(D)``.
        key_mask: optional bool ``(..., Lk)`` with ``q``'s leading (batch) dims (``(Lk,)`` for a
            call without them), True where a key may be attended (SDPA's boolean-mask and
            transformers' ``attention_mask`` convention). It is broadcast over heads and query
            rows and combined with the window; key blocks it hides entirely are skipped. A row
            left with no visible key returns zeros; hidden keys get zero gradient.
        attn_mask: optional, SDPA's: broadcastable to ``(..., Hq, Lq, Lk)`` (never expanded in
            memory), bool (True where row ``i`` may attend key ``j``) or floating (float32 or
            ``q``'s dtype), added to the scores after softcap and ALiBi, ``-inf`` hiding the
            key. It narrows what the window and ``key_mask`` let a row see: with
            ``window=(-1, -1)`` it is SDPA's masked (non-causal) attention. Key blocks it hides
            entirely are skipped, forward and backward, so a block-diagonal (document) mask
            costs in proportion to its visible blocks. A floating mask that requires grad gets
            its gradient, summed over the dims it is broadcast along (learned biases train).
        window, softcap, alibi_slopes, sinks, dropout_p, generator: the score options
            (:class:`ScoreOptions`).

    Returns:
        ``(..., Hq, Lq, Dv)`` in the inputs' dtype (float64, float32, bfloat16 or float16;
        accumulation is float32, float64 for float64).

    Causal alignment is bottom-right: query row ``i`` attends key ``j`` iff
    ``j <= i + (Lk - Lq)``. With ``Lq == Lk`` that is the lower triangle with the diagonal; with
    a KV cache (``Lk > Lq``) the new queries see the whole cache. A query row that sees no key
    (possible when ``Lq > Lk``) returns zeros and gets zero gradient, never NaN. Any strides
    are accepted, e.g. ``x.view(B, L, H, D).transpose(1, 2)`` without ``.contiguous()``.
    Bad shapes or devices raise ``ValueError``, as does a ``scale`` or ``softcap`` that is not
    finite in the accumulation dtype (``1e39`` is inf in float32), bad dtypes and float
    arguments given as tensors that require grad ``TypeError``, nested or sparse tensors
    ``NotImplementedError``.

    8-bit K/V (a KV cache kept in 8 bits, inference only): ``k`` and ``v`` of one dtype
    ``torch.float8_e4m3fn``, ``torch.float8_e5m2`` or ``torch.int8``, ``(B, Hkv, Lk, D)`` and
    ``(B, Hkv, Lk, Dv)`` beside a float32, bfloat16 or float16 ``q`` ``(B, Hq, Lq, D)`` (4-D
    only), bottom-right causal as above (the queries are the last Lq of the Lk keys), are read in
    place by :func:`paged_attention` as a paged cache of one page per batch item (no copy of K/V).
    ``k_scale`` and ``v_scale`` dequantize them (stored value x scale = key or value): one per
    tensor (a float or a one-element tensor) or float32 ``(B, Hkv, Lk)``, one per token and KV
    head; 1 where not given; each positive and finite (``ValueError`` naming it). The options
    served are ``scale``, ``window``, ``softcap``, ``alibi_slopes`` and ``sinks`` (what
    :func:`paged_attention` takes); ``key_mask``, ``attn_mask`` or ``dropout_p > 0`` with 8-bit K/V
    raise ``NotImplementedError`` naming the argument, as do ``q`` or ``sinks`` requiring grad
    (with grad enabled): 8-bit K/V are not differentiable. Scales with K/V that are not 8-bit
    raise ``ValueError``; ``k`` and ``v`` of two 8-bit dtypes, or a ``q`` of another dtype,
    ``TypeError``.
    """
    unknown = options.keys() - _DENSE_OPTIONS
    if unknown:
        raise TypeError(f"attention() got an unexpected keyword argument {min(unknown)!r}")
    if wants_eight_bit_path(k, v, k_scale, v_scale):
        return eight_bit_attention(q, k, v, options, k_scale, v_scale)
    return call_op("attention", q, k, v, **options)


attention.__signature__ = inspect.signature(attention).replace(
    parameters=_DENSE_PARAMETERS + [p for p in inspect.signature(attention).parameters.values()
                                    if p.name in ("k_scale", "v_scale")]
)


# Its options are the dense ops' but the key mask, keyword-only: its signature says so (help,
# IDEs), from theirs rather than written out again.
_PACKED_OPTIONS = [p for p in inspect.signature(attention).parameters.values()
                   if p.kind is inspect.Parameter.KEYWORD_ONLY
                   and p.name not in ("key_mask", "attn_mask", "k_scale", "v_scale")]
_PACKED_POSITIONAL = list(inspect.signature(varlen_attention).parameters.values())[:-1]
varlen_attention.__signature__ = inspect.signature(varlen_attention).replace(
    parameters=_PACKED_POSITIONAL + _PACKED_OPTIONS
)


def paged_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_table: Tensor,
    cache_seqlens: Tensor,
    *,
    cu_seqlens_q: Optional[Tensor] = None,
    max_seqlen_q: Optional[int] = None,
    scale: Optional[float] = None,
    window: Sequence[int] = (-1, 0),
    softcap: Optional[float] = None,
    alibi_slopes: Optional[Tensor] = None,
    sinks: Optional[Tensor] = None,
    k_scale: Union[float, Tensor, None] = None,
    v_scale: Union[float, Tensor, None] = None,
    spec_mask: Optional[Tensor] = None,
    return_lse: bool = False,
):
    """Attention against a paged KV cache, read in place through the block table (inference:
    not differentiable).

    ``k_cache`` ``(num_pages, page_size, Hkv, D)`` and ``v_cache`` ``(num_pages, page_size, Hkv,
    Dv)`` are flash-attn's (and vLLM's flash) paged layout, any page size; ``block_table``
    ``(B, max_pages)`` int32 lists sequence b's pages in order and ``cache_seqlens`` ``(B,)``
    int32 counts its keys, the first rows of those pages (the rest of the table is not read).
    ``q`` is ``(B, Lq, Hq, D)``, or packed ``(total_q, Hq, D)`` with ``cu_seqlens_q`` int32
    ``(B + 1,)`` and ``max_seqlen_q``: sequence b's queries are the last of its keys
    (bottom-right; with more queries than keys the first ones see no key and get zeros), so
    decode rows and prefill chunks of any lengths go in one call. The options
    are :func:`attention`'s but the masks and dropout, per sequence (``alibi_slopes`` ``(Hq,)`` or
    ``(B, Hq)``). GQA reads each K/V head once for its group of query heads, never repeated.

    Returns ``(B, Lq, Hq, Dv)`` (packed: ``(total_q, Hq, Dv)``), and with ``return_lse`` also the
    log-sum-exp, ``(B, Hq, Lq)`` (packed: ``(Hq, total_q)``). No copy of the cache is made: the
    kernel's memory is its scratch, sized by the query rows. A page index the keys reach outside
    the pool, ``cache_seqlens`` beyond the pages of a row, ``cu_seqlens_q`` that does not count
    q's rows, or tables that are not int32 on the CPU raise ``ValueError`` (``TypeError`` for
    dtypes) naming the argument.

    The caches may be 8-bit, ``torch.float8_e4m3fn``, ``torch.float8_e5m2`` or ``torch.int8``
    (both of one dtype, beside a float32, bfloat16 or float16 ``q``), read in place: each key
    block is widened once into the kernel's scratch. ``k_scale`` and ``v_scale`` dequantize them
    (stored value x scale = key or value): one per tensor (a float or a one-element tensor, vLLM's
    ``k_scale``) or float32 ``(num_pages, page_size, Hkv)``, one per token and KV head (what
    :func:`paged_cache_append` computes); 1 where not given. A scale a sequence reads must be
    positive and finite (``ValueError``).

    ``spec_mask`` says which of its sequence's new tokens (its last ``Lq_b`` keys, the ones its
    query rows bring) each query row sees, for a step that verifies a tree of draft tokens: bool
    ``(total_q, max_seqlen_q)`` for packed q (row t, a query of sequence b, sees b's new token j
    where ``spec_mask[t, j]``) or ``(B, Lq, Lq)`` for dense q, True where the row sees it. Every
    cached key before the new tokens stays visible, and the causal rule still applies (a row
    never sees a later token): a chain of drafts is the all-True mask, a tree each token's
    ancestors and itself. At most 64 new tokens a sequence; a row must see itself
    (``ValueError``). Key blocks the mask hides are skipped; it costs ``O(B Lq^2)`` memory.
    """
    k_scale, v_scale = (torch.tensor(float(s)) if isinstance(s, (int, float)) else s
                        for s in (k_scale, v_scale))
    out, lse = call_op("paged_attention", q, k_cache, v_cache, block_table, cache_seqlens,
                       cu_seqlens_q=cu_seqlens_q, max_seqlen_q=max_seqlen_q, scale=scale,
                       window=window, softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks,
                       k_scale=k_scale, v_scale=v_scale, spec_mask=spec_mask)
    return (out, lse) if return_lse else out
