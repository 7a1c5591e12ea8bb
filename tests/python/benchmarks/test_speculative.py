"""`python -m benchmarks.speculative --quick`: draft-and-verify decoding of a continuous-batching
queue outputs the target's plain greedy tokens, request by request, for a chain and a tree of
drafts, whether the drafts are all accepted (the target as its own draft), mostly (its first
block) or hardly ever (an unrelated model: nearly every draft truncated away); a wrong
acceptance rule makes the tokens differ, so the comparison can fail."""

import pytest
import torch

from benchmarks import speculative
from benchmarks.speculative_decoding import Tree, accept_greedy

ARGS = speculative.parse_args(["--quick"])
QUEUE = speculative.make_queue(ARGS.requests, ARGS.min_len, ARGS.max_len, ARGS.vocab, ARGS.seed)
TARGET = speculative.random_gpt(ARGS, seed=0)


def greedy_alone(prompt, new):
    """The target's greedy tokens for one request decoded alone (GPT.generate, top-1)."""
    with torch.no_grad():
        return TARGET.generate(prompt[None], new, top_k=1)[0, prompt.numel():].tolist()


PLAIN = [greedy_alone(prompt, new) for prompt, new in QUEUE]


@pytest.mark.parametrize("shape", ["chain", "tree"])
@pytest.mark.parametrize("draft", ["target", "first-block", "unrelated"])
def test_speculative_tokens_equal_plain_greedy_decoding(shape, draft):
    model = {"target": TARGET, "first-block": speculative.first_blocks(TARGET, 1),
             "unrelated": speculative.random_gpt(ARGS, seed=1)}[draft]
    result = speculative.speculate(TARGET, model, QUEUE, ARGS, shape)
    assert result["outputs"] == PLAIN
    assert result["pages_in_use_after"] == 0
    rate = result["accepted"] / result["proposed"]
    if draft == "target":
        assert rate == 1
    elif draft == "unrelated":
        assert rate < 0.5  # rejections (and truncations) on most steps
    tokens = sum(len(o) for o in PLAIN)
    assert result["target_calls"] < tokens / 2 or draft == "unrelated"


def accept_every_draft(tree: Tree, picks):
    """A wrong rule: the first branch's drafts taken whatever the target chose."""
    first = [t for j, t in enumerate(tree.tokens) if tree.parents[j] == j - 1]
    return first + [picks[len(first)]]


def test_a_wrong_acceptance_rule_differs_from_plain_greedy_decoding():
    draft = speculative.random_gpt(ARGS, seed=1)
    result = speculative.speculate(TARGET, draft, QUEUE, ARGS, "chain", accept=accept_every_draft)
    assert result["outputs"] != PLAIN


def test_accept_greedy_follows_the_matching_branch_then_outputs_the_targets_token():
    tree = Tree(tokens=[5, 6, 7, 8], parents=[-1, 0, -1, 2])  # 5 -> 6 and 7 -> 8
    assert accept_greedy(tree, [7, 0, 0, 8, 9]) == [7, 8, 9]
    assert accept_greedy(tree, [5, 6, 1, 0, 0]) == [5, 6, 1]
    assert accept_greedy(tree, [3, 6, 1, 0, 0]) == [3]


def test_the_quick_run_prints_equal_tokens_for_every_draft_and_shape(capsys):
    report = speculative.main(["--quick"])
    assert [row["equal"] for rows in report.values() for row in rows.values()] == [True] * 4
    assert "tokens equal plain decoding's: True" in capsys.readouterr().out
