"""Random allocate / prefill / decode / free under eviction pressure, checked against a model of
the physical pool: every slot records which token prefix its KV was computed for."""

from __future__ import annotations

from collections import Counter

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from nano_kvcache import BlockManager, OutOfBlocksError, SequenceTooLongError


class Seq:
    def __init__(self, token_ids: list[int]) -> None:
        self.token_ids = list(token_ids)
        self.block_table: list[int] = []
        self.num_cached_tokens = 0
        self.num_computed = 0  # tokens whose KV this sequence has written or found cached


class BlockPool(RuleBasedStateMachine):
    @initialize(
        num_blocks=st.integers(4, 12),
        block_size=st.integers(1, 4),
        caching=st.booleans(),
    )
    def setup(self, num_blocks: int, block_size: int, caching: bool) -> None:
        self.bm = BlockManager(num_blocks, block_size, enable_prefix_caching=caching)
        self.bs = block_size
        # slots[block][row]: the token prefix (tuple) whose last token's KV the slot holds.
        self.slots: list[list[tuple[int, ...] | None]] = [
            [None] * block_size for _ in range(num_blocks)
        ]
        self.seqs: list[Seq] = []

    def _write(self, seq: Seq, end: int) -> None:
        """Compute KV for positions [seq.num_computed, end), as the model would."""
        for pos in range(seq.num_computed, end):
            block = seq.block_table[pos // self.bs]
            self.slots[block][pos % self.bs] = tuple(seq.token_ids[: pos + 1])
        seq.num_computed = end

    @rule(prompt=st.lists(st.integers(0, 2), min_size=1, max_size=24))
    def add(self, prompt: list[int]) -> None:
        seq = Seq(prompt)
        before = self.bm.stats()
        if self.bm.can_allocate(seq):
            self.bm.allocate(seq)
            assert seq.num_cached_tokens % self.bs == 0
            assert seq.num_cached_tokens < len(prompt)
            seq.num_computed = seq.num_cached_tokens
            self.seqs.append(seq)
        else:
            try:
                self.bm.allocate(seq)
            except (OutOfBlocksError, SequenceTooLongError):
                pass
            else:
                raise AssertionError("allocate succeeded where can_allocate said no")
            assert seq.block_table == [] and self.bm.stats() == before

    @precondition(lambda self: any(s.num_computed < len(s.token_ids) for s in self.seqs))
    @rule(data=st.data())
    def prefill_chunk(self, data: st.DataObject) -> None:
        pending = [s for s in self.seqs if s.num_computed < len(s.token_ids)]
        seq = data.draw(st.sampled_from(pending))
        end = data.draw(st.integers(seq.num_computed + 1, len(seq.token_ids)))
        self.bm.commit(seq, end)  # scheduled this step ...
        self._write(seq, end)  # ... and written before anything reads it

    @precondition(lambda self: any(s.num_computed == len(s.token_ids) for s in self.seqs))
    @rule(data=st.data(), token=st.integers(0, 2))
    def decode(self, data: st.DataObject, token: int) -> None:
        done = [s for s in self.seqs if s.num_computed == len(s.token_ids)]
        seq = data.draw(st.sampled_from(done))
        seq.token_ids.append(token)
        if self.bm.can_append(seq):
            self.bm.may_append(seq)
            self._write(seq, len(seq.token_ids))
        else:
            table = list(seq.block_table)
            try:
                self.bm.may_append(seq)
            except OutOfBlocksError:
                pass
            else:
                raise AssertionError("may_append succeeded where can_append said no")
            assert seq.block_table == table
            seq.token_ids.pop()

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        seq = self.seqs.pop(data.draw(st.integers(0, len(self.seqs) - 1)))
        self.bm.deallocate(seq)
        assert seq.block_table == []

    @invariant()
    def pool_is_consistent(self) -> None:
        bm = self.bm
        assert bm.num_free_blocks + bm.num_used_blocks == bm.num_blocks
        holders = Counter(b for s in self.seqs for b in s.block_table)
        for block in bm.blocks:
            assert block.ref_count == holders[block.block_id]
        assert bm.num_used_blocks == len(holders)

    @invariant()
    def every_sequence_reads_its_own_kv(self) -> None:
        for seq in self.seqs:
            assert len(seq.block_table) == -(-len(seq.token_ids) // self.bs)
            for pos in range(seq.num_computed):
                block = seq.block_table[pos // self.bs]
                assert self.slots[block][pos % self.bs] == tuple(seq.token_ids[: pos + 1])

    @invariant()
    def cached_hashes_match_their_contents(self) -> None:
        for h, block_id in self.bm.hash_to_block.items():
            block = self.bm.blocks[block_id]
            assert block.hash == h
            prefixes = self.slots[block_id]
            assert all(p is not None for p in prefixes)
            assert [p[-1] for p in prefixes] == block.token_ids
            full = prefixes[-1]
            chain = -1
            for start in range(0, len(full), self.bs):
                chain = BlockManager.compute_hash(list(full[start : start + self.bs]), chain)
            assert chain == h

    @invariant()
    def only_full_prefix_blocks_are_shared(self) -> None:
        where: dict[int, set[int]] = {}
        for seq in self.seqs:
            for i, block_id in enumerate(seq.block_table):
                where.setdefault(block_id, set()).add(i)
        for block_id, indices in where.items():
            if self.bm.blocks[block_id].ref_count > 1:
                assert len(indices) == 1
                assert self.bm.hash_to_block.get(self.bm.blocks[block_id].hash) == block_id

    def teardown(self) -> None:
        if not hasattr(self, "bm"):
            return
        for seq in self.seqs:
            self.bm.deallocate(seq)
        assert self.bm.num_free_blocks == self.bm.num_blocks
        assert all(block.ref_count == 0 for block in self.bm.blocks)


BlockPool.TestCase.settings = settings(max_examples=300, stateful_step_count=60, deadline=None)
TestBlockPool = BlockPool.TestCase
