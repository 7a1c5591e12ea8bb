"""Shared helpers for the tests of causal_attention.CausalSelfAttention: module configurations
and score options, a nanoGPT-style reference module, key masks, forward + backward runs, quiet
TorchScript, and the directory of files shared with the C++ tests."""

import math
import os
from pathlib import Path
from typing import Any, Dict, Optional, Sequence, Tuple

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attention_testing.tolerances import UNIT_ROUNDOFF
from causal_attention._masks import visible_keys

ROOT = Path(__file__).resolve().parents[2]


def run_reference_example(heading: str, next_heading: str) -> dict:
    """The names the first python block of docs/reference.md's section ``heading`` (up to the
    next ``next_heading``, e.g. "\n## ") defines once it has run."""
    reference = (ROOT / "docs" / "reference.md").read_text()
    section = reference.split(heading, 1)[1].split(next_heading, 1)[0]
    block = section.split("```python\n", 1)[1].split("```", 1)[0]
    names = {}
    exec(block, names)
    return names


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

# The module's score options, each of which changes the output of a call on 40 positions (the
# tests check that it does). The causal ones decode with a KV cache as the full forward attends.
EVERY_SCORE_OPTION = dict(window=(15, 0), softcap=0.5, sinks=True, alibi=True)
CAUSAL_SCORE_OPTIONS = [
    pytest.param(dict(window=(15, 0)), id="sliding-window"),
    pytest.param(dict(softcap=0.25), id="softcap"),
    pytest.param(dict(sinks=True), id="sinks"),
    pytest.param(dict(alibi=True), id="alibi"),
    pytest.param(EVERY_SCORE_OPTION, id="all"),
]
SCORE_OPTIONS = CAUSAL_SCORE_OPTIONS + [
    pytest.param(dict(window=(6, 3)), id="band"),
    pytest.param(dict(window=(-1, -1)), id="bidirectional"),
]


def randomize_sinks(module: nn.Module) -> None:
    """Draws the module's sinks (if any) from N(0, 1): their zero initialization would test the
    gradient at one special point only."""
    if module.sinks is not None:
        with torch.no_grad():
            module.sinks.normal_()


class NanoGPTAttention(nn.Module):
    """nanoGPT's CausalSelfAttention, the reference: built from a config (here a dict of our
    module's options), a fused c_attn split into q, k, v, SDPA with ``is_causal=True``, c_proj,
    and, when ``block_size`` is given, the ``bias`` causal-mask buffer that nanoGPT registers
    without flash attention. Extended to GQA and Dv != D like ours.

    With score options in the config (window, softcap, sinks, alibi) or a dropout mask, it
    attends as nanoGPT does without flash attention, materializing the probabilities, extended as
    the models that have each option do it: Gemma 2's ``softcap * tanh(S / softcap)``, ALiBi's
    ``-slope * |i - j|``, gpt-oss's sinks as an extra softmax column that is then dropped. The
    ``sinks`` parameter and ``alibi_slopes`` buffer are ours' names, loaded from our state_dict
    (the slopes' values are tested against BLOOM's on their own)."""

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
            mask = visible_keys(block_size, block_size).float()  # nanoGPT: tril of ones
            self.register_buffer("bias", mask.view(1, 1, block_size, block_size))
        self.window = tuple(config.get("window", (-1, 0)))
        self.softcap = config.get("softcap")
        self.sinks = nn.Parameter(torch.zeros(self.num_heads)) if config.get("sinks") else None
        alibi = torch.zeros(self.num_heads) if config.get("alibi") else None
        self.register_buffer("alibi_slopes", alibi)
        self.score_options = any(config.get(name) for name in ("softcap", "sinks", "alibi"))
        self.score_options |= self.window != (-1, 0)

    def _heads(self, x: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
        batch, length, _ = x.shape
        q, k, v = self.c_attn(x).split(self.widths, dim=2)
        q = q.view(batch, length, self.num_heads, self.head_dim).transpose(1, 2)
        k = k.view(batch, length, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = v.view(batch, length, self.num_kv_heads, self.value_head_dim).transpose(1, 2)
        return q, k, v

    def weights(
        self,
        x: Tensor,
        key_mask: Optional[Tensor] = None,
        keep: Optional[Tensor] = None,
        dropout_p: float = 0.0,
    ) -> Tensor:
        """The attention probabilities (B, Hq, L, L), materialized: zero where hidden and in rows
        that see no key; with ``keep`` (bool (B, Hq, L, L)), dropped where it is False and the
        rest scaled by 1 / (1 - dropout_p)."""
        q, k, _ = self._heads(x)
        return self._probabilities(q, k, key_mask, keep, dropout_p)

    def _probabilities(
        self,
        q: Tensor,
        k: Tensor,
        key_mask: Optional[Tensor],
        keep: Optional[Tensor],
        dropout_p: float,
    ) -> Tensor:
        length = q.size(2)
        k = k.repeat_interleave(self.num_heads // self.num_kv_heads, dim=1)
        scores = q @ k.transpose(-2, -1) * (1.0 / math.sqrt(self.head_dim))
        if self.softcap is not None:
            scores = self.softcap * torch.tanh(scores / self.softcap)
        if self.alibi_slopes is not None:
            distance = (torch.arange(length).unsqueeze(-1) - torch.arange(length)).abs()
            scores = scores - self.alibi_slopes[:, None, None] * distance
        visible = visible_keys(length, length, self.window, key_mask=key_mask)
        no_key = ~visible.any(-1, keepdim=True)
        # Rows without keys get finite dummy scores (zeroed below), so that neither the softmax
        # nor its gradient sees a row of -inf.
        scores = scores.masked_fill(~visible, -math.inf).masked_fill(no_key, 0.0)
        if self.sinks is None:
            probs = torch.softmax(scores, dim=-1)
        else:
            sink = self.sinks.view(1, -1, 1, 1).expand(scores.shape[:-1] + (1,))
            probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
        probs = probs.masked_fill(no_key, 0.0)
        if keep is not None:
            probs = probs * keep / (1.0 - dropout_p)
        return probs

    def forward(
        self,
        x: Tensor,
        key_mask: Optional[Tensor] = None,
        keep: Optional[Tensor] = None,
        dropout_p: float = 0.0,
    ) -> Tensor:
        """With ``key_mask`` (bool (B, L), True for real tokens), SDPA gets the causal mask and
        the key mask as one boolean ``attn_mask``; a row that sees no key gives zeros there, as
        in our op. With score options or ``keep``, the probabilities are :meth:`weights`'."""
        batch, length, _ = x.shape
        q, k, v = self._heads(x)
        enable_gqa = self.num_kv_heads != self.num_heads
        if self.score_options or keep is not None:
            v = v.repeat_interleave(self.num_heads // self.num_kv_heads, dim=1)
            y = self._probabilities(q, k, key_mask, keep, dropout_p) @ v
        elif key_mask is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=enable_gqa)
        else:
            visible = visible_keys(length, length, key_mask=key_mask)
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
    """``max|ours - ref64| <= 2 * max|ref_same_dtype - ref64| + slack * max(1, max|ref64|)``: in
    every dtype we are at most twice as far from the float64 answer as the reference computed in
    that dtype, up to a slack relative to the magnitude: 1e-6 for float32 rounding (sums over
    many positions, such as bias gradients, round differently with the alignment of their
    operands), and in bfloat16 one rounding to it (its unit roundoff 2^-8), as the C++ module
    test allows: where the reference's last rounding happens to land near the exact value, ours
    may round to the neighbour (a bias gradient with a softcap once erred by 0.061 against a
    bound of 0.060 without it)."""
    ours_error = (ours.double() - ref64).abs().max().item()
    ref_error = (ref_same_dtype.double() - ref64).abs().max().item()
    relative_slack = UNIT_ROUNDOFF[ours.dtype] if ours.dtype == torch.bfloat16 else 1e-6
    slack = relative_slack * max(1.0, ref64.abs().max().item())
    assert ours_error <= 2 * ref_error + slack, (
        f"{what}: max error {ours_error:.3g} vs the reference's {ref_error:.3g} in "
        f"{ours.dtype}"
    )
