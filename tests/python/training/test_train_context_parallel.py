"""`torchrun -m training.train --context-parallel C`: each sequence sharded over C ranks (ring or
Ulysses attention), alone or on a 2-D mesh with --ddp, or a packed row of documents
(--pack-documents) sharded per document, trains as one process does on the same data: the loss
curves agree per step to float32 rounding."""

import pytest
import torch

from training_testing import TINY_RUN, torchrun, train

STEPS = ["--steps", "4"]


@pytest.mark.parametrize(
    "processes, flags",
    [
        (2, ["--context-parallel", "2"]),
        (4, ["--ddp", "--context-parallel", "2", "--context-parallel-method", "ulysses",
             "--context-parallel-layout", "contiguous"]),
        (2, ["--context-parallel", "2", "--pack-documents"]),
    ],
    ids=["ring-zigzag-2", "ddp2-x-ulysses2", "packed-ring-zigzag-2"],
)
def test_context_parallel_training_matches_one_process(tmp_path, processes, flags):
    sharded = torchrun(processes, [*TINY_RUN, *STEPS, *flags], tmp_path / "cp")
    packed = [flag for flag in flags if flag == "--pack-documents"]
    single = train.main([*TINY_RUN, *STEPS, *packed, "--out", str(tmp_path / "single")])
    assert len(sharded) == len(single) == 4
    torch.testing.assert_close(torch.tensor(sharded), torch.tensor(single), rtol=2e-6, atol=0)
    assert single[0] != single[-1]  # it trained


def test_context_parallel_needs_torchrun_and_refuses_compile(tmp_path):
    with pytest.raises(SystemExit, match="torchrun"):
        train.main([*TINY_RUN, "--context-parallel", "2", "--out", str(tmp_path)])
    with pytest.raises(SystemExit):
        train.parse_args([*TINY_RUN, "--context-parallel", "2", "--compile"])
