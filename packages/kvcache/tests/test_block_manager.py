from __future__ import annotations

import gc

import pytest

from nano_kvcache import (
    BlockManager,
    KVCacheError,
    OutOfBlocksError,
    SequenceTooLongError,
    UnknownSequenceError,
)


class Seq:
    def __init__(self, token_ids: list[int]) -> None:
        self.token_ids = list(token_ids)
        self.block_table: list[int] = []
        self.num_cached_tokens = 0


def prefill(bm: BlockManager, seq: Seq) -> None:
    """Allocate seq and declare its whole prompt computed, as one scheduled prefill step does."""
    bm.allocate(seq)
    bm.commit(seq, len(seq.token_ids))


@pytest.mark.parametrize(
    "kwargs",
    [
        {"num_blocks": 0, "block_size": 16},
        {"num_blocks": -3, "block_size": 16},
        {"num_blocks": 8, "block_size": 0},
        {"num_blocks": 8.0, "block_size": 16},
        {"num_blocks": True, "block_size": 16},
        {"num_blocks": 8, "block_size": "16"},
    ],
)
def test_bad_constructor_arguments(kwargs):
    with pytest.raises(ValueError, match="must be an integer >= 1"):
        BlockManager(**kwargs)


def test_allocate_gives_distinct_blocks_for_every_token():
    bm = BlockManager(num_blocks=10, block_size=4)
    a, b = Seq(range(9)), Seq(range(100, 104))
    bm.allocate(a)
    bm.allocate(b)
    assert len(a.block_table) == 3 and len(b.block_table) == 1
    assert len(set(a.block_table + b.block_table)) == 4
    assert a.num_cached_tokens == 0 and b.num_cached_tokens == 0
    assert (bm.num_free_blocks, bm.num_used_blocks) == (6, 4)
    assert bm.usage == pytest.approx(0.4)


def test_same_prompt_shares_full_prefix_blocks():
    bm = BlockManager(num_blocks=16, block_size=4)
    prompt = list(range(10))  # blocks [0..3] [4..7] full, [8, 9] partial
    a, b = Seq(prompt), Seq(prompt)
    prefill(bm, a)
    bm.allocate(b)
    assert b.num_cached_tokens == 8
    assert b.block_table[:2] == a.block_table[:2]
    assert b.block_table[2] != a.block_table[2]
    assert [bm.blocks[i].ref_count for i in a.block_table] == [2, 2, 1]
    assert bm.num_used_blocks == 4
    assert (bm.hit_tokens, bm.miss_tokens) == (8, 12)
    assert bm.stats().hit_rate == pytest.approx(8 / 20)


def test_last_prompt_token_is_always_recomputed():
    bm = BlockManager(num_blocks=16, block_size=4)
    a, b = Seq(range(8)), Seq(range(8))  # exactly two full blocks
    prefill(bm, a)
    bm.allocate(b)
    assert b.num_cached_tokens == 4
    assert b.block_table[0] == a.block_table[0] and b.block_table[1] != a.block_table[1]


def test_uncommitted_blocks_are_not_shared():
    # A chunked prefill that has not reached a block yet must not hand it to another sequence.
    bm = BlockManager(num_blocks=16, block_size=4)
    a, b = Seq(range(12)), Seq(range(12))
    bm.allocate(a)
    bm.commit(a, 5)  # first chunk: only block 0 is full and computed
    bm.allocate(b)
    assert b.num_cached_tokens == 4
    assert b.block_table[0] == a.block_table[0]
    assert set(b.block_table[1:]).isdisjoint(a.block_table)


def test_freed_blocks_serve_later_prompts_until_evicted():
    bm = BlockManager(num_blocks=6, block_size=4)
    a = Seq(range(9))
    prefill(bm, a)
    held = list(a.block_table)
    bm.deallocate(a)
    assert a.block_table == [] and bm.num_free_blocks == 6
    assert bm.num_cached_free_blocks == 2  # the two full blocks keep their contents
    b = Seq([*list(range(9)), 50])
    bm.allocate(b)
    assert b.num_cached_tokens == 8 and b.block_table[:2] == held[:2]
    assert bm.num_cached_free_blocks == 0 and bm.evictions == 0


def test_reset_prefix_cache_forgets_free_blocks_and_keeps_those_in_use():
    bm = BlockManager(num_blocks=8, block_size=4)
    freed, running = Seq(range(9)), Seq(range(100, 109))
    prefill(bm, freed)
    prefill(bm, running)
    bm.deallocate(freed)
    assert bm.num_cached_free_blocks == 2
    assert bm.reset_prefix_cache() == 2
    assert bm.num_cached_free_blocks == 0 and bm.num_free_blocks == 5
    again = Seq([*range(9), 7])
    bm.allocate(again)
    assert again.num_cached_tokens == 0  # computed afresh
    shared = Seq([*range(100, 109), 7])
    bm.allocate(shared)
    assert shared.num_cached_tokens == 8  # the running sequence's blocks are still shared
    assert bm.reset_prefix_cache() == 0 and bm.evictions == 0


def test_eviction_takes_blocks_without_contents_first_then_least_recently_freed():
    bm = BlockManager(num_blocks=4, block_size=2)
    a, b = Seq([1, 2, 3]), Seq([7, 8, 9])
    prefill(bm, a)
    prefill(bm, b)
    bm.deallocate(a)  # a's block [1, 2] is freed first: least recently freed
    bm.deallocate(b)
    assert bm.num_cached_free_blocks == 2
    c = Seq([20, 21, 22])  # two blocks: the two uncached free blocks, no eviction
    bm.allocate(c)
    assert bm.evictions == 0
    d = Seq([30])  # one more block: evicts a's block
    bm.allocate(d)
    assert bm.evictions == 1
    e, f = Seq([1, 2, 3]), Seq([7, 8, 9])
    assert not bm.can_allocate(e) and not bm.can_allocate(f)
    bm.deallocate(c)
    bm.deallocate(d)
    bm.allocate(e)
    bm.allocate(f)
    assert e.num_cached_tokens == 0  # evicted: recomputed
    assert f.num_cached_tokens == 2  # b's block survived


def test_a_sequence_tail_is_evicted_before_its_head():
    bm = BlockManager(num_blocks=3, block_size=2)
    a = Seq([1, 2, 3, 4, 5])
    prefill(bm, a)
    bm.deallocate(a)
    other = Seq([9, 9, 9])  # two blocks: the uncached one, then one eviction: the tail [3, 4]
    bm.allocate(other)
    assert bm.evictions == 1
    bm.deallocate(other)
    b = Seq([1, 2, 3, 4, 5])
    bm.allocate(b)
    assert b.num_cached_tokens == 2


def test_different_prompt_after_eviction_gets_no_false_hit():
    bm = BlockManager(num_blocks=3, block_size=2)
    a = Seq([1, 2, 3, 4, 5])
    prefill(bm, a)
    bm.deallocate(a)
    other = Seq([6, 7, 8, 9, 10])  # takes every block: evicts both cached ones
    prefill(bm, other)
    assert bm.evictions == 2
    bm.deallocate(other)
    # a's physical blocks now hold other's contents: a's prompt must not hit them.
    for prompt, cached in (([6, 7, 3, 4, 5], 2), ([1, 2, 3, 4, 5], 0), ([1, 2, 8, 9, 10], 0)):
        seq = Seq(prompt)
        bm.allocate(seq)
        assert seq.num_cached_tokens == cached, prompt
        bm.deallocate(seq)


class CollidingBlockManager(BlockManager):
    @staticmethod
    def hash_contents(contents, prefix_hash=-1):
        return 42  # every block collides


def test_cached_blocks_keep_their_tokens_out_of_the_garbage_collectors_way():
    # A full prefix cache holds every block's token ids; as lists they made each full
    # collection of the server's heap walk them all (tens of ms in the middle of a step).
    bm = BlockManager(num_blocks=8, block_size=4)
    a = Seq(list(range(300, 309)))
    prefill(bm, a)
    registered = [bm.blocks[b] for b in a.block_table[:2]]
    assert [b.token_ids for b in registered] == [list(range(300, 304)), list(range(304, 308))]
    assert not any(gc.is_tracked(b.contents) for b in registered)
    bm.deallocate(a)
    b = Seq(list(range(300, 309)))
    bm.allocate(b)
    assert b.num_cached_tokens == 8


def test_hash_collision_never_shares_wrong_kv():
    bm = CollidingBlockManager(num_blocks=8, block_size=2)
    a = Seq([1, 2, 3])
    prefill(bm, a)
    b = Seq([5, 6, 7])
    bm.allocate(b)
    assert b.num_cached_tokens == 0
    assert set(b.block_table).isdisjoint(a.block_table)
    # Same tokens in the second block but a different parent: still no hit.
    c = Seq([1, 2, 1, 2, 9])
    bm.allocate(c)
    assert c.num_cached_tokens == 2


def test_may_append_adds_a_block_at_each_boundary_and_commits_full_blocks():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = Seq(range(4))
    prefill(bm, a)
    assert len(a.block_table) == 1
    a.token_ids.append(4)
    assert bm.can_append(a)
    bm.may_append(a)
    assert len(a.block_table) == 2
    for t in (5, 6, 7):
        a.token_ids.append(t)
        bm.may_append(a)
    assert len(a.block_table) == 2
    # The decoded block is full now: a later prompt with this prefix shares both blocks.
    b = Seq([*list(range(8)), 99])
    bm.allocate(b)
    assert b.num_cached_tokens == 8 and b.block_table[:2] == a.block_table


def test_may_append_commits_every_block_that_several_new_tokens_fill():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = Seq(range(3))
    prefill(bm, a)
    a.token_ids += [3, 4, 5, 6, 7]  # fills blocks 0 and 1, ending a block
    bm.may_append(a)
    b = Seq([*range(8), 99])
    bm.allocate(b)
    assert b.num_cached_tokens == 8 and b.block_table[:2] == a.block_table[:2]


def test_block_size_one():
    bm = BlockManager(num_blocks=8, block_size=1)
    a = Seq([3, 4, 5])
    prefill(bm, a)
    a.token_ids.append(6)
    bm.may_append(a)
    assert len(a.block_table) == 4
    b = Seq([3, 4, 5, 6, 1])
    bm.allocate(b)
    assert b.num_cached_tokens == 4 and b.block_table[:4] == a.block_table


def test_out_of_blocks_on_append_changes_nothing():
    bm = BlockManager(num_blocks=2, block_size=2)
    a = Seq([1, 2, 3, 4])
    prefill(bm, a)
    a.token_ids.append(5)
    assert not bm.can_append(a)
    with pytest.raises(OutOfBlocksError):
        bm.may_append(a)
    assert len(a.block_table) == 2 and bm.num_free_blocks == 0


def test_out_of_blocks_on_allocate_changes_nothing():
    bm = BlockManager(num_blocks=4, block_size=2)
    a = Seq([1, 2, 3, 4, 5])
    prefill(bm, a)
    before = bm.stats()
    b = Seq([9] * 5)
    assert not bm.can_allocate(b)
    with pytest.raises(OutOfBlocksError):
        bm.allocate(b)
    assert b.block_table == [] and bm.stats() == before


def test_sequence_larger_than_the_pool_is_rejected():
    bm = BlockManager(num_blocks=4, block_size=2)
    seq = Seq(range(9))
    assert not bm.can_allocate(seq)
    with pytest.raises(SequenceTooLongError, match="more than the whole pool of 4 blocks"):
        bm.allocate(seq)
    assert isinstance(SequenceTooLongError("x"), ValueError)
    assert bm.num_free_blocks == 4


def test_deallocating_an_unknown_sequence_is_an_error():
    bm = BlockManager(num_blocks=4, block_size=2)
    seq = Seq([1, 2, 3])
    with pytest.raises(UnknownSequenceError, match="holds no blocks"):
        bm.deallocate(seq)
    bm.allocate(seq)
    bm.deallocate(seq)
    with pytest.raises(UnknownSequenceError):
        bm.deallocate(seq)
    # A table from elsewhere is not trusted either.
    foreign = Seq([1, 2])
    foreign.block_table = [0]
    with pytest.raises(UnknownSequenceError):
        bm.deallocate(foreign)
    assert bm.num_free_blocks == 4
    # Nor committed or appended to (a full block): that would key blocks it does not own.
    foreign = Seq([1, 2, 3, 4])
    foreign.block_table = [0, 1]
    for call in (lambda: bm.commit(foreign, 4), lambda: bm.may_append(foreign)):
        with pytest.raises(UnknownSequenceError):
            call()
    assert bm.hash_to_block == {}


def test_bad_arguments_are_errors():
    bm = BlockManager(num_blocks=4, block_size=2)
    with pytest.raises(KVCacheError, match="no tokens"):
        bm.allocate(Seq([]))
    with pytest.raises(ValueError, match="reserve must be >= 0"):
        bm.can_allocate(Seq([1, 2]), reserve=-2)
    assert bm.num_free_blocks == 4


def test_allocating_twice_is_an_error():
    bm = BlockManager(num_blocks=4, block_size=2)
    seq = Seq([1, 2, 3])
    bm.allocate(seq)
    with pytest.raises(KVCacheError, match="already holds blocks"):
        bm.allocate(seq)
    assert bm.num_used_blocks == 2


def test_prefix_caching_off_shares_nothing():
    bm = BlockManager(num_blocks=8, block_size=2, enable_prefix_caching=False)
    a, b = Seq([1, 2, 3]), Seq([1, 2, 3])
    prefill(bm, a)
    bm.allocate(b)
    assert b.num_cached_tokens == 0 and set(a.block_table).isdisjoint(b.block_table)
    bm.deallocate(a)
    assert bm.num_cached_free_blocks == 0 and not bm.hash_to_block


def test_can_allocate_counts_hits_on_blocks_in_use():
    bm = BlockManager(num_blocks=4, block_size=2)
    a = Seq([1, 2, 3, 4, 5])
    prefill(bm, a)  # three blocks, one free
    b = Seq([1, 2, 3, 4, 6])
    # b needs three blocks: two are shared with a, so one free block suffices.
    assert bm.can_allocate(b) and not bm.can_allocate(b, reserve=1)
    bm.allocate(b)
    assert b.num_cached_tokens == 4 and bm.num_free_blocks == 0


def test_hits_on_free_cached_blocks_take_them_from_the_pool():
    bm = BlockManager(num_blocks=3, block_size=2)
    a = Seq([1, 2, 3, 4, 5])
    prefill(bm, a)
    bm.deallocate(a)
    b = Seq([1, 2, 3, 4, 5, 6, 7])  # four blocks: more than the pool, hits or not
    assert not bm.can_allocate(b)
    c = Seq([1, 2, 3, 4, 5])
    assert bm.can_allocate(c)
    bm.allocate(c)
    assert bm.num_free_blocks == 0 and bm.num_cached_free_blocks == 0


def test_duplicate_contents_computed_twice_keep_one_key():
    bm = BlockManager(num_blocks=8, block_size=2)
    a, b = Seq([1, 2, 3]), Seq([1, 2, 3])
    bm.allocate(a)
    bm.allocate(b)  # admitted together: neither is committed yet, no hit
    bm.commit(a, 3)
    bm.commit(b, 3)
    assert bm.hash_to_block[bm.blocks[a.block_table[0]].hash] == a.block_table[0]
    bm.deallocate(b)  # b's duplicate block holds no key: it is simply free
    assert bm.num_cached_free_blocks == 0
    bm.deallocate(a)
    assert bm.num_cached_free_blocks == 1
