"""Paged KV block manager with hash-based prefix caching.

The pool holds ``num_blocks`` physical blocks of ``block_size`` token slots each. A sequence owns a
block table: the i-th entry is the physical block that holds its tokens ``[i*bs, (i+1)*bs)``.

Prefix caching: once a full block's KV is scheduled to be written (``commit``), the block is keyed
by a chained hash of (parent block hash, its token ids) and other sequences with the same prefix
share it. Freed blocks keep their contents and key, and serve later prompts until they are
evicted, least recently freed first. Blocks are reference counted.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import MutableSequence
from typing import NamedTuple, Protocol

import xxhash

from nano_kvcache.errors import (
    KVCacheError,
    OutOfBlocksError,
    SequenceTooLongError,
    UnknownSequenceError,
)

_NO_HASH = -1
_MASK = (1 << 128) - 1


def _int64_bytes(token_ids) -> bytes:
    """Token ids as int64 bytes: at once from an int64 array (a scheduler's sequence holds
    one), converted from anything else."""
    if isinstance(token_ids, array) and token_ids.typecode == "q":
        return token_ids.tobytes()
    return array("q", token_ids).tobytes()


class KVSequence(Protocol):
    """What the block manager needs from a sequence (a scheduler's or a simulator's request)."""

    token_ids: MutableSequence[int]  # (a list, or an int64 array as the scheduler's are)
    block_table: list[int]
    num_cached_tokens: int


class BlockManagerStats(NamedTuple):
    num_blocks: int
    free_blocks: int
    used_blocks: int
    cached_free_blocks: int
    hit_tokens: int
    miss_tokens: int
    evictions: int
    usage: float

    @property
    def hit_rate(self) -> float:
        queried = self.hit_tokens + self.miss_tokens
        return self.hit_tokens / queried if queried else 0.0


class Block:
    """One physical block. A registered (full, hashed) block keeps its token ids as the bytes
    of an int64 array (``contents``; ``token_ids`` reads them back): a hash hit compares them
    before sharing the block, and bytes, unlike a list of ints, are not walked by Python's
    cyclic garbage collector (a prefix cache of 70k blocks as lists cost every full
    collection a million references)."""

    __slots__ = ("block_id", "contents", "hash", "parent_hash", "ref_count")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.reset()

    def reset(self) -> None:
        self.hash = _NO_HASH
        self.parent_hash = _NO_HASH
        self.contents: bytes | None = None

    @property
    def token_ids(self) -> list[int] | None:
        return None if self.contents is None else array("q", self.contents).tolist()


class BlockManager:
    """Allocates KV blocks to sequences and shares full prefix blocks between them.

    Raises ``ValueError`` for bad arguments, ``SequenceTooLongError`` for a sequence that needs
    more blocks than the whole pool, ``OutOfBlocksError`` when the free blocks do not suffice now
    (nothing is changed; check ``can_allocate`` / ``can_append`` first), and
    ``UnknownSequenceError`` for a sequence that holds no blocks of this manager.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        for name, value in (("num_blocks", num_blocks), ("block_size", block_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = bool(enable_prefix_caching)
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.hash_to_block: dict[int, int] = {}
        # Free blocks without reusable contents; taken first.
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        # Free blocks whose contents are registered, least recently freed first (evicted first).
        self._cached_free: OrderedDict[int, None] = OrderedDict()
        self._owners: dict[int, KVSequence] = {}
        self.hit_tokens = 0
        self.miss_tokens = 0
        self.evictions = 0

    # ---- bookkeeping -------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return len(self._free) + len(self._cached_free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_free_blocks(self) -> int:
        return len(self._cached_free)

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    def stats(self) -> BlockManagerStats:
        return BlockManagerStats(
            self.num_blocks,
            self.num_free_blocks,
            self.num_used_blocks,
            self.num_cached_free_blocks,
            self.hit_tokens,
            self.miss_tokens,
            self.evictions,
            self.usage,
        )

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- hashing -----------------------------------------------------------------------------

    @staticmethod
    def hash_contents(contents: bytes, prefix_hash: int = _NO_HASH) -> int:
        """128-bit xxh3 of the parent block's hash (-1 for the first block) and the block's
        token ids as int64 bytes."""
        return xxhash.xxh3_128_intdigest((prefix_hash & _MASK).to_bytes(16, "little") + contents)

    @classmethod
    def compute_hash(cls, token_ids: list[int], prefix_hash: int = _NO_HASH) -> int:
        """A block's hash from its token ids."""
        return cls.hash_contents(_int64_bytes(token_ids), prefix_hash)

    def _cached_prefix(self, seq: KVSequence) -> list[Block]:
        """The longest run of registered full blocks matching seq's prefix (last token excluded);
        none for a sequence whose ``reads_prefix_cache`` is false."""
        if not self.enable_prefix_caching or not getattr(seq, "reads_prefix_cache", True):
            return []
        token_ids, bs, blocks = seq.token_ids, self.block_size, self.blocks
        hits: list[Block] = []
        h = _NO_HASH
        for start in range(0, (len(token_ids) - 1) // bs * bs, bs):
            contents = _int64_bytes(token_ids[start : start + bs])
            parent, h = h, self.hash_contents(contents, h)
            block_id = self.hash_to_block.get(h)
            if block_id is None:
                break
            block = blocks[block_id]
            if block.contents != contents or block.parent_hash != parent:
                break  # a hash collision: never share KV computed for other tokens
            hits.append(block)
        return hits

    # ---- allocation --------------------------------------------------------------------------

    def _check_fits_pool(self, seq: KVSequence) -> int:
        needed = self.num_blocks_for(len(seq.token_ids))
        if needed > self.num_blocks:
            raise SequenceTooLongError(
                f"a sequence of {len(seq.token_ids)} tokens needs {needed} blocks of "
                f"{self.block_size} tokens, more than the whole pool of {self.num_blocks} blocks"
            )
        return needed

    def _blocks_to_take(self, needed: int, hits: list[Block]) -> int:
        # A hit on a free cached block still takes it out of the free pool.
        return needed - sum(1 for block in hits if block.ref_count > 0)

    def can_allocate(self, seq: KVSequence, reserve: int = 0) -> bool:
        """Whether ``allocate(seq)`` would succeed now and leave at least ``reserve`` blocks free
        (prefix-cache hits counted)."""
        if reserve < 0:
            raise ValueError(f"reserve must be >= 0, got {reserve}")
        needed = self.num_blocks_for(len(seq.token_ids))
        if needed > self.num_blocks:
            return False
        take = self._blocks_to_take(needed, self._cached_prefix(seq))
        return take + reserve <= self.num_free_blocks

    def allocate(self, seq: KVSequence) -> None:
        """Give seq blocks for all its tokens, reusing the longest cached run of prefix blocks.

        Sets ``seq.num_cached_tokens`` to the number of tokens whose KV is already in the cache.
        New full blocks become shareable only once ``commit`` declares their KV written.
        """
        if id(seq) in self._owners or seq.block_table:
            raise KVCacheError("the sequence already holds blocks; deallocate it first")
        if not seq.token_ids:
            raise KVCacheError("the sequence has no tokens")
        needed = self._check_fits_pool(seq)
        hits = self._cached_prefix(seq)
        take = self._blocks_to_take(needed, hits)
        if take > self.num_free_blocks:
            raise OutOfBlocksError(
                f"the sequence needs {take} free blocks, {self.num_free_blocks} are free"
            )
        for block in hits:
            if block.ref_count == 0:
                del self._cached_free[block.block_id]
            block.ref_count += 1
        table = seq.block_table
        table.extend(block.block_id for block in hits)
        for _ in range(needed - len(hits)):
            table.append(self._take_free_block())
        self._owners[id(seq)] = seq
        cached = len(hits) * self.block_size
        seq.num_cached_tokens = cached
        self.hit_tokens += cached
        self.miss_tokens += len(seq.token_ids) - cached

    def _take_free_block(self) -> int:
        if self._free:
            block_id = self._free.pop()
        elif self._cached_free:
            block_id, _ = self._cached_free.popitem(last=False)
            block = self.blocks[block_id]
            del self.hash_to_block[block.hash]
            block.reset()
            self.evictions += 1
        else:
            raise OutOfBlocksError("no free KV block left")
        self.blocks[block_id].ref_count = 1
        return block_id

    def deallocate(self, seq: KVSequence) -> None:
        """Release seq's blocks; registered ones stay cached until evicted."""
        if self._owners.pop(id(seq), None) is None:
            raise UnknownSequenceError("the sequence holds no blocks of this block manager")
        blocks = self.blocks
        # Last blocks first, so a sequence's tail is evicted before its head.
        for block_id in reversed(seq.block_table):
            block = blocks[block_id]
            block.ref_count -= 1
            if block.ref_count:
                continue
            if block.hash != _NO_HASH and self.hash_to_block.get(block.hash) == block_id:
                self._cached_free[block_id] = None
            else:
                block.reset()
                self._free.append(block_id)
        seq.block_table.clear()
        seq.num_cached_tokens = 0

    def reset_prefix_cache(self) -> int:
        """Forget the contents of every free block, as vLLM's ``reset_prefix_cache``: later
        requests recompute what they would have found cached (benchmark runs that repeat the
        same prompts, say). Blocks in use keep their keys: their sequences still hold them.
        Returns the number of blocks forgotten."""
        forgotten = len(self._cached_free)
        for block_id in self._cached_free:
            block = self.blocks[block_id]
            del self.hash_to_block[block.hash]
            block.reset()
            self._free.append(block_id)
        self._cached_free.clear()
        return forgotten

    # ---- decoding ----------------------------------------------------------------------------

    def can_append(self, seq: KVSequence) -> bool:
        """Whether ``may_append(seq)`` would find the blocks it needs."""
        table_tokens = len(seq.block_table) * self.block_size
        num_tokens = len(seq.token_ids)
        if table_tokens >= num_tokens:
            return True
        return num_tokens - table_tokens <= self.num_free_blocks * self.block_size

    def may_append(self, seq: KVSequence) -> None:
        """Called after tokens were appended to seq: add blocks up to its length and, when the
        length ends a block, commit the blocks these tokens filled (after several tokens that
        end inside a block, ``commit`` declares the full ones)."""
        num_tokens = len(seq.token_ids)
        table = seq.block_table
        bs = self.block_size
        if len(table) * bs < num_tokens:
            self._grow(seq, num_tokens)
        if num_tokens % bs == 0 and self.enable_prefix_caching:  # (per decode: cheap tests first)
            if id(seq) not in self._owners:
                raise UnknownSequenceError("may_append on a sequence that was never allocated")
            index = num_tokens // bs - 1
            if index == 0 or self.blocks[table[index - 1]].hash != _NO_HASH:
                self._register(seq, index)  # the usual decode case: one block just filled
            else:
                self.commit(seq, num_tokens)

    def _grow(self, seq: KVSequence, num_tokens: int) -> None:
        if id(seq) not in self._owners:
            raise UnknownSequenceError("may_append on a sequence that was never allocated")
        missing = -(-num_tokens // self.block_size) - len(seq.block_table)
        if missing > self.num_free_blocks:
            raise OutOfBlocksError(
                f"the sequence needs {missing} more blocks, {self.num_free_blocks} are free"
            )
        for _ in range(missing):
            seq.block_table.append(self._take_free_block())

    def commit(self, seq: KVSequence, num_tokens: int) -> None:
        """Declare the KV of seq's first ``num_tokens`` tokens written (or being written by the step
        now scheduled), so its full blocks among them can be shared by later sequences."""
        if id(seq) not in self._owners:
            raise UnknownSequenceError("commit on a sequence that holds no blocks of this manager")
        if not self.enable_prefix_caching:
            return
        table, blocks, bs = seq.block_table, self.blocks, self.block_size
        num_full = min(num_tokens, len(seq.token_ids), len(table) * bs) // bs
        first = num_full
        while first > 0 and blocks[table[first - 1]].hash == _NO_HASH:
            first -= 1
        for i in range(first, num_full):
            if not self._register(seq, i):
                break

    def _register(self, seq: KVSequence, index: int) -> bool:
        """Key the index-th block of seq by its contents; its parent is registered already.
        A block holding a token not known yet (a negative id: a scheduler's placeholder for a
        token still being sampled) stays out, and False says so; ``commit`` adds it later."""
        table, bs = seq.block_table, self.block_size
        block = self.blocks[table[index]]
        parent = self.blocks[table[index - 1]].hash if index else _NO_HASH
        chunk = seq.token_ids[index * bs : (index + 1) * bs]
        if min(chunk) < 0:
            return False
        block.contents = contents = _int64_bytes(chunk)
        block.parent_hash = parent
        block.hash = h = self.hash_contents(contents, parent)
        # Identical contents computed twice (two same prompts admitted together): keep one key.
        self.hash_to_block.setdefault(h, block.block_id)
        return True
