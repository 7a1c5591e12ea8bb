"""Writes the Python side of the C++ interop tests into a directory (scripts/test.sh passes
build/interop and exports it to ctest as CAUSAL_ATTENTION_INTEROP_DIR):

- tiny_gpt.pt: the scripted TinyGPT (scripts/tiny_gpt.py), which calls causal_attention's op;
- tiny_gpt_expected.pt (torch.save of a dict): a sample batch of tokens and targets, the eager
  model's logits, and the gradient of the cross-entropy loss w.r.t. every parameter
  ("grad.<name>"); plus, for the first block's attention module, its options ("attention.*"), a
  sample input and its eager output, so that C++ can load that module's weights into its own
  CausalSelfAttention and compare.

The GoogleTest case loads both with torch::jit::load / torch::pickle_load, runs forward and
backward in C++, and compares.

    python scripts/export_torchscript_model.py OUT_DIR
"""

import argparse
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

from tiny_gpt import TinyGPT

BATCH, LENGTH = 2, 16


def export(out_dir: Path) -> None:
    torch.manual_seed(0)
    model = TinyGPT().eval()
    attention = model.blocks[0].attn
    tokens = torch.randint(0, model.head.out_features, (BATCH, LENGTH))
    targets = torch.randint(0, model.head.out_features, (BATCH, LENGTH))

    logits = model(tokens)
    F.cross_entropy(logits.flatten(0, 1), targets.flatten()).backward()
    expected = {"tokens": tokens, "targets": targets, "logits": logits.detach()}
    expected.update({f"grad.{name}": p.grad for name, p in model.named_parameters()})

    attention_x = torch.randn(BATCH, LENGTH, attention.embed_dim)
    with torch.no_grad():
        attention_y = attention(attention_x)
    expected.update(
        {
            "attention.embed_dim": attention.embed_dim,
            "attention.num_heads": attention.num_heads,
            "attention.num_kv_heads": attention.num_kv_heads,
            "attention.head_dim": attention.head_dim,
            "attention.value_head_dim": attention.value_head_dim,
            "attention.bias": attention.c_attn.bias is not None,
            "attention.x": attention_x,
            "attention.y": attention_y,
        }
    )

    model.zero_grad(set_to_none=True)
    with warnings.catch_warnings():
        # torch.jit.script is deprecated in favour of torch.export, but it is what a C++ program
        # can load and differentiate through, which is the point here.
        warnings.simplefilter("ignore", DeprecationWarning)
        scripted = torch.jit.script(model)
    out_dir.mkdir(parents=True, exist_ok=True)
    scripted.save(str(out_dir / "tiny_gpt.pt"))
    torch.save(expected, out_dir / "tiny_gpt_expected.pt")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", type=Path)
    export(parser.parse_args().out_dir)


if __name__ == "__main__":
    main()
