"""causal_attention as a Hugging Face transformers attention backend.

    import causal_attention.integrations.transformers as ca_transformers
    ca_transformers.register()
    model = AutoModelForCausalLM.from_config(config, attn_implementation="causal_attention")

It serves what the op computes exactly: causal self-attention (GQA included, K/V heads read in
place), with or without transformers' KV cache (dynamic or static, sliding-window layers'
included), and

- padded batches, left or right padding (``generate`` on a left-padded batch included): the 4-D
  mask transformers builds is read back into causality and a per-key mask, which the op takes as
  ``key_mask`` (a static cache's unused slots, hidden from every query, are cut off); query
  rows that are padding themselves see no key and return zeros;
- sliding windows (Mistral, Qwen2, Gemma 2's and gpt-oss's local layers): the band the mask
  shows, a query seeing itself and the ``W - 1`` keys before it, is read back into the op's
  ``window=(W - 1, 0)`` (with the per-key mask, for padding); without a mask, the
  ``sliding_window`` kwarg says it;
- packed sequences (padding-free training, ``DataCollatorWithFlattening``): from the
  ``cu_seq_lens_q``/``cu_seq_lens_k`` kwargs, from the block-diagonal mask transformers builds
  out of restarting ``position_ids``, or, when it builds no mask or one that shows no packing
  (it does not see the packing while a cache is in use, and gpt-oss never gives its masks the
  ``position_ids``), from the restarting ``position_ids`` themselves, as ``flash_attention_2``
  does; so every layer of a forward runs packed alike, the full layers that get no mask and the
  sliding ones that get a band over the whole row. These go to
  :func:`causal_attention.varlen_attention`, a sliding window applying within each sequence;
- the scores' options the models pass as kwargs: ``softcap`` (Gemma 2's
  ``attn_logit_softcapping``), ``s_aux`` (gpt-oss's learned attention sinks, which get their
  gradient), and ``dropout`` (``attn_pdrop``, ``attention_dropout``: models pass it in training
  only; as with SDPA it is applied whenever it is not 0, its seed drawn from torch's default
  generator, so the same generator state gives the same result).

- non-causal layers (encoders, cross-attention): full attention, with the per-key mask a
  bidirectional padding mask shows.

Every mask is verified to be exactly one of these before it is used. Any other mask — a custom
4-D one, bidirectional with more than padding, prefix-LM, chunked, a bias in a float mask — and
the ``position_bias`` a model adds go to the op as ``attn_mask`` (a learned one gets its
gradient), the blocks they hide skipped: the results are those of ``"sdpa"`` and ``"eager"``
but for query rows that see no key, zeros here.
"""

from .backend import (
    attention_forward,
    bidirectional_layout,
    causal_layout,
    masked_attention,
    packed_attention,
    register,
    score_options,
    window_of,
)
from .mask_reading import (
    NAME,
    MaskLayout,
    Sequences,
    as_boolean_mask,
    block_causal,
    check_mask_shape,
    check_same_sequences,
    is_whole_rows,
    look_back,
    read_key_mask,
    read_mask,
    read_packed_sequences,
    sequences_from_kwargs,
    sequences_from_position_ids,
    sequences_from_starts,
)

__all__ = [
    "NAME",
    "register",
    "attention_forward",
    "causal_layout",
    "bidirectional_layout",
    "masked_attention",
    "packed_attention",
    "score_options",
    "window_of",
    "Sequences",
    "MaskLayout",
    "check_mask_shape",
    "as_boolean_mask",
    "look_back",
    "read_mask",
    "read_key_mask",
    "read_packed_sequences",
    "block_causal",
    "sequences_from_starts",
    "sequences_from_position_ids",
    "sequences_from_kwargs",
    "is_whole_rows",
    "check_same_sequences",
]
