"""The op's visibility rule as a boolean tensor, for the Python code that spells out a mask
outside the kernels: baselines that give SDPA an ``attn_mask``, reading a mask back into the
op's options, and the references the tests and benchmarks compare against."""

from typing import Optional, Tuple, Union

import torch
from torch import Tensor


def visible_keys(
    len_q: int,
    len_k: int,
    window: Tuple[int, int] = (-1, 0),
    *,
    device: Optional[Union[torch.device, str]] = None,
    key_mask: Optional[Tensor] = None,
) -> Tensor:
    """Bool, True where query row ``i`` may attend key ``j``: the op's rule for
    ``window=(left, right)``, aligned bottom-right (row ``i``'s own key is ``i + off``, ``off =
    len_k - len_q``),

        ``i + off - left <= j <= i + off + right``, a side of -1 unbounded,

    so the default ``(-1, 0)`` is causal attention, ``j <= i + len_k - len_q``, and ``(-1, -1)``
    sees every key. With a ``key_mask`` (bool, ``(len_k,)`` or ``(*batch, len_k)``, True where a
    key may be attended) key ``j`` must be True there too.

    Shape ``(len_q, len_k)`` without a key mask or with a ``(len_k,)`` one, else ``(*batch, 1,
    len_q, len_k)``: broadcast over the heads, as the op applies a key mask. On ``device``, by
    default the key mask's (else torch's default device)."""
    left, right = window
    if key_mask is not None:
        if key_mask.dim() == 0 or key_mask.size(-1) != len_k:
            raise ValueError(
                f"visible_keys: key_mask must be (*batch, {len_k}), got {list(key_mask.shape)}"
            )
        if device is None:
            device = key_mask.device
    diagonal = torch.arange(len_q, device=device).unsqueeze(-1) + (len_k - len_q)
    keys = torch.arange(len_k, device=device)
    visible = torch.ones((len_q, len_k), dtype=torch.bool, device=device)
    if left >= 0:
        visible &= keys >= diagonal - left
    if right >= 0:
        visible &= keys <= diagonal + right
    if key_mask is None:
        return visible
    if key_mask.dim() == 1:
        return visible & key_mask
    return visible & key_mask[..., None, None, :]
