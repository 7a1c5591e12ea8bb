"""The score options are one type from the op boundary down (csrc/ops/op_arguments.h, and
causal_attention.ops.ScoreOptions in Python): every other layer takes the struct, so the places
that spell the options out one by one stay few. A place is a parenthesized parameter list or
call naming window, softcap, ALiBi, sinks and dropout together (innermost such group, comments
and docstrings left out); before the options type there were 130 in the product code, after
it 24."""

import re
from pathlib import Path

ROOT = Path(__file__).parents[3]
PRODUCT = ("csrc", "causal_attention", "training", "benchmarks")
WORDS = ("window", "softcap", "alibi", "sinks", "dropout")
# Above this a new option would again change every layer.
MOST_SPELLINGS = 30


def code(text: str, suffix: str) -> str:
    """``text`` of a ``suffix`` file without its comments (and docstrings)."""
    if suffix in (".cpp", ".h"):
        return re.sub(r"//[^\n]*", "", text)
    text = re.sub(r'"""[\s\S]*?"""', "", text)
    return re.sub(r"#[^\n]*", "", text)


def spellings(text: str) -> int:
    """The innermost parenthesized groups of ``text`` that name every one of WORDS."""
    stack, groups = [], []
    for i, ch in enumerate(text):
        if ch == "(":
            stack.append(i)
        elif ch == ")" and stack:
            start = stack.pop()
            if all(re.search(rf"\b\w*{w}\w*\b", text[start : i + 1]) for w in WORDS):
                groups.append((start, i))
    return sum(
        not any(o != g and g[0] < o[0] and o[1] < g[1] for o in groups) for g in groups
    )


def product_spellings() -> dict:
    found = {}
    for root in PRODUCT:
        for path in sorted((ROOT / root).rglob("*")):
            if path.suffix in (".cpp", ".h", ".py"):
                count = spellings(code(path.read_text(), path.suffix))
                if count:
                    found[str(path.relative_to(ROOT))] = count
    return found


def test_the_counter_finds_a_spelled_out_call_and_skips_comments():
    assert spellings("f(q, window, softcap, alibi_slopes, sinks, dropout_p)") == 1
    assert spellings("f(g(window, softcap, alibi, sinks, dropout))") == 1  # the inner one
    assert spellings("f(window, softcap, sinks, dropout)") == 0  # no ALiBi
    assert spellings(code("// f(window, softcap, alibi, sinks, dropout)\n", ".cpp")) == 0
    assert spellings(code('"""f(window, softcap, alibi, sinks, dropout)"""', ".py")) == 0


def test_the_score_options_are_spelled_out_in_few_places():
    found = product_spellings()
    assert sum(found.values()) <= MOST_SPELLINGS, found
