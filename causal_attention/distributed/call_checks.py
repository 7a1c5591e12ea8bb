"""What every call checks: the handshake, in which the ranks exchange one fixed-size message that
names the call and describes everything they must agree on (the tensors' dtypes and shapes, the
option tensors' values, the options), with a timeout, before any other collective; every rank
raises the same error when they disagree, so that no rank is left waiting in a collective its
peers never reach, nor computes with options its peers do not share. The call's own checks of
its arguments come after it, alike on every rank once they agree."""

import datetime
import operator
from typing import Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from ..ops import check_window
from .layout import LAYOUTS, Sharding, _check_cu_seqlens, _check_layout, resolve_group

# How long a call waits for every rank to describe its arguments before it gives up.
HANDSHAKE_TIMEOUT = datetime.timedelta(seconds=120)

# The calls that handshake, by their number in the message: every rank reads the same table.
CALLS = ("ring_attention", "ulysses_attention", "unshard_sequence", "allgather_attention")
_PREFIX = "causal_attention.distributed"

# The message's slots, the same for every call, so that every rank's message has one size (gloo
# aborts an all-gather of unequal messages): a call leaves the arguments it does not take None.
# The option tensors are replicated (the same values on every rank), the others sharded.
TENSORS = ("q", "k", "v", "key_mask", "x")
# Those a packed batch's shards hold its tokens in (ShardRows); a key mask has no place there.
PACKED_TENSORS = ("q", "k", "v", "x")
OPTION_TENSORS = ("alibi_slopes", "sinks", "cu_seqlens")
_DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16, torch.bool, torch.int64,
           torch.int32)
_MAX_DIMS = 6
_NONE, _NOT_A_TENSOR, _OTHER_DTYPE = -1, 98, 99

_ABSENT, _VALUE, _INVALID = 0, 1, 2  # the kinds of a setting


def _float_bits(value) -> List[int]:
    """A float option's bits, so that any difference shows."""
    if isinstance(value, (str, bytes)):
        raise TypeError(f"not a number: {value!r}")
    return [int(torch.tensor(float(value), dtype=torch.float64).view(torch.int64))]


def _float_of(bits: List[int]) -> str:
    return repr(torch.tensor(bits[0], dtype=torch.int64).view(torch.float64).item())


class _Setting(NamedTuple):
    """An option in the message: its kind (None, a value, or a value the call will refuse) and
    ``width`` ints of its value, so that no value is mistaken for a kind."""

    name: str
    width: int
    to_ints: Callable[[object], List[int]]
    shown: Callable[[List[int]], str]

    def encode(self, value) -> List[int]:
        if value is None:
            return [_ABSENT] + [0] * self.width
        try:
            return [_VALUE] + self.to_ints(value)
        except (TypeError, ValueError, OverflowError, RuntimeError):  # named by the call's checks
            return [_INVALID] + [0] * self.width

    def show(self, row: Sequence[int]) -> str:
        if row[0] != _VALUE:
            return "None" if row[0] == _ABSENT else "an invalid value"
        return self.shown(list(row[1:]))


SETTINGS = (
    _Setting("scale", 1, _float_bits, _float_of),
    _Setting("window", 2, lambda w: list(check_window(_PREFIX, w)), lambda w: str(tuple(w))),
    _Setting("softcap", 1, _float_bits, _float_of),
    _Setting("dropout_p", 1, _float_bits, _float_of),
    _Setting("layout", 1, lambda layout: [LAYOUTS.index(layout)],
             lambda code: repr(LAYOUTS[code[0]])),
    _Setting("dim", 1, lambda dim: [int(dim)], lambda dim: str(dim[0])),
    _Setting("max_seqlen", 1, lambda m: [operator.index(m)], lambda m: str(m[0])),
)


class ShardRows(NamedTuple):
    """The shards of a packed batch may differ in length: dim ``dim`` of each sharded tensor
    (the call's argument, negative from the end) holds ``counts[r]`` rows on rank r, as
    cu_seqlens cuts the batch (``counts`` None where cu_seqlens or the layout cannot say: the
    call's own checks name them after the handshake)."""

    dim: int
    counts: Optional[Tuple[int, ...]]

    @staticmethod
    def of(dim: int, cu_seqlens, world: int, layout) -> "ShardRows":
        try:
            bounds = _check_cu_seqlens(_PREFIX, cu_seqlens)
        except (TypeError, ValueError):
            return ShardRows(dim, None)
        if layout not in LAYOUTS:
            return ShardRows(dim, None)
        sharding = Sharding(bounds[-1], world, layout, bounds)
        return ShardRows(dim, tuple(sharding.shard_length(r) for r in range(world)))


def _describe(t) -> List[int]:
    """A tensor as ints: dtype code (_NONE, _NOT_A_TENSOR, _OTHER_DTYPE or its place in _DTYPES),
    dims, sizes padded to _MAX_DIMS."""
    if t is None or not isinstance(t, Tensor):
        return [_NONE if t is None else _NOT_A_TENSOR, 0] + [0] * _MAX_DIMS
    sizes = list(t.shape)[:_MAX_DIMS]
    dtype = _DTYPES.index(t.dtype) if t.dtype in _DTYPES else _OTHER_DTYPE
    return [dtype, t.dim()] + sizes + [0] * (_MAX_DIMS - len(sizes))


def _digest(t) -> int:
    """An option tensor's values as one int (equal values, equal ints; 0 when absent)."""
    if not isinstance(t, Tensor) or t.numel() == 0:
        return 0
    bits = t.detach().to(device="cpu", dtype=torch.float64).reshape(-1).view(torch.int64)
    # Odd weights by position, so that permuted values differ; int64 sums wrap, alike everywhere.
    weights = torch.arange(bits.numel(), dtype=torch.int64) * 2 + 1
    return int((bits * weights).sum())


def _shape_of(row: Sequence[int]) -> str:
    if row[0] in (_NONE, _NOT_A_TENSOR):
        return "None" if row[0] == _NONE else "not a tensor"
    dtype = _DTYPES[row[0]] if row[0] < len(_DTYPES) else "another dtype"
    return f"{tuple(row[2:2 + row[1]])} {dtype}"


def _per_rank(values: Sequence, show=str) -> str:
    return ", ".join(f"rank {r}: {show(x)}" for r, x in enumerate(values))


def handshake(caller: str, group, tensors: Dict[str, object], settings: Dict[str, object],
              shard_rows: Optional[ShardRows] = None) -> None:
    """Every rank sends one message of a fixed size naming ``caller`` (one of CALLS, under
    _PREFIX) and describing its ``tensors`` (names among TENSORS and OPTION_TENSORS) and
    ``settings`` (names among SETTINGS'); raises the same error on every rank when any of them
    differs between ranks, naming it and what each rank gave: ValueError for another call, a
    shape, an option tensor's values or a setting, TypeError for a dtype. The shards of a packed
    batch (``shard_rows``) are compared in every dim but its ``dim``, whose length on each rank
    must be its ``counts``' (checked once cu_seqlens is known to agree). Waits
    HANDSHAKE_TIMEOUT for the peers, then raises RuntimeError (a peer that never called)."""
    named = {**{name: None for name in TENSORS + OPTION_TENSORS}, **tensors}
    rows = [_describe(named[name]) for name in TENSORS + OPTION_TENSORS]
    digests = [_digest(named[name]) for name in OPTION_TENSORS]
    values = [x for s in SETTINGS for x in s.encode(settings.get(s.name))]
    call = CALLS.index(caller.removeprefix(_PREFIX + "."))
    mine = torch.tensor([call] + [x for row in rows for x in row] + digests + values,
                        dtype=torch.long)
    if dist.get_backend(group) != "gloo":
        mine = mine.to(next(t.device for t in tensors.values() if isinstance(t, Tensor)))
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    work = dist.all_gather(gathered, mine, group=group, async_op=True)
    try:
        work.wait(timeout=HANDSHAKE_TIMEOUT)
    except RuntimeError as error:
        raise RuntimeError(f"{caller}: not every rank of the group called within "
                           f"{HANDSHAKE_TIMEOUT}: {error}") from error
    table = torch.stack(gathered).cpu().tolist()
    calls = [row[0] for row in table]
    if any(c != calls[0] for c in calls):
        # Not under the caller's name: each rank's differs, and the message must not.
        raise ValueError(f"{_PREFIX}: every rank of the group must make the same call, got "
                         f"{_per_rank(calls, lambda c: CALLS[c])}")
    _compare(caller, [row[1:] for row in table], shard_rows)


def _compare(caller: str, table: List[List[int]], shard_rows: Optional[ShardRows]) -> None:
    """Every rank's message (``table``, a row per rank) compared in a fixed order: the option
    tensors (dtype, shape, values), the settings, then the sharded tensors (dtype, shape but a
    packed batch's sharded dim, then that dim's lengths), so that what decides how shards
    compare (cu_seqlens, the layout, dim) agrees, and every rank compares them alike."""
    width = 2 + _MAX_DIMS
    tensors = {name: [row[i * width:(i + 1) * width] for row in table]
               for i, name in enumerate(TENSORS + OPTION_TENSORS)}
    start = len(TENSORS + OPTION_TENSORS) * width
    for i, name in enumerate(OPTION_TENSORS):
        _compare_tensor(caller, name, tensors[name], "(it is replicated)", None)
        digests = [row[start + i] for row in table]
        if any(d != digests[0] for d in digests):
            ranks = [r for r, d in enumerate(digests) if d != digests[0]]
            raise ValueError(f"{caller}: {name} must have the same values on every rank (it is "
                             f"replicated), got other values on rank(s) {ranks} than on rank 0")
    start += len(OPTION_TENSORS)
    for setting in SETTINGS:
        per_rank = [row[start:start + 1 + setting.width] for row in table]
        if any(v != per_rank[0] for v in per_rank):
            raise ValueError(f"{caller}: {setting.name} must be the same on every rank, got "
                             f"{_per_rank(per_rank, setting.show)}")
        start += 1 + setting.width
    for name in TENSORS:
        _compare_tensor(caller, name, tensors[name], "(equal shards)",
                        shard_rows if name in PACKED_TENSORS else None)
    if shard_rows is not None and shard_rows.counts is not None:
        for name in PACKED_TENSORS:
            _compare_shard_rows(caller, name, tensors[name], shard_rows)


def _sharded_dim(described: Sequence[int], shard_rows: Optional[ShardRows]) -> Optional[int]:
    """The dim of a described tensor that holds a packed batch's tokens (None: none does)."""
    if shard_rows is None or described[0] in (_NONE, _NOT_A_TENSOR):
        return None
    dim, dims = shard_rows.dim, described[1]
    if isinstance(dim, bool) or not isinstance(dim, int) or not -dims <= dim < dims:
        return None
    return dim % dims if dim % dims < _MAX_DIMS else None


def _compare_tensor(caller: str, name: str, per_rank: List[List[int]], what: str,
                    shard_rows: Optional[ShardRows]) -> None:
    if any(r[0] != per_rank[0][0] for r in per_rank):
        raise TypeError(f"{caller}: {name} must have the same dtype on every rank, got "
                        f"{_per_rank(per_rank, _shape_of)}")
    compared = [list(r) for r in per_rank]
    for r in compared:
        dim = _sharded_dim(r, shard_rows)
        if dim is not None:
            r[2 + dim] = 0
    if any(r != compared[0] for r in compared):
        raise ValueError(f"{caller}: {name} must have the same shape on every rank {what}, "
                         f"got {_per_rank(per_rank, _shape_of)}")


def _compare_shard_rows(caller: str, name: str, per_rank: List[List[int]],
                        shard_rows: ShardRows) -> None:
    """Each rank's packed shard holds the rows cu_seqlens gives it (cu_seqlens, the layout and
    the dim agree on every rank by now, and so does every rank's ``shard_rows``)."""
    dim = _sharded_dim(per_rank[0], shard_rows)
    if dim is None:
        return
    if any(r[2 + dim] != n for r, n in zip(per_rank, shard_rows.counts)):
        raise ValueError(
            f"{caller}: {name} must hold this rank's tokens of the packed batch as cu_seqlens "
            f"and the layout cut it (shard_sequence(..., cu_seqlens=cu_seqlens)), "
            f"{_per_rank(shard_rows.counts)} tokens along dim {dim}, got "
            f"{_per_rank(per_rank, _shape_of)}")


def _begin_call(caller: str, group, named: Sequence[Tuple[str, Optional[Tensor]]], *,
                scale, window, softcap, layout: str, dropout_p: Optional[float] = None,
                cu_seqlens: Optional[Tensor] = None, max_seqlen: Optional[int] = None):
    """What every attention call checks first: the handshake over ``named`` (q, k and v first),
    cu_seqlens and the options, then this rank's arguments (alike on every rank once they
    agree). Returns the group, this rank, the window and the sharding: of a dense sequence
    (q, k, v ``(B, H, L/N, D)``), or of the packed batch cu_seqlens bounds (``(tokens, H, D)``,
    each rank its tokens)."""
    group, rank, world = resolve_group(caller, group)
    rows = None if cu_seqlens is None else ShardRows.of(0, cu_seqlens, world, layout)
    handshake(caller, group, {**dict(named), "cu_seqlens": cu_seqlens},
              {"scale": scale, "window": window, "softcap": softcap, "dropout_p": dropout_p,
               "layout": layout, "max_seqlen": max_seqlen}, rows)
    _check_layout(caller, layout)
    window = check_window(caller, window)
    q, k, v = (t for _, t in named[:3])
    if cu_seqlens is None:
        _check_local(caller, q, k, v, "(B, H, L/N, D)")
        if layout == "zigzag" and q.shape[-2] % 2:
            raise ValueError(f"{caller}: a zigzag shard holds chunks r and 2N-1-r of equal "
                             f"length, so the shard length must be even (the sequence a multiple "
                             f"of 2N={2 * world}), got q.shape[-2]={q.shape[-2]}")
        return group, rank, window, Sharding(q.shape[-2] * world, world, layout)
    bounds = _check_cu_seqlens(caller, cu_seqlens)
    _check_local(caller, q, k, v, "(tokens, H, D)")
    longest = max(b - a for a, b in zip(bounds, bounds[1:]))
    if max_seqlen is not None and (not isinstance(max_seqlen, int) or max_seqlen < longest):
        raise ValueError(f"{caller}: max_seqlen must be at least the longest document's length "
                         f"({longest}, from cu_seqlens), got max_seqlen={max_seqlen!r}")
    return group, rank, window, Sharding(bounds[-1], world, layout, bounds)


def _check_local(caller: str, q: Tensor, k: Tensor, v: Tensor, shape: str) -> None:
    """q, k and v are tensors of ``shape``'s dims."""
    dims = len(shape.split(","))
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{caller}: {name} must be a Tensor, got {type(t).__name__}")
        if t.dim() != dims:
            raise ValueError(f"{caller}: {name} must be {shape}, {dims} dims, got "
                             f"{name}.shape={tuple(t.shape)}")
