"""torch.export of the training GPT (causal_attention.models.GPT) with a dynamic batch and
sequence length, saved and loaded back: the loaded program keeps our op, runs at other shapes and
matches eager. (tests/python/nn/test_torchscript_export.py exports TinyGPT at one fixed shape,
without the round trip.)"""

import torch
from torch.export import Dim

from causal_attention.models import GPT


def test_exported_gpt_round_trips_and_matches_eager_at_other_shapes(tmp_path):
    model = GPT(256, 64, 32, 4, 2, num_kv_heads=2).eval()
    tokens = torch.randint(0, 256, (2, 16))
    exported = torch.export.export(
        model,
        (tokens,),
        dynamic_shapes={"tokens": {0: Dim("batch", max=8), 1: Dim("length", max=64)}},
    )
    path = tmp_path / "gpt.pt2"
    torch.export.save(exported, path)
    loaded = torch.export.load(path)

    targets = [node.target for node in loaded.graph.nodes]
    assert targets.count(torch.ops.causal_attention.attention.default) == 2  # one per block
    for batch, length in ((2, 16), (1, 3), (5, 64)):
        tokens = torch.randint(0, 256, (batch, length))
        with torch.no_grad():
            torch.testing.assert_close(loaded.module()(tokens), model(tokens))
