"""The small GPT that scripts/export_torchscript_model.py ships to C++ and that the TorchScript and
torch.export tests trace: causal_attention.models.GPT (the model scripts/train.py trains) at a
fixed tiny size, with grouped-query attention and a value head width unlike the key's."""

from causal_attention.models import GPT


class TinyGPT(GPT):
    """``tokens (B, L) int64 -> logits (B, L, vocab_size)``, with ``L <= max_len``."""

    def __init__(
        self,
        vocab_size: int = 64,
        max_len: int = 32,
        embed_dim: int = 32,
        num_heads: int = 4,
        num_kv_heads: int = 2,
        value_head_dim: int = 12,
        num_layers: int = 2,
    ):
        super().__init__(
            vocab_size,
            max_len,
            embed_dim,
            num_heads,
            num_layers,
            num_kv_heads=num_kv_heads,
            value_head_dim=value_head_dim,
        )
