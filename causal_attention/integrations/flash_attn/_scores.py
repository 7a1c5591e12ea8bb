"""What flash-attn does to a call's scores, in the op's terms (``_Scores``): its mask rewritten
as flash-attn rewrites it into the op's window (``_window``), softcap, ALiBi, and whether
flash-attn's causal ALiBi kernel shifts its softmax_lse."""

from dataclasses import dataclass
from typing import Dict, Optional, Tuple

from torch import Tensor

from ._checks import _as_float, _check_alibi, _window_bounds


@dataclass(frozen=True)
class _Scores:
    """What flash-attn does to one call's scores, in the op's terms: the window the op takes
    (flash-attn's, rewritten as flash-attn rewrites it), softcap (``None``: off) and ALiBi
    slopes; and whether flash-attn's causal kernel runs with ALiBi. That kernel adds
    ``slope * j`` to row i's scores instead of ``-slope * |i + seqlen_k - seqlen_q - j|``: on the
    keys causality shows the two differ by ``slope * (i + seqlen_k - seqlen_q)``, a constant of
    the row, so the probabilities and the output are the same but flash-attn's softmax_lse is the
    op's plus that constant."""

    window: Tuple[int, int]
    softcap: Optional[float]
    alibi_slopes: Optional[Tensor]
    alibi_lse_shift: bool

    @classmethod
    def of(cls, fn, causal, window_size, softcap, alibi_slopes, seqlen_q: int, seqlen_k: int,
           batch: int, heads: int) -> "_Scores":
        """``seqlen_q``/``seqlen_k`` are the lengths flash-attn rewrites the window by: the
        call's (``max_seqlen_q``/``max_seqlen_k`` for varlen, the cache's capacity for
        ``flash_attn_with_kvcache``)."""
        alibi_slopes = _check_alibi(fn, alibi_slopes, batch, heads)
        window, causal_kernel = _window(fn, causal, window_size, seqlen_q, seqlen_k,
                                        alibi_slopes is not None)
        softcap = _as_float(fn, "softcap", softcap)
        return cls(window, softcap if softcap > 0.0 else None, alibi_slopes,
                   causal_kernel and alibi_slopes is not None)

    def kwargs(self, rows=None) -> Dict[str, object]:
        """The op's keyword arguments; ``rows`` picks the batch rows of ``(batch, nheads)``
        slopes for a call on those rows."""
        alibi = self.alibi_slopes
        if alibi is not None and alibi.dim() == 2 and rows is not None:
            alibi = alibi[rows]
        return dict(window=self.window, softcap=self.softcap, alibi_slopes=alibi)


def _window(fn: str, causal, window_size, seqlen_q: int, seqlen_k: int,
            alibi: bool) -> Tuple[Tuple[int, int], bool]:
    """flash-attn's mask as an op window, and whether flash-attn runs its causal kernel.

    flash-attn (flash_api.cpp): a bound at least ``seqlen_k`` is unbounded (-1, as is any
    negative one); with one query row and no ALiBi, causal is dropped (the row sees every key
    either way); causal sets ``right = 0``; ``(left < 0, right == 0)`` is the causal kernel;
    otherwise a window with one bound negative gets ``seqlen_k`` for it. Row i then sees keys
    ``i + off - left <= j <= i + off + right`` (off = seqlen_k - seqlen_q of the row's own
    sequence), as the op's window does. The last rule is not the same as an unbounded side
    where a row sits more than ``seqlen_k`` before the last key (seqlen_q > seqlen_k + 1), so
    it is kept."""
    left, right = _window_bounds(fn, window_size)
    left = -1 if left < 0 or left >= seqlen_k else left
    right = -1 if right < 0 or right >= seqlen_k else right
    if causal and (seqlen_q != 1 or alibi):
        right = 0
    if left < 0 and right == 0:
        return (-1, 0), True
    if left < 0 and right < 0:
        return (-1, -1), False
    return (seqlen_k if left < 0 else left, seqlen_k if right < 0 else right), False
