"""Draft-and-verify greedy decoding of a continuous-batching queue from two paged KV caches
(benchmarks/speculative.py runs and times it).

Each request's sequence is its prompt and the tokens output so far; a cache holds a prefix of
it, and each step feeds the rest ("pending": at least the last token, which is never fed before
it is output). A step:

  draft    the draft GPT feeds each request's pending tokens and proposes a tree of depth k
           below the last: a chain (its greedy tokens), or two branches (its top-2 tokens at
           the first position, its greedy chain below each; the second branch a fork of the
           request in the draft's cache, sharing its pages). Then the draft's cache is
           truncated back to the sequence: the next step feeds the accepted tokens again.
  verify   ONE target forward_paged call for every running request: its pending tokens (causal)
           and its tree's nodes (each sees the pending tokens, its ancestors and itself:
           spec_mask through PagedKVCache.step, positions by depth).
  accept   from the last pending token down the tree, while the target's greedy token is a
           child's, that child is accepted; the target's greedy token where none matched is
           output too. The target's cache is truncated to the nodes laid out before any other
           branch (the accepted chain's; a second branch's lie after the first's, so its
           accepted tokens are fed again next step).

New requests are prefilled (all of the prompt but its last token) in one call of each model
when they join, as others finish.
"""

from collections import deque
from typing import Callable, Dict, List, NamedTuple

import torch

from causal_attention.models import GPT


class Tree(NamedTuple):
    """A request's draft tokens below its last pending token: ``parents[j]``, the index of node
    j's parent (-1: the pending token), in layout order."""

    tokens: List[int]
    parents: List[int]


def accept_greedy(tree: Tree, picks: List[int]) -> List[int]:
    """The tokens a step outputs: the tree's nodes the target's greedy tokens follow, then the
    target's own. ``picks[0]`` is its greedy token after the pending tokens, ``picks[1 + j]``
    after node j."""
    out, node = [], -1
    while True:
        token = picks[node + 1]
        out.append(token)
        children = [j for j, p in enumerate(tree.parents) if p == node and tree.tokens[j] == token]
        if not children:
            return out
        node = children[0]


def verify_mask(trees: List[Tree], pending: List[int]) -> torch.Tensor:
    """spec_mask (total new tokens, max new tokens) for requests feeding ``pending[i]`` tokens
    then ``trees[i]``'s nodes: the pending tokens causal, each node seeing them, its ancestors
    and itself."""
    counts = [c + len(t.tokens) for t, c in zip(trees, pending)]
    mask = torch.zeros(sum(counts), max(counts), dtype=torch.bool)
    row = 0
    for tree, c in zip(trees, pending):
        mask[row:row + c, :c] = torch.ones(c, c, dtype=torch.bool).tril()
        for j, parent in enumerate(tree.parents):
            seen = mask[row + c + j]
            seen[:c] = True
            seen[c + j] = True
            if parent >= 0:
                seen |= mask[row + c + parent]
        row += c + len(tree.tokens)
    return mask


def depths(tree: Tree) -> List[int]:
    """Each node's depth below the last pending token (1: its child)."""
    out: List[int] = []
    for parent in tree.parents:
        out.append(1 if parent < 0 else out[parent] + 1)
    return out


class Speculator:
    """The queue served by draft and verify (module docstring); :meth:`run` returns each
    request's output tokens and counts. ``accept`` is the acceptance rule (a wrong one makes the
    output differ from the target's greedy decoding: tests/python/benchmarks)."""

    def __init__(self, target: GPT, draft: GPT, depth: int, branches: int, max_batch: int,
                 page_size: int, num_pages: int,
                 accept: Callable[[Tree, List[int]], List[int]] = accept_greedy) -> None:
        if branches not in (1, 2):
            raise ValueError(f"branches must be 1 (a chain) or 2 (a tree), got {branches}")
        # A tree step feeds up to depth + 1 re-fed tokens and 2 x depth nodes: paged_attention's
        # spec_mask takes at most 64 new tokens a sequence.
        if not 1 <= depth <= 21:
            raise ValueError(f"depth must be in [1, 21] (at most 64 new tokens), got {depth}")
        self.target, self.draft, self.depth, self.branches = target, draft, depth, branches
        self.max_batch, self.accept = max_batch, accept
        self.target_cache = target.make_paged_cache(num_pages, page_size)
        self.draft_cache = draft.make_paged_cache(num_pages, page_size)

    def run(self, queue: List[tuple]) -> Dict[str, object]:
        """``queue``: requests ``(prompt (P,) int64, output length N)``, N >= 1. Returns their
        outputs, the target's calls (verify steps and prefills), the draft's calls, the draft
        tokens proposed along one branch and those accepted."""
        waiting = deque(range(len(queue)))
        self.sequences: Dict[int, List[int]] = {}
        self.outputs = {r: [] for r in range(len(queue))}
        counts = dict(target_calls=0, draft_calls=0, proposed=0, accepted=0)
        with torch.no_grad():
            while waiting or self.sequences:
                joining = []
                while waiting and len(self.sequences) + len(joining) < self.max_batch:
                    joining.append(waiting.popleft())
                self._prefill(joining, queue, counts)
                requests = list(self.sequences)
                depth = {r: min(self.depth, queue[r][1] - len(self.outputs[r]) - 1)
                         for r in requests}
                trees = self._draft([r for r in requests if depth[r] > 0], depth, counts)
                outputs = self._verify(requests, trees, counts)
                for r, tokens in zip(requests, outputs):
                    counts["proposed"] += depth[r]
                    counts["accepted"] += len(tokens) - 1
                    self.sequences[r] += tokens
                    self.outputs[r] = (self.outputs[r] + tokens)[:queue[r][1]]
                    if len(self.outputs[r]) == queue[r][1]:
                        del self.sequences[r]
                        self.target_cache.free(r)
                        self.draft_cache.free(r)
        return dict(outputs=[self.outputs[r] for r in range(len(queue))], **counts,
                    pages_in_use_after=self.target_cache.pages_in_use
                    + self.draft_cache.pages_in_use)

    def _prefill(self, joining: List[int], queue: List[tuple], counts: dict) -> None:
        """Each joining request's prompt but its last token into both caches, one call each."""
        fed = [r for r in joining if queue[r][0].numel() > 1]
        for r in joining:
            self.sequences[r] = queue[r][0].tolist()
            self.target_cache.allocate(r)
            self.draft_cache.allocate(r)
        if not fed:
            return
        tokens = torch.cat([queue[r][0][:-1] for r in fed])
        for model, cache, name in ((self.target, self.target_cache, "target_calls"),
                                   (self.draft, self.draft_cache, "draft_calls")):
            model.forward_paged(tokens, cache.step(fed, [queue[r][0].numel() - 1 for r in fed]))
            counts[name] += 1

    def _pending(self, cache, r) -> List[int]:
        return self.sequences[r][cache.length(r):]

    def _draft(self, requests: List[int], depth: Dict[int, int], counts: dict) -> Dict[int, Tree]:
        """Each request's tree, proposed by the draft; its cache truncated back to the
        sequence."""
        trees = {r: Tree([], []) for r in self.sequences}
        if not requests:
            return trees
        cache = self.draft_cache
        pending = [self._pending(cache, r) for r in requests]
        step = cache.step(requests, [len(p) for p in pending])
        logits = self.draft.forward_paged(torch.tensor(sum(pending, [])), step)
        counts["draft_calls"] += 1
        firsts = logits[step.cu_seqlens_q[1:].long() - 1].topk(self.branches, -1).indices.tolist()
        # Each branch a request of the draft's cache: the request itself, then its forks.
        branches = [(r, b) for r in requests for b in range(self.branches)]
        for r, b in branches:
            if b > 0:
                cache.fork(r, (r, b))
        lanes = {(r, b): [firsts[i][b]] for i, r in enumerate(requests)
                 for b in range(self.branches)}
        for level in range(1, max(depth.values())):
            growing = [(r, b) for r, b in branches if depth[r] > level]
            ids = [r if b == 0 else (r, b) for r, b in growing]
            step = cache.step(ids, [1] * len(ids))
            fed = torch.tensor([lanes[key][-1] for key in growing])
            picks = self.draft.forward_paged(fed, step).argmax(-1).tolist()
            counts["draft_calls"] += 1
            for key, token in zip(growing, picks):
                lanes[key].append(token)
        for r, b in branches:
            if b > 0:
                cache.free((r, b))
            cache.truncate(r, len(self.sequences[r]))
            start = len(trees[r].tokens)
            trees[r].tokens.extend(lanes[(r, b)])
            trees[r].parents.extend([-1] + list(range(start, start + depth[r] - 1)))
        return trees

    def _verify(self, requests: List[int], trees: Dict[int, Tree], counts: dict) -> List[List[int]]:
        """One target call for every request's pending tokens and tree; each request's accepted
        tokens and the target's next, its cache truncated to what it keeps."""
        cache = self.target_cache
        pending = [self._pending(cache, r) for r in requests]
        lengths = [cache.length(r) for r in requests]
        ordered = [trees[r] for r in requests]
        fed = sum([p + t.tokens for p, t in zip(pending, ordered)], [])
        step = cache.step(requests, [len(p) + len(t.tokens) for p, t in zip(pending, ordered)],
                          spec_mask=verify_mask(ordered, [len(p) for p in pending]))
        positions = sum([list(range(n, n + len(p))) + [n + len(p) - 1 + d for d in depths(t)]
                         for n, p, t in zip(lengths, pending, ordered)], [])
        step = step._replace(positions=torch.tensor(positions, device=step.positions.device))
        picks = self.target.forward_paged(torch.tensor(fed), step).argmax(-1).tolist()
        counts["target_calls"] += 1
        outputs, row = [], 0
        for r, n, p, tree in zip(requests, lengths, pending, ordered):
            out = self.accept(tree, picks[row + len(p) - 1:row + len(p) + len(tree.tokens)])
            row += len(p) + len(tree.tokens)
            # Nodes 0, 1, ... kept while they are the accepted path: their keys lie in order.
            kept = 0
            while kept < len(out) - 1 and kept < len(tree.tokens) \
                    and tree.tokens[kept] == out[kept] and tree.parents[kept] == kept - 1:
                kept += 1
            cache.truncate(r, n + len(p) + kept)
            outputs.append(out)
        return outputs
