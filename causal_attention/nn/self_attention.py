"""The module :class:`CausalSelfAttention` itself: its parameters and state, the projections of
``x`` into heads (through its KV cache) and back, and the attention by the op. Its weights, its
decoding paths, its context parallelism and its packed documents are its bases' (weights.py,
decoding.py, context_parallel.py, packed.py); its options are checked in options.py, its inputs
in inputs.py.
"""

from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn

from ..kv_cache import KVCache
from .context_parallel import ContextParallelism
from .decoding import Decoding
from .packed import PackedDocuments
from .inputs import check_input, check_key_mask
from .options import (
    alibi_slopes,
    check_dropouts,
    check_flags,
    check_softcap,
    check_window,
    head_sizes,
)
from .weights import AttentionWeights

# The ops themselves rather than the Python wrappers of .ops: TorchScript cannot compile the
# wrappers' keyword-only arguments, and this module must script.
_attention = torch.ops.causal_attention.attention


class CausalSelfAttention(AttentionWeights, Decoding, ContextParallelism, PackedDocuments,
                          nn.Module):
    """Multi-head self-attention, causal by default, ``(B, L, E) -> (B, L, E)``.

    Parameters are nanoGPT's: ``c_attn``, one ``Linear(E, (Hq + Hkv) * D + Hkv * Dv)`` whose
    output is split into queries, keys and values, and ``c_proj``, ``Linear(Hq * Dv, E)``.
    The C++ module ``causal_attention::nn::CausalSelfAttention`` has the same names and layout, so
    a state_dict moves between nanoGPT, this module and C++ unchanged. nanoGPT's ``bias`` buffer
    (its causal mask) is accepted by ``load_state_dict`` and ignored: this module is causal by
    construction.

    Args:
        embed_dim: ``E``, the width of input and output.
        num_heads: ``Hq``, the query heads.
        num_kv_heads: ``Hkv``, the key/value heads, a divisor of ``num_heads`` (GQA; 1 is MQA).
            Default: ``num_heads``.
        head_dim: ``D``, the query/key width per head. Default: ``embed_dim // num_heads``.
        value_head_dim: ``Dv``, the value width per head. Default: ``head_dim``.
        bias: whether ``c_attn`` and ``c_proj`` have biases.
        dropout: dropout on the output projection in training (nanoGPT's ``resid_dropout``).
        attn_dropout: dropout on the attention probabilities in training (nanoGPT's and GPT-2's
            ``attn_dropout``), in ``[0, 1)``; evaluation mode attends exactly. The op draws each
            call's mask from torch's default generator, so ``torch.manual_seed`` repeats it.
        window: ``(left, right)``: position ``i`` attends position ``j`` iff
            ``i - left <= j <= i + right``, ``-1`` unbounded on that side. The default
            ``(-1, 0)`` is causal; ``(W - 1, 0)`` a sliding window of ``W`` positions (Mistral,
            Gemma 2's local layers), ``(-1, -1)`` bidirectional.
        softcap: caps the scores as ``softcap * tanh(S / softcap)`` (Gemma 2), ``> 0``; None:
            no cap.
        sinks: whether the heads have learned attention sinks (gpt-oss): a parameter ``sinks``
            ``(Hq,)`` of logits, initialized to 0, that join each row's softmax denominator, so
            a row may attend to nothing.
        alibi: whether the scores get ALiBi's position bias ``-slope_h * |i - j|``, its slopes
            (:func:`alibi_slopes`) in the float32 buffer ``alibi_slopes`` ``(Hq,)``, which
            ``.to(dtype)`` leaves float32. Use no position embedding with it.

    ``sinks`` and ``alibi_slopes`` are in the state_dict (a module made with the same options
    loads it strictly), in the C++ module's too. With a KV cache, position ``i`` is counted from
    the first cached position, so windows and ALiBi decode as the full sequence attends; a window
    that looks ahead (``right != 0``) sees, when decoding, only the positions given so far.

    Bad sizes and options raise ``ValueError``, a ``window`` that is not two ints or a flag
    (``bias``, ``sinks``, ``alibi``) that is not a bool ``TypeError``;
    an input that is not a tensor, or of the wrong dtype, raises ``TypeError`` (inside a scripted
    module, errors arrive as ``torch.jit.Error`` naming the Python exception).
    """

    # For TorchScript, which would otherwise type a None attribute as NoneType.
    softcap: Optional[float]
    # Whether forward takes a shard of a sequence sharded over a process group (eager only).
    context_parallel_on: bool

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        *,
        num_kv_heads: Optional[int] = None,
        head_dim: Optional[int] = None,
        value_head_dim: Optional[int] = None,
        bias: bool = True,
        dropout: float = 0.0,
        attn_dropout: float = 0.0,
        window: Sequence[int] = (-1, 0),
        softcap: Optional[float] = None,
        sinks: bool = False,
        alibi: bool = False,
        device: Optional[torch.device] = None,
        dtype: Optional[torch.dtype] = None,
    ) -> None:
        super().__init__()
        num_kv_heads, head_dim, value_head_dim = head_sizes(
            embed_dim, num_heads, num_kv_heads, head_dim, value_head_dim
        )
        check_dropouts(dropout, attn_dropout)
        check_flags(bias=bias, sinks=sinks, alibi=alibi)
        window = check_window(window)
        softcap = check_softcap(softcap)
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.value_head_dim = value_head_dim
        self.attn_dropout = float(attn_dropout)
        self.window = window
        self.softcap = softcap
        factory = {"device": device, "dtype": dtype}
        qkv_width = (num_heads + num_kv_heads) * head_dim + num_kv_heads * value_head_dim
        self.c_attn = nn.Linear(embed_dim, qkv_width, bias=bias, **factory)
        self.c_proj = nn.Linear(num_heads * value_head_dim, embed_dim, bias=bias, **factory)
        self.resid_dropout = nn.Dropout(dropout)
        if sinks:
            # 0: each row starts with one extra logit of 0 in its denominator.
            self.sinks = nn.Parameter(torch.zeros(num_heads, **factory))
        else:
            self.register_parameter("sinks", None)
        slopes = alibi_slopes(num_heads).to(device=device) if alibi else None
        self.register_buffer("alibi_slopes", slopes)
        self.context_parallel_on = False
        self._context_parallel = None

    def forward(
        self,
        x: Tensor,
        cache: Optional[KVCache] = None,
        need_weights: bool = False,
        key_mask: Optional[Tensor] = None,
        attn_mask: Optional[Tensor] = None,
    ):
        """Attends ``x (B, L, E)`` (causally, or as ``window`` says) and returns ``(B, L, E)``.

        With ``cache``, ``x`` holds the positions after the cached ones: their keys and values
        are appended to the cache, and the queries attend to all of it. An 8-bit cache
        (``make_cache(..., dtype=torch.int8)``) is read in place with its scales, inference
        only: without ``key_mask``, ``attn_mask``, attention dropout or weights.

        ``key_mask``, bool ``(B, L)`` for the ``L`` positions of ``x`` (True for real tokens,
        False for padding: transformers' ``attention_mask`` as ``.bool()``), hides the padding
        from every query. With a cache it is stored next to the new keys, and every call attends
        with the mask of all cached positions, so a left-padded prompt's padding stays hidden
        through prefill and every decoding step; a call without one adds real positions. Outputs
        at padding positions are not meaningful (a query that sees no key attends to nothing and
        gives ``c_proj``'s bias): ignore them, as transformers does. Pass it by name: it comes
        after ``need_weights`` only because TorchScript compiles no keyword-only arguments.

        ``attn_mask``, SDPA's, broadcastable to ``(B, Hq, L, cached + L)`` (bool, True where a
        query may attend a key, or floating, added to the scores; a learned bias gets its
        gradient), narrows what the window and the key mask let each query see: a document
        mask of a packed batch, a prefix-LM's or a relative-position bias. It is not cached:
        give each call the mask of its queries against every cached key.

        With ``need_weights=True``, returns ``(output, weights)``, the attention probabilities
        ``(B, Hq, L, cached + L)``, materialized (O(L²) memory) for inspection; under a key mask
        they are 0 at hidden keys, and a row that sees no key is all 0; with sinks a row sums to
        less than 1; in training with ``attn_dropout`` they are the dropped and rescaled ones that
        the output was computed with. A TorchScript function has a single return type, so a
        scripted module's ``forward`` returns the output only and raises for
        ``need_weights=True``: call ``forward_with_weights`` there.
        """
        if need_weights:
            # The else is needed: TorchScript compiles only the branch that is_scripting() picks,
            # so the tuple-returning call never enters the scripted forward's return type.
            if torch.jit.is_scripting():
                raise RuntimeError(
                    "CausalSelfAttention: a scripted forward returns the output only; call "
                    "forward_with_weights(x, cache, key_mask) for the attention weights"
                )
            else:
                return self.forward_with_weights(x, cache, key_mask, attn_mask)
        if cache is not None and cache.quantized:
            return self._project_output(self._decode_quantized(x, cache, key_mask, attn_mask))
        q, k, v, mask = self._project_heads_and_mask(x, cache, key_mask)
        return self._project_output(self._attend(q, k, v, mask, attn_mask))

    def _project_heads(
        self, x: Tensor, cache: Optional[KVCache]
    ) -> Tuple[Tensor, Tensor, Tensor]:
        """Queries ``(B, Hq, L, D)``, keys ``(B, Hkv, *, D)`` and values ``(B, Hkv, *, Dv)``, the
        keys and values including the cache's, for subclasses that attend without a key mask
        (models.SDPASelfAttention); the new positions enter the cache as real tokens."""
        q, k, v, _ = self._project_heads_and_mask(x, cache, None)
        return q, k, v

    def _project_heads_and_mask(
        self, x: Tensor, cache: Optional[KVCache], key_mask: Optional[Tensor]
    ) -> Tuple[Tensor, Tensor, Tensor, Optional[Tensor]]:
        """``_project_heads``, and the key mask to attend with: ``key_mask`` itself without a
        cache, the cache's mask of every cached position with one (None if nothing is hidden)."""
        check_input(x, self.embed_dim, self.c_attn.weight.dtype)
        batch, length = x.size(0), x.size(1)
        if key_mask is not None:
            # Checked here, before anything enters the cache, and named after x: with a cache,
            # the op would only see the mask of every cached position.
            check_key_mask(key_mask, x)
        q, k, v = self.c_attn(x).split(
            [
                self.num_heads * self.head_dim,
                self.num_kv_heads * self.head_dim,
                self.num_kv_heads * self.value_head_dim,
            ],
            dim=-1,
        )
        # (B, L, H * D) -> (B, H, L, D) as views: the op reads any strides.
        q = q.view(batch, length, self.num_heads, self.head_dim).transpose(1, 2)
        k = k.view(batch, length, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = v.view(batch, length, self.num_kv_heads, self.value_head_dim).transpose(1, 2)
        if cache is not None:
            k, v, cached_mask = cache.append(k, v, key_mask)
            return q, k, v, cached_mask
        return q, k, v, key_mask

    @torch.jit.unused
    def _project_token_heads(self, x: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
        """Tokens ``x (total, E)`` one after the other (varlen_attention's layout) into queries
        ``(total, Hq, D)``, keys ``(total, Hkv, D)`` and values ``(total, Hkv, Dv)``."""
        total = x.size(0)
        q, k, v = self.c_attn(x).split(
            [
                self.num_heads * self.head_dim,
                self.num_kv_heads * self.head_dim,
                self.num_kv_heads * self.value_head_dim,
            ],
            dim=-1,
        )
        return (q.view(total, self.num_heads, self.head_dim),
                k.view(total, self.num_kv_heads, self.head_dim),
                v.view(total, self.num_kv_heads, self.value_head_dim))

    def _attention_dropout_p(self) -> float:
        return self.attn_dropout if self.training else 0.0

    def _attend(
        self, q: Tensor, k: Tensor, v: Tensor, key_mask: Optional[Tensor],
        attn_mask: Optional[Tensor] = None,
    ) -> Tensor:
        if self.context_parallel_on:
            return self._attend_sharded(q, k, v, key_mask, attn_mask)
        return _attention(
            q,
            k,
            v,
            key_mask=key_mask,
            attn_mask=attn_mask,
            window=self.window,
            softcap=self.softcap,
            alibi_slopes=self.alibi_slopes,
            sinks=self.sinks,
            dropout_p=self._attention_dropout_p(),
        )

    def _project_output(self, attended: Tensor) -> Tensor:
        merged = attended.transpose(1, 2).flatten(2)  # (B, L, Hq * Dv)
        return self.resid_dropout(self.c_proj(merged))

    def _load_from_state_dict(
        self,
        state_dict: Dict[str, Any],
        prefix: str,
        local_metadata: Dict[str, Any],
        strict: bool,
        missing_keys: List[str],
        unexpected_keys: List[str],
        error_msgs: List[str],
    ) -> None:
        # nanoGPT's non-flash module saves its causal mask as a buffer named `bias`; the mask is
        # implied by this module, so the entry is dropped rather than reported as unexpected.
        state_dict.pop(prefix + "bias", None)
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )

    def _apply(self, fn, recurse=True):
        slopes = self.alibi_slopes
        super()._apply(fn, recurse)
        if slopes is not None and self.alibi_slopes.dtype != slopes.dtype:
            # The op takes float32 slopes only, and rounding them to half precision would move
            # every score by up to 2^-9 * slope * distance: a dtype conversion (module.to(dtype),
            # .half(), ...) moves them to its device and keeps their float32 values.
            self.alibi_slopes = slopes.to(self.alibi_slopes.device)
        return self

    def extra_repr(self) -> str:
        options = (
            f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, "
            f"num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
            f"value_head_dim={self.value_head_dim}"
        )
        if self.attn_dropout != 0.0:
            options += f", attn_dropout={self.attn_dropout}"
        if self.window != (-1, 0):
            options += f", window={self.window}"
        if self.softcap is not None:
            options += f", softcap={self.softcap}"
        if self.sinks is not None:
            options += ", sinks=True"
        if self.alibi_slopes is not None:
            options += ", alibi=True"
        return options

