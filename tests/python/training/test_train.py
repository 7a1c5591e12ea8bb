"""training.train: swapping SDPA for our op changes the losses of a 50-step float32 run by less
than 1e-4 relative at every step; a run interrupted and resumed from its checkpoint reproduces the
uninterrupted run bit for bit (losses and log); the log, the plot and a sample are written."""

import pytest
import torch

from training.byte_corpus import PackedWindows
from training_testing import TINY_RUN, train

STEPS = 50


@pytest.fixture(autouse=True)
def one_thread(restore_num_threads):
    # A model this small trains fastest on one thread, the more so on a busy machine.
    torch.set_num_threads(1)


def run(tmp_path, name, *flags):
    out = tmp_path / name
    losses = train.main([*TINY_RUN, "--out", str(out), *flags])
    return out, losses


def test_our_attention_and_sdpa_train_to_the_same_losses(tmp_path):
    _, ours = run(tmp_path, "ours", "--steps", str(STEPS), "--attention", "causal_attention")
    _, sdpa = run(tmp_path, "sdpa", "--steps", str(STEPS), "--attention", "sdpa")
    assert len(ours) == len(sdpa) == STEPS
    for step, (a, b) in enumerate(zip(ours, sdpa), start=1):
        assert abs(a - b) <= 1e-4 * abs(b), f"step {step}: ours {a!r} vs sdpa {b!r}"
    # It learns: from about ln(256) = 5.5 nats per byte, well down within 50 steps.
    assert ours[0] > 5.0 and sum(ours[-5:]) / 5 < ours[0] - 1.0, ours


class Interrupted(Exception):
    pass


def test_resumed_run_equals_uninterrupted_run_exactly(tmp_path, monkeypatch):
    full_dir, full = run(tmp_path, "full", "--steps", "24")

    # The interrupted run checkpoints every 8 steps and dies while fetching step 20's batch, after
    # logging 19 steps: resuming must drop the 3 logged after the checkpoint and redo them.
    part_dir = tmp_path / "part"
    fetch = train.RandomWindows.next
    calls = []

    def dying_next(self):
        calls.append(None)
        if len(calls) == 20:
            raise Interrupted
        return fetch(self)

    monkeypatch.setattr(train.RandomWindows, "next", dying_next)
    with pytest.raises(Interrupted):
        train.main([*TINY_RUN, "--out", str(part_dir), "--steps", "24", "--checkpoint-every", "8"])
    monkeypatch.setattr(train.RandomWindows, "next", fetch)
    assert torch.load(part_dir / "checkpoint.pt", weights_only=True)["step"] == 16

    resumed = train.main([*TINY_RUN, "--out", str(part_dir), "--steps", "24", "--resume"])
    assert resumed == full[16:]  # exact float equality
    full_log = [r["loss"] for r in train.read_log(full_dir / "log.csv")]
    part_log = [r["loss"] for r in train.read_log(part_dir / "log.csv")]
    assert part_log == full_log == full


def test_resume_refuses_changed_run_flags(tmp_path):
    out, _ = run(tmp_path, "run", "--steps", "2")
    with pytest.raises(SystemExit, match="--seq-len 32 vs 16"):
        train.main([*TINY_RUN, "--out", str(out), "--steps", "4", "--resume", "--seq-len", "16"])


def test_outputs_and_sample(tmp_path, capsys):
    out, losses = run(tmp_path, "run", "--steps", "3", "--sample", "--prompt", "import ")
    assert [r["step"] for r in train.read_log(out / "log.csv")] == [1, 2, 3]
    assert (out / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = (out / "sample.txt").read_text()
    assert text.startswith("import ") and len(text.encode("utf-8", "surrogateescape")) >= 32
    assert text in capsys.readouterr().out


def test_packed_windows_cut_documents_where_files_begin_and_every_seq_len():
    data = torch.arange(100, dtype=torch.uint8)
    windows = PackedWindows(data, torch.tensor([0, 30, 37, 90]), 2, 8, seed=0)
    for _ in range(5):
        inputs, targets, cu_seqlens = windows.next()
        begin = int(inputs[0])  # the bytes are their own offsets
        assert torch.equal(inputs, torch.arange(begin, begin + 16))
        starts = [s - begin for s in (30, 37, 90) if begin < s < begin + 16]
        bounds = [0, *starts, 16]
        expected = sorted({c for a, b in zip(bounds, bounds[1:]) for c in range(a, b, 8)} | {16})
        assert cu_seqlens.dtype == torch.int32 and cu_seqlens.tolist() == expected
        ignored = (targets == -100).nonzero().flatten().tolist()
        assert ignored == [s - 1 for s in starts]
