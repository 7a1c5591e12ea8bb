"""``CausalSelfAttention``: a multi-head causal self-attention module on the causal_attention op,
with nanoGPT's parameter names, so it swaps into nanoGPT-style models and loads their checkpoints,
and the op's score options: sliding windows, softcapping, ALiBi, learned sinks and attention
dropout.
"""

import math
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn

from .kv_cache import KVCache
from .ops import check_window

# The ops themselves rather than the Python wrappers of .ops: TorchScript cannot compile the
# wrappers' keyword-only arguments, and this module must script.
_attention = torch.ops.causal_attention.attention
_attention_weights = torch.ops.causal_attention.attention_weights


def alibi_slopes(num_heads: int) -> Tensor:
    """ALiBi's head slopes (Press et al.; BLOOM's ``build_alibi_tensor``), float32 ``(num_heads,)``:
    ``2^(-8 i / n)`` for ``i = 1..n`` when ``n`` is a power of two; otherwise those of the largest
    power of two ``c < n``, then every other slope of ``2 c`` heads (``2^(-4 (2 i - 1) / c)``,
    ``i = 1..n - c``), the paper's interpolation. Each is 2 to an exact exponent, rounded once."""
    if num_heads <= 0:
        raise ValueError(f"alibi_slopes: num_heads must be positive, got num_heads={num_heads}")
    closest = 1 << (num_heads.bit_length() - 1)
    exponents = [8 * i / closest for i in range(1, closest + 1)]
    exponents += [4 * (2 * i - 1) / closest for i in range(1, num_heads - closest + 1)]
    return torch.tensor([2.0**-e for e in exponents], dtype=torch.float32)


class CausalSelfAttention(nn.Module):
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

    Bad sizes and options raise ``ValueError``, a ``window`` that is not two ints ``TypeError``;
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
        if embed_dim <= 0 or num_heads <= 0:
            raise ValueError(
                "CausalSelfAttention: embed_dim and num_heads must be positive, got "
                f"embed_dim={embed_dim}, num_heads={num_heads}"
            )
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        if num_kv_heads <= 0 or num_heads % num_kv_heads != 0:
            raise ValueError(
                "CausalSelfAttention: num_kv_heads must be a positive divisor of num_heads, got "
                f"num_heads={num_heads}, num_kv_heads={num_kv_heads}"
            )
        if head_dim is None and embed_dim % num_heads != 0:
            raise ValueError(
                "CausalSelfAttention: embed_dim must be a multiple of num_heads unless head_dim "
                f"is given, got embed_dim={embed_dim}, num_heads={num_heads}"
            )
        head_dim = embed_dim // num_heads if head_dim is None else head_dim
        value_head_dim = head_dim if value_head_dim is None else value_head_dim
        if head_dim <= 0 or value_head_dim <= 0:
            raise ValueError(
                "CausalSelfAttention: head_dim and value_head_dim must be positive, got "
                f"head_dim={head_dim}, value_head_dim={value_head_dim}"
            )
        if not 0.0 <= dropout <= 1.0:
            raise ValueError(
                f"CausalSelfAttention: dropout must be in [0, 1], got dropout={dropout}"
            )
        # Below 1, unlike dropout: the op has no all-dropped case (nn.Dropout(1) is all zeros).
        if not 0.0 <= attn_dropout < 1.0:
            raise ValueError(
                "CausalSelfAttention: attn_dropout must be in [0, 1), got "
                f"attn_dropout={attn_dropout}"
            )
        window = _check_window(window)
        if softcap is not None:
            if isinstance(softcap, bool) or not isinstance(softcap, (int, float)):
                raise TypeError(
                    "CausalSelfAttention: softcap must be a float or None, got "
                    f"{type(softcap).__name__}"
                )
            if not 0 < softcap < math.inf:
                raise ValueError(
                    f"CausalSelfAttention: softcap must be finite and > 0, got softcap={softcap}"
                )
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.value_head_dim = value_head_dim
        self.attn_dropout = float(attn_dropout)
        self.window = window
        self.softcap = None if softcap is None else float(softcap)
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

    @torch.jit.unused
    def set_context_parallel(
        self, group, *, method: str = "ring", layout: str = "zigzag"
    ) -> "CausalSelfAttention":
        """From now on ``forward`` takes this rank's shard ``(B, L/N, E)`` of a sequence sharded
        over the ranks of ``group`` (a ProcessGroup or a 1-D DeviceMesh; ``None`` turns it off)
        in ``layout`` (``"zigzag"`` or ``"contiguous"``, see :mod:`causal_attention.distributed`)
        and returns this rank's rows of the output, attending the whole sequence by ``method``:
        ``"ring"`` or ``"ulysses"`` (which also serves ``key_mask``, this rank's shard of it,
        and ``attn_dropout``). Windows, softcap, sinks and ALiBi apply to global positions.
        Training and inference without a cache or attn_mask. Returns the module. Eager only (a
        scripted module attends unsharded)."""
        from .distributed import ContextParallel

        if group is None:
            self._context_parallel, self.context_parallel_on = None, False
        else:
            self._context_parallel = ContextParallel.of(
                "CausalSelfAttention.set_context_parallel", group, method, layout
            )
            self.context_parallel_on = True
        return self

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
        are appended to the cache, and the queries attend to all of it.

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
        q, k, v, mask = self._project_heads_and_mask(x, cache, key_mask)
        return self._project_output(self._attend(q, k, v, mask, attn_mask))

    @torch.jit.export
    def forward_with_weights(
        self,
        x: Tensor,
        cache: Optional[KVCache] = None,
        key_mask: Optional[Tensor] = None,
        attn_mask: Optional[Tensor] = None,
    ) -> Tuple[Tensor, Tensor]:
        """``forward(x, cache, need_weights=True, key_mask=key_mask, attn_mask=attn_mask)``: the
        output and the attention probabilities ``(B, Hq, L, cached + L)``; also on a scripted
        module."""
        q, k, v, mask = self._project_heads_and_mask(x, cache, key_mask)
        dropout_p = self._attention_dropout_p()
        weights = _attention_weights(
            q,
            k,
            v,
            key_mask=mask,
            attn_mask=attn_mask,
            window=self.window,
            softcap=self.softcap,
            alibi_slopes=self.alibi_slopes,
            sinks=self.sinks,
            dropout_p=dropout_p,
        )
        if dropout_p == 0.0:
            return self._project_output(self._attend(q, k, v, mask, attn_mask)), weights
        # Every call draws a new dropout mask: the output is made from these weights, so that it
        # is the one they describe. Query head h reads key/value head h // (Hq // Hkv).
        batch, length, cached = q.size(0), q.size(2), k.size(2)
        grouped = weights.reshape(batch, self.num_kv_heads, -1, length, cached)
        attended = torch.matmul(grouped, v.unsqueeze(2)).flatten(1, 2)
        return self._project_output(attended), weights

    @torch.jit.export
    def make_cache(self, batch_size: int, max_len: int) -> KVCache:
        """An empty :class:`KVCache` for ``batch_size`` sequences of up to ``max_len`` positions,
        in the dtype and on the device of the parameters."""
        if batch_size <= 0 or max_len <= 0:
            raise ValueError(
                "CausalSelfAttention.make_cache: batch_size and max_len must be positive, got "
                f"batch_size={batch_size}, max_len={max_len}"
            )
        weight = self.c_attn.weight
        shape = [batch_size, self.num_kv_heads, max_len]
        return KVCache(
            torch.zeros(shape + [self.head_dim], dtype=weight.dtype, device=weight.device),
            torch.zeros(shape + [self.value_head_dim], dtype=weight.dtype, device=weight.device),
        )

    @torch.jit.unused
    def forward_paged(self, x: Tensor, step, layer: int = 0) -> Tensor:
        """Serving from a paged KV cache: ``x (total, E)``, the new tokens of a step's requests
        one after the other (:meth:`causal_attention.PagedKVCache.step`: a prefill chunk's,
        a decode's one), their keys and values written into the pages of layer ``layer`` in
        place, each query attending every key of its request (windowed, softcapped, with ALiBi
        and sinks as ``forward``); returns ``(total, E)``. Inference only (no gradient through
        the cache); eager (the op itself compiles and exports), not TorchScript."""
        if not isinstance(x, Tensor) or x.dim() != 2 or x.size(1) != self.embed_dim:
            raise ValueError(
                f"CausalSelfAttention.forward_paged: x must be (total, E) with "
                f"E=embed_dim={self.embed_dim}, got "
                f"{list(x.shape) if isinstance(x, Tensor) else type(x).__name__}"
            )
        if x.size(0) != step.slot_mapping.numel():
            raise ValueError(
                f"CausalSelfAttention.forward_paged: x has {x.size(0)} tokens, the step "
                f"reserved {step.slot_mapping.numel()}"
            )
        total = x.size(0)
        q, k, v = self.c_attn(x).split(
            [
                self.num_heads * self.head_dim,
                self.num_kv_heads * self.head_dim,
                self.num_kv_heads * self.value_head_dim,
            ],
            dim=-1,
        )
        attended = step.attend(
            layer, q.view(total, self.num_heads, self.head_dim),
            k.view(total, self.num_kv_heads, self.head_dim),
            v.view(total, self.num_kv_heads, self.value_head_dim), window=self.window,
            softcap=self.softcap, alibi_slopes=self.alibi_slopes, sinks=self.sinks,
        )
        return self.resid_dropout(self.c_proj(attended.flatten(1)))

    @torch.jit.unused
    def make_paged_cache(self, num_pages: int, page_size: int, num_layers: int = 1):
        """A :class:`causal_attention.PagedKVCache` of ``num_pages`` pages of ``page_size``
        tokens for ``num_layers`` modules like this one (heads, head dims, dtype, device)."""
        from .paged_kv_cache import PagedKVCache

        weight = self.c_attn.weight
        return PagedKVCache(num_pages, page_size, self.num_kv_heads, self.head_dim,
                            self.value_head_dim, num_layers, dtype=weight.dtype,
                            device=weight.device)

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
        # Eager only: TorchScript checks x's type at the call and compiles this branch away.
        if not isinstance(x, Tensor):
            raise TypeError(
                f"CausalSelfAttention: x must be a tensor (B, L, E), got {type(x).__name__}"
            )
        if x.dim() != 3 or x.size(2) != self.embed_dim:
            raise ValueError(
                f"CausalSelfAttention: x must be (B, L, E) with E=embed_dim={self.embed_dim}, "
                f"got x.shape={list(x.shape)}"
            )
        if x.dtype != self.c_attn.weight.dtype:
            raise TypeError(
                f"CausalSelfAttention: x must have the parameters' dtype "
                f"{self.c_attn.weight.dtype}, got x.dtype={x.dtype}"
            )
        batch, length = x.size(0), x.size(1)
        if key_mask is not None:
            # Checked here, before anything enters the cache, and named after x: with a cache,
            # the op would only see the mask of every cached position.
            _check_key_mask(key_mask, x)
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

    @torch.jit.unused
    def _attend_sharded(
        self, q: Tensor, k: Tensor, v: Tensor, key_mask: Optional[Tensor],
        attn_mask: Optional[Tensor],
    ) -> Tensor:
        if attn_mask is not None or k.size(2) != q.size(2):
            raise ValueError(
                "CausalSelfAttention: under context parallelism (set_context_parallel) forward "
                "takes no cache or attn_mask"
            )
        return self._context_parallel.attend(
            q, k, v, key_mask, dropout_p=self._attention_dropout_p(), window=self.window,
            softcap=self.softcap, alibi_slopes=self.alibi_slopes, sinks=self.sinks,
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


def _check_window(window: Sequence[int]) -> Tuple[int, int]:
    left, right = check_window("CausalSelfAttention", window)
    if left < -1 or right < -1:
        raise ValueError(
            "CausalSelfAttention: window entries must be >= -1 (-1: unbounded), got "
            f"window={(left, right)}"
        )
    return (left, right)


def _check_key_mask(key_mask: Tensor, x: Tensor) -> None:
    if not isinstance(key_mask, Tensor):
        raise TypeError(
            "CausalSelfAttention: key_mask must be a bool tensor (B, L) or None, got "
            f"{type(key_mask).__name__}"
        )
    if key_mask.dtype != torch.bool:
        raise TypeError(
            "CausalSelfAttention: key_mask must be a bool tensor (True for real tokens; "
            f"convert an attention_mask with .bool()), got key_mask.dtype={key_mask.dtype}"
        )
    if not (
        key_mask.dim() == 2 and key_mask.size(0) == x.size(0) and key_mask.size(1) == x.size(1)
    ):
        raise ValueError(
            f"CausalSelfAttention: key_mask must be (B, L)={[x.size(0), x.size(1)]} of x, got "
            f"key_mask.shape={list(key_mask.shape)} for x.shape={list(x.shape)}"
        )
    if key_mask.device != x.device:
        raise ValueError(
            f"CausalSelfAttention: key_mask must be on x's device {x.device}, got "
            f"key_mask.device={key_mask.device}"
        )
