"""What every call checks first: its own arguments on this rank, then the handshake, in which
the ranks exchange a description of their arguments (dtypes, shapes, options) with a timeout
and every rank raises the same error when they disagree, so that no rank is left waiting in a
collective its peers never reach."""

import datetime
from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from ..ops import check_window
from .layout import LAYOUTS, _check_layout, resolve_group

# How long a call waits for every rank to describe its arguments before it gives up.
HANDSHAKE_TIMEOUT = datetime.timedelta(seconds=120)

_DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)
_MAX_DIMS = 6


def _describe(t) -> List[int]:
    """A tensor as ints: dtype code (-1 absent, 98 not a tensor, 99 another dtype), dims, sizes
    padded to _MAX_DIMS."""
    if t is None:
        return [-1, 0] + [0] * _MAX_DIMS
    if not isinstance(t, Tensor):
        return [98, 0] + [0] * _MAX_DIMS
    sizes = list(t.shape)[:_MAX_DIMS]
    dtype = _DTYPES.index(t.dtype) if t.dtype in _DTYPES else 99
    return [dtype, t.dim()] + sizes + [0] * (_MAX_DIMS - len(sizes))


def _shape_of(row: Sequence[int]) -> str:
    if row[0] in (-1, 98):
        return "None" if row[0] == -1 else "not a tensor"
    dtype = _DTYPES[row[0]] if row[0] < len(_DTYPES) else "another dtype"
    return f"{tuple(row[2:2 + row[1]])} {dtype}"


def handshake(caller: str, group, named: Sequence[Tuple[str, Optional[Tensor]]],
              settings: Sequence[int], setting_names: str) -> None:
    """Every rank describes the tensors ``named`` and the ints ``settings``; raises the same
    error on every rank when any of them differs between ranks (TypeError for a dtype,
    ValueError else), naming the argument and what each rank gave. Waits HANDSHAKE_TIMEOUT for
    the peers, then raises RuntimeError (a peer that never called)."""
    rows = [_describe(t) for _, t in named]
    mine = torch.tensor([x for row in rows for x in row] + list(settings), dtype=torch.long)
    if dist.get_backend(group) != "gloo":
        mine = mine.to(next(t.device for _, t in named if isinstance(t, Tensor)))
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    work = dist.all_gather(gathered, mine, group=group, async_op=True)
    try:
        work.wait(timeout=HANDSHAKE_TIMEOUT)
    except RuntimeError as error:
        raise RuntimeError(f"{caller}: not every rank of the group called within "
                           f"{HANDSHAKE_TIMEOUT}: {error}") from error
    table = torch.stack(gathered).cpu().tolist()
    width = len(rows[0])
    for i, (name, _) in enumerate(named):
        per_rank = [row[i * width:(i + 1) * width] for row in table]
        if any(r[0] != per_rank[0][0] for r in per_rank):
            seen = ", ".join(f"rank {r}: {_shape_of(x)}" for r, x in enumerate(per_rank))
            raise TypeError(f"{caller}: {name} must have the same dtype on every rank, got {seen}")
        if any(r != per_rank[0] for r in per_rank):
            seen = ", ".join(f"rank {r}: {_shape_of(x)}" for r, x in enumerate(per_rank))
            raise ValueError(f"{caller}: {name} must have the same shape on every rank (equal "
                             f"shards), got {seen}")
    tail = [row[len(rows) * width:] for row in table]
    if any(t != tail[0] for t in tail):
        seen = ", ".join(f"rank {r}: {t}" for r, t in enumerate(tail))
        raise ValueError(f"{caller}: {setting_names} must be the same on every rank, got {seen}")


def _bits(value: Optional[float]) -> int:
    """A float option as an int for the handshake (its bits, so that any difference shows)."""
    if value is None:
        return -1
    return int(torch.tensor(float(value), dtype=torch.float64).view(torch.int64).item())


def _settings(window, softcap, dropout_p: float, layout: str) -> List[int]:
    return [window[0], window[1], _bits(softcap), _bits(dropout_p), LAYOUTS.index(layout)]


def _begin_call(caller: str, group, layout: str, window, softcap, named, dropout_p=0.0):
    """What every call checks first, on this rank and then among the ranks (the handshake over
    ``named``, q, k and v first): returns the group, this rank, the world size and the window."""
    _check_layout(caller, layout)
    window = check_window(caller, window)
    group, rank, world = resolve_group(caller, group)
    handshake(caller, group, named, _settings(window, softcap, dropout_p, layout),
              "window, softcap, dropout_p and layout")
    # After the handshake: every rank has the same kinds and shapes, so raises alike.
    q, k, v = (t for _, t in named[:3])
    _check_local(caller, q, k, v)
    if layout == "zigzag" and q.shape[-2] % 2:
        raise ValueError(f"{caller}: a zigzag shard holds chunks r and 2N-1-r of equal length, so "
                         f"the shard length must be even (the sequence a multiple of 2N="
                         f"{2 * world}), got q.shape[-2]={q.shape[-2]}")
    return group, rank, world, window


def _check_local(caller: str, q: Tensor, k: Tensor, v: Tensor) -> None:
    """q, k and v are tensors (B, H, L/N, D)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{caller}: {name} must be a Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{caller}: {name} must be (B, H, L/N, D), 4 dims, got "
                             f"{name}.shape={tuple(t.shape)}")
