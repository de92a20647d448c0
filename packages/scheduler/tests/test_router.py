"""Routing over data-parallel replicas: the load each policy follows, prefixes kept together,
replicas taken out."""

from __future__ import annotations

import pytest

from nano_kvcache import BlockManager
from nano_scheduler.router import (
    ROUTERS,
    LeastTokens,
    NoReplicaError,
    PrefixAware,
    RoundRobin,
    make_router,
    request_cost,
)


def test_least_tokens_follows_the_tokens_routed_done_and_ended():
    router = LeastTokens(3)
    assert [router.route(i, [1, 2], cost) for i, cost in enumerate((100, 50, 70))] == [0, 1, 2]
    assert router.outstanding == [100, 50, 70]
    assert router.route("d", [1], 10) == 1  # 50 is the least
    router.progress(0, 80)  # replica 0 reported 80 of its 100 tokens done
    assert router.outstanding == [20, 60, 70]
    router.progress(0, 500)  # never below what it was charged
    assert router.outstanding[0] == 0
    router.finish(1)  # replica 1's first request ended: the rest of its cost goes
    assert router.outstanding == [0, 10, 70]
    router.finish(1)  # (twice: nothing more)
    router.progress("unknown", 5)
    assert router.outstanding == [0, 10, 70]
    assert router.replica_of("d") == 1 and router.replica_of(1) is None


def test_a_replica_taken_out_gets_nothing_and_none_left_is_an_error():
    router = LeastTokens(2)
    router.remove(0)
    assert {router.route(i, [1], 1) for i in range(5)} == {1}
    with pytest.raises(NoReplicaError, match="besides replica 1"):
        router.route("x", [1], 1, avoid=1)
    router.remove(1)
    with pytest.raises(NoReplicaError, match="no replica is serving"):
        router.route("y", [1], 1)
    with pytest.raises(ValueError, match="routed already"):
        router.route(0, [1], 1)


def test_round_robin_takes_each_serving_replica_in_turn():
    router = RoundRobin(3)
    assert [router.route(i, [], 1000 * i) for i in range(4)] == [0, 1, 2, 0]
    router.remove(1)
    assert [router.route(i, [], 1) for i in range(4, 8)] == [2, 0, 2, 0]


def test_prefix_aware_keeps_a_prefix_on_one_replica_within_the_imbalance_bound():
    router = PrefixAware(2, block_size=4, max_imbalance=0.0, slack_tokens=80)
    system = list(range(100, 116))  # four full blocks shared by the first requests
    first = router.route("a", [*system, 1, 2, 3], 50)
    assert first == 0
    other = router.route("b", list(range(500, 520)), 50)  # another prompt: the least loaded
    assert other == 1
    # The same prefix goes where it went, while that replica is within the bound ...
    assert [router.route(f"s{i}", [*system, 9, i], 30) for i in range(3)] == [0, 0, 0]
    assert router.outstanding == [140, 50]
    # ... and to the least loaded beyond it (which then holds it too).
    assert router.route("s3", [*system, 7], 30) == 1
    assert router.route("s4", [*system, 8], 1) == 1  # (the last to take it)
    # A prompt that shares only its first block with the system prompt follows that block.
    router.finish("s3"), router.finish("s4"), router.finish("b")
    assert router.route("t", system[:4] + [0] * 10, 1) == 1


def test_prefix_aware_hashes_blocks_as_the_block_manager_does():
    router = PrefixAware(2, block_size=4)
    prompt = list(range(13))  # three full blocks before the last token
    expected, h = [], -1
    for b in range(3):
        h = BlockManager.compute_hash(prompt[4 * b : 4 * b + 4], h)
        expected.append(h)
    assert router._hashes(prompt) == expected
    assert router._hashes(prompt[:12]) == expected[:2]  # (the block of the last token: no)


def test_prefix_aware_forgets_the_least_recent_prefixes_beyond_its_capacity():
    router = PrefixAware(2, block_size=2, capacity=4, slack_tokens=0, max_imbalance=10)
    router.route("a", [1, 2, 3, 4, 5], 1)  # two blocks learned, on replica 0
    router.route("b", [6, 7, 8, 9, 10], 1)  # two more, on replica 1
    router.route("c", [11, 12, 13], 1)  # a fifth: the oldest is forgotten
    assert len(router._owner) == 4
    router.finish("a"), router.finish("b"), router.finish("c")
    assert router.route("d", [6, 7, 8, 9, 0], 1) == 1  # still known


def test_make_router_and_bad_arguments():
    assert set(ROUTERS) == {"least_tokens", "prefix_aware", "round_robin"}
    assert isinstance(make_router("prefix_aware", 2, 16), PrefixAware)
    with pytest.raises(ValueError, match="unknown router 'nope'"):
        make_router("nope", 2)
    for bad in (0, -1, True, 1.5):
        with pytest.raises(ValueError, match="num_replicas"):
            LeastTokens(bad)
    with pytest.raises(ValueError, match="block_size"):
        LeastTokens(2, 0)
    with pytest.raises(ValueError, match="max_imbalance"):
        PrefixAware(2, max_imbalance=-1)
    assert request_cost(100, 2, 50) == 300
