"""The shards of a test run. With CAUSAL_ATTENTION_TEST_SHARD="i/n", pytest runs shard i of n
(tests/python/conftest.py): the collected tests whose place in the sorted test ids is i, i + n,
i + 2n, ..., in their usual order. scripts/setup_env.sh's pytest_in_shards runs the shards of a
run at once, one process each, so that both cores work (most tests keep one core busy with
Python). Every n-th test splits each file, the slow ones too, about evenly; sorted ids, not the
order of collection, decide, so that the shards stay complementary even where two processes
collect in different orders (a parametrization drawn from a set of strings follows each
process's hash seed)."""

from collections.abc import Iterable

SHARD_VARIABLE = "CAUSAL_ATTENTION_TEST_SHARD"


def parse_shard(spec: str) -> tuple[int, int]:
    """(i, n) from "i/n" with 0 <= i < n; a ValueError naming the variable otherwise."""
    try:
        index, count = (int(part) for part in spec.split("/"))
    except ValueError:
        index = count = -1
    if not 0 <= index < count:
        raise ValueError(f'{SHARD_VARIABLE} must be "i/n" with 0 <= i < n, got "{spec}"')
    return index, count


def shard_ids(test_ids: Iterable[str], index: int, count: int) -> set[str]:
    """The ids of shard `index` of `count`: those whose place in sorted order is index modulo
    count."""
    return set(sorted(test_ids)[index::count])
