"""Shared helpers for the tests of causal_attention.CausalSelfAttention: module configurations,
a nanoGPT-style reference module, key masks, forward + backward runs, quiet TorchScript, and the
directory of files shared with the C++ tests."""

import os
from pathlib import Path
from typing import Any, Dict, Optional, Sequence, Tuple

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attention_testing import visibility

ROOT = Path(__file__).resolve().parents[2]


def interop_dir() -> Path:
    """Where files cross between Python and C++: $CAUSAL_ATTENTION_INTEROP_DIR, which
    scripts/test.sh sets to build/interop (the default here) and fills before ctest and pytest."""
    return Path(os.environ.get("CAUSAL_ATTENTION_INTEROP_DIR", ROOT / "build" / "interop"))

# Module options covering MHA, GQA, MQA with Dv != D, a head_dim that does not divide embed_dim,
# and no biases.
CONFIGS = [
    pytest.param(dict(embed_dim=32, num_heads=4), id="mha"),
    pytest.param(dict(embed_dim=32, num_heads=4, num_kv_heads=2), id="gqa"),
    pytest.param(
        dict(embed_dim=24, num_heads=4, num_kv_heads=1, head_dim=10, value_head_dim=6),
        id="mqa-D10-Dv6",
    ),
    pytest.param(dict(embed_dim=24, num_heads=3, bias=False), id="no-bias"),
]


class NanoGPTAttention(nn.Module):
    """nanoGPT's CausalSelfAttention, the reference: built from a config (here a dict of our
    module's options), a fused c_attn split into q, k, v, SDPA with ``is_causal=True``, c_proj,
    and, when ``block_size`` is given, the ``bias`` causal-mask buffer that nanoGPT registers
    without flash attention. Extended to GQA and Dv != D like ours."""

    def __init__(self, config: Dict[str, Any], block_size: Optional[int] = None):
        super().__init__()
        embed_dim = config["embed_dim"]
        self.num_heads = config["num_heads"]
        self.num_kv_heads = config.get("num_kv_heads") or self.num_heads
        self.head_dim = config.get("head_dim") or embed_dim // self.num_heads
        self.value_head_dim = config.get("value_head_dim") or self.head_dim
        self.widths = [
            self.num_heads * self.head_dim,
            self.num_kv_heads * self.head_dim,
            self.num_kv_heads * self.value_head_dim,
        ]
        bias = config.get("bias", True)
        self.c_attn = nn.Linear(embed_dim, sum(self.widths), bias=bias)
        self.c_proj = nn.Linear(self.num_heads * self.value_head_dim, embed_dim, bias=bias)
        if block_size is not None:
            mask = torch.tril(torch.ones(block_size, block_size))
            self.register_buffer("bias", mask.view(1, 1, block_size, block_size))

    def forward(self, x: Tensor, key_mask: Optional[Tensor] = None) -> Tensor:
        """With ``key_mask`` (bool (B, L), True for real tokens), SDPA gets the causal mask and
        the key mask as one boolean ``attn_mask``; a row that sees no key gives zeros there, as
        in our op."""
        batch, length, _ = x.shape
        q, k, v = self.c_attn(x).split(self.widths, dim=2)
        q = q.view(batch, length, self.num_heads, self.head_dim).transpose(1, 2)
        k = k.view(batch, length, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = v.view(batch, length, self.num_kv_heads, self.value_head_dim).transpose(1, 2)
        enable_gqa = self.num_kv_heads != self.num_heads
        if key_mask is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=enable_gqa)
        else:
            visible = visibility(length, length, key_mask)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=visible, enable_gqa=enable_gqa)
        return self.c_proj(y.transpose(1, 2).reshape(batch, length, -1))


def left_padded_key_mask(lengths: Sequence[int], total: int) -> Tensor:
    """Bool ``(len(lengths), total)``: row ``b`` is False (padding) but for its last
    ``lengths[b]`` positions, as a tokenizer's left padding."""
    positions = torch.arange(total)
    return positions[None, :] >= total - torch.tensor(lengths)[:, None]


def forward_backward(
    module: nn.Module, x: Tensor, grad_out: Tensor, **kwargs: Any
) -> Tuple[Tensor, Dict[str, Tensor]]:
    """The module's output on ``x`` (and ``kwargs``) and the gradients, under ``grad_out``, of
    the input (key ``"x"``) and of every parameter (keys ``"param.<name>"``)."""
    module.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_(True)
    out = module(x, **kwargs)
    out.backward(grad_out)
    grads = {"x": x.grad}
    grads.update({f"param.{name}": p.grad for name, p in module.named_parameters()})
    return out.detach(), grads


# For test modules that script: torch.jit.script/save/load warn that TorchScript is deprecated in
# favour of torch.export, yet it is still how a model reaches a C++-only program.
IGNORE_TORCHSCRIPT_DEPRECATION = pytest.mark.filterwarnings(
    r"ignore:`torch\.jit\.\w+` is deprecated:DeprecationWarning"
)


def assert_close_to_reference(
    ours: Tensor, ref_same_dtype: Tensor, ref64: Tensor, what: str
) -> None:
    """``max|ours - ref64| <= 2 * max|ref_same_dtype - ref64| + 1e-6 * max(1, max|ref64|)``: in
    every dtype we are at most twice as far from the float64 answer as the reference computed in
    that dtype, up to a float32 rounding slack relative to the magnitude (sums over many
    positions, such as bias gradients, round differently with the alignment of their operands).
    """
    ours_error = (ours.double() - ref64).abs().max().item()
    ref_error = (ref_same_dtype.double() - ref64).abs().max().item()
    slack = 1e-6 * max(1.0, ref64.abs().max().item())
    assert ours_error <= 2 * ref_error + slack, (
        f"{what}: max error {ours_error:.3g} vs the reference's {ref_error:.3g} in "
        f"{ours.dtype}"
    )
