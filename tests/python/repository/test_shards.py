"""The shards of a test run (attention_testing/shards.py): every test in exactly one shard, by
its place in the sorted ids whatever the order of collection, and a bad spec refused by name."""

import random

import pytest
from attention_testing.shards import SHARD_VARIABLE, parse_shard, shard_ids

IDS = [f"tests/python/ops/test_{name}.py::test_{i}[{p}]"
       for name in ("a", "b", "c") for i in range(7) for p in ("f32", "bf16")]


@pytest.mark.parametrize("count", [1, 2, 3])
def test_shards_cover_every_test_once(count):
    shards = [shard_ids(IDS, index, count) for index in range(count)]
    assert sorted(test_id for shard in shards for test_id in shard) == sorted(IDS)
    assert max(map(len, shards)) - min(map(len, shards)) <= 1


def test_a_shard_does_not_depend_on_the_order_of_collection():
    shuffled = IDS[:]
    random.Random(0).shuffle(shuffled)
    assert shard_ids(shuffled, 1, 2) == shard_ids(IDS, 1, 2)
    assert shard_ids(IDS, 1, 2) == set(sorted(IDS)[1::2])


@pytest.mark.parametrize("spec", ["", "1", "2/2", "-1/2", "a/b", "1/2/3", "0/0"])
def test_a_bad_spec_names_the_variable(spec):
    with pytest.raises(ValueError, match=SHARD_VARIABLE):
        parse_shard(spec)


def test_a_good_spec_parses():
    assert parse_shard("1/2") == (1, 2)
