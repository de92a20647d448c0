"""Continuous batching: chunked prefill, prefix-cache-aware admission, preemption by recompute.

Each step, ``schedule()`` picks the sequences that run and how many tokens each computes; the
model runs them; ``update()`` appends the sampled tokens and finishes sequences. The scheduler
owns the sequences' blocks through a ``BlockManager`` and never touches tensors.

Async scheduling splits ``update()`` in two: ``advance()`` right after a step is launched (each
sampling sequence gets a placeholder token, so the next step can be scheduled while this one
runs), then ``resolve()`` with the sampled tokens.
"""

from __future__ import annotations

import operator
import time
from array import array
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import NamedTuple

from nano_kvcache import BlockManager
from nano_scheduler.config import SchedulerConfig
from nano_scheduler.sequence import FinishReason, Sequence, SequenceStatus

_RUNNING = SequenceStatus.RUNNING
# The last token of a sequence whose step is in flight (async scheduling): a model input that
# the runner takes from that step's sampled tokens on the device.
PENDING_TOKEN = -1


class ScheduledChunk(NamedTuple):
    """A prefill chunk: tokens ``[start, start + num_tokens)`` of ``seq`` are computed."""

    seq: Sequence
    start: int  # tokens whose KV is already cached (prefix hits and earlier chunks)
    num_tokens: int  # tokens computed this step
    samples: bool  # the chunk ends at the sequence's last token: a token is sampled after it


@dataclass
class SchedulerOutput:
    """One step's work. The runner lays out prefill chunks first, then decodes; the sampled
    tokens come back to ``update`` in ``sampling_seqs`` order."""

    prefills: list[ScheduledChunk] = field(default_factory=list)
    decodes: list[Sequence] = field(default_factory=list)  # one token each, the last; all sample
    preempted: list[Sequence] = field(default_factory=list)
    finished: list[Sequence] = field(default_factory=list)  # while scheduling: no room to go on
    num_batched_tokens: int = 0

    @property
    def scheduled(self) -> list[ScheduledChunk]:
        """Every scheduled sequence as a chunk (a decode is a one-token chunk that samples)."""
        decodes = [ScheduledChunk(s, s.num_tokens - 1, 1, True) for s in self.decodes]
        return self.prefills + decodes

    @property
    def sampling_seqs(self) -> list[Sequence]:
        return [c.seq for c in self.prefills if c.samples] + self.decodes

    @property
    def num_seqs(self) -> int:
        return len(self.prefills) + len(self.decodes)

    @property
    def is_empty(self) -> bool:
        return not self.prefills and not self.decodes


class PendingStep(NamedTuple):
    """A step whose sampled tokens are not known yet (``Scheduler.advance``)."""

    output: SchedulerOutput
    slots: list[tuple[int, Sequence, int]]  # (row of the sampled tokens, seq, index in token_ids)
    finished: list[Sequence]  # while scheduling, and by length when advanced


class SchedulerStats(NamedTuple):
    num_running: int
    num_waiting: int
    num_preemptions: int
    kv_usage: float
    free_blocks: int
    prefix_hit_rate: float


class Scheduler:
    """Decides every step which sequences run and how many tokens each contributes.

    ``add`` rejects with ``ValueError`` a sequence that could never run (an empty prompt, token
    ids that are not integers >= 0, prompt + 1 token over ``max_model_len``, or more blocks than
    the whole pool). A running sequence that needs a block when none is free preempts the newest
    running sequence (its blocks are freed and it goes back to the front of the waiting queue, to
    be recomputed, mostly from the prefix cache). A sequence that could never be admitted again
    (alone in a pool too small for its next token, or longer than the pool after sharing blocks
    through the prefix cache) finishes with reason ``length`` instead.
    """

    def __init__(
        self,
        config: SchedulerConfig,
        block_manager: BlockManager,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.block_manager = block_manager
        self.clock = clock
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._unfinished: dict[int, Sequence] = {}
        self._watermark_blocks = int(config.watermark * block_manager.num_blocks)
        self.num_preemptions = 0

    # ---- requests ----------------------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence; ``ValueError`` if it could never run."""
        cfg, bm = self.config, self.block_manager
        if seq.status is not SequenceStatus.WAITING or seq.num_computed_tokens:
            raise ValueError(f"sequence {seq.seq_id} is {seq.status.value}, not a new request")
        if seq.seq_id in self._unfinished:
            raise ValueError(f"a sequence with id {seq.seq_id} is already scheduled")
        prompt = seq.num_prompt_tokens
        if prompt == 0:
            raise ValueError("the prompt is empty")
        try:  # C-speed check that every id is an int >= 0 (the block hashes need ints)
            lowest = min(array("q", seq.token_ids))
        except (TypeError, OverflowError):
            lowest = -1
        if lowest < 0:
            bad = next(t for t in seq.token_ids if not _is_token_id(t))
            raise ValueError(f"token ids must be integers >= 0, the prompt has {bad!r}")
        if prompt + 1 > cfg.max_model_len:
            raise ValueError(
                f"the prompt ({prompt} tokens) is too long: with one generated token it exceeds "
                f"the maximum model length of {cfg.max_model_len} tokens"
            )
        if bm.num_blocks_for(prompt + 1) > bm.num_blocks:
            raise ValueError(
                f"the prompt ({prompt} tokens) needs {bm.num_blocks_for(prompt + 1)} KV blocks of "
                f"{bm.block_size} tokens, more than the whole pool of {bm.num_blocks} blocks"
            )
        params = seq.params
        max_tokens = params.max_tokens if params.max_tokens is not None else cfg.max_model_len
        seq.max_num_tokens = min(prompt + max_tokens, cfg.max_model_len)
        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids |= cfg.eos_token_ids
        seq.stop_token_ids = frozenset(stop_ids)
        self._unfinished[seq.seq_id] = seq
        self.waiting.append(seq)

    def abort(self, seq_id: int) -> Sequence | None:
        """Finish a sequence in any state with reason ``abort`` and free its blocks. Returns it,
        or None if no unfinished sequence has this id (it may have finished already)."""
        return self.finish(seq_id, FinishReason.ABORT)

    def finish(self, seq_id: int, reason: FinishReason) -> Sequence | None:
        """Finish a sequence for a reason found outside the scheduler (a stop string, an abort)."""
        seq = self._unfinished.get(seq_id)
        if seq is None:
            return None
        if seq.status is _RUNNING:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        self._finish(seq, reason)
        return seq

    def _finish(self, seq: Sequence, reason: FinishReason, now: float | None = None) -> None:
        if seq.block_table:
            self.block_manager.deallocate(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.finish_time = self.clock() if now is None else now
        del self._unfinished[seq.seq_id]

    def has_unfinished(self) -> bool:
        return bool(self._unfinished)

    def get(self, seq_id: int) -> Sequence | None:
        return self._unfinished.get(seq_id)

    def stats(self) -> SchedulerStats:
        bm = self.block_manager.stats()
        return SchedulerStats(
            len(self.running),
            len(self.waiting),
            self.num_preemptions,
            bm.usage,
            bm.free_blocks,
            bm.hit_rate,
        )

    # ---- scheduling --------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Pick this step's work: never empty while a sequence is unfinished."""
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        if self.config.policy == "prefill_first":
            partial = [s for s in self.running if len(s.token_ids) - s.num_computed_tokens > 1]
            budget = self._schedule_prefills(out, budget, partial)
            if out.is_empty:
                budget = self._schedule_decodes(out, budget, [])
        else:
            partial: list[Sequence] = []
            budget = self._schedule_decodes(out, budget, partial)
            budget = self._schedule_prefills(out, budget, partial)
        out.num_batched_tokens = self.config.max_num_batched_tokens - budget
        return out

    def _schedule_decodes(self, out: SchedulerOutput, budget: int, partial: list[Sequence]) -> int:
        """Running sequences with one token left, oldest first, growing blocks as they need.
        The running sequences with more tokens left (partial prefills) go to ``partial``."""
        can_append, may_append = self.block_manager.can_append, self.block_manager.may_append
        decodes = out.decodes
        for seq in list(self.running):
            if not budget:
                break
            if seq.status is not _RUNNING:
                continue  # a victim of _make_room (preempted or finished) this step
            if len(seq.token_ids) - seq.num_computed_tokens != 1:
                partial.append(seq)
                continue
            if not can_append(seq) and not self._make_room(seq, out):
                break  # seq left the running list, and every sequence after it did too
            may_append(seq)
            decodes.append(seq)
            budget -= 1
        return budget

    def _make_room(self, seq: Sequence, out: SchedulerOutput) -> bool:
        """Preempt the newest running sequences until seq can append, finishing with length
        those that could never be admitted again; False if seq itself had to go."""
        bm, running = self.block_manager, self.running
        while not bm.can_append(seq):
            victim = running.pop()
            if not running or bm.num_blocks_for(len(victim.token_ids)) > bm.num_blocks:
                # It could never be admitted again (its blocks alone exceed the pool, or it was
                # alone and still did not fit): it ends here with what it has.
                self._finish(victim, FinishReason.LENGTH)
                out.finished.append(victim)
            else:
                self._preempt(victim, out)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.block_manager.deallocate(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
        out.preempted.append(seq)

    def _schedule_prefills(self, out: SchedulerOutput, budget: int, partial: list[Sequence]) -> int:
        """Continue the partial prefills of running sequences (``partial``, oldest first), then
        admit waiting ones (FCFS, with a bounded lookahead past a head that does not fit)."""
        chunked = self.config.enable_chunked_prefill
        for seq in partial:
            if not budget:
                return budget
            if seq.status is not _RUNNING:
                continue  # preempted by a decode this step
            remaining = len(seq.token_ids) - seq.num_computed_tokens
            if chunked or remaining <= budget:
                budget = self._add_chunk(seq, min(remaining, budget), out, budget)
        bm, cfg, waiting = self.block_manager, self.config, self.waiting
        i = skipped = 0
        while i < len(waiting) and budget and len(self.running) < cfg.max_num_seqs:
            seq = waiting[i]
            if not chunked and len(seq.token_ids) > budget:
                break
            reserve = self._watermark_blocks if self.running else 0
            if not bm.can_allocate(seq, reserve):
                skipped += 1
                if skipped > cfg.admission_lookahead:
                    break
                i += 1
                continue
            del waiting[i]
            bm.allocate(seq)
            seq.num_computed_tokens = seq.num_cached_tokens
            seq.status = _RUNNING
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = self.clock()
                seq.num_prefix_cached_tokens = seq.num_cached_tokens
            self.running.append(seq)
            remaining = len(seq.token_ids) - seq.num_computed_tokens
            budget = self._add_chunk(seq, min(remaining, budget), out, budget)
        return budget

    def _add_chunk(self, seq: Sequence, n: int, out: SchedulerOutput, budget: int) -> int:
        start = seq.num_computed_tokens
        # The chunk's KV is written this step, before any later step reads it: share its blocks.
        self.block_manager.commit(seq, start + n)
        out.prefills.append(ScheduledChunk(seq, start, n, start + n == len(seq.token_ids)))
        return budget - n

    # ---- results -----------------------------------------------------------------------------

    def update(self, output: SchedulerOutput, sampled_token_ids: Iterable[int]) -> list[Sequence]:
        """Record a step: advance computed tokens, append the sampled tokens (one per sequence of
        ``output.sampling_seqs``, in that order) and finish sequences that hit a stop condition.
        Sequences aborted since ``schedule`` are skipped. Returns the sequences this step
        finished, those finished while scheduling included."""
        return self.resolve(self.advance(output), sampled_token_ids)

    def advance(self, output: SchedulerOutput) -> PendingStep:
        """Record a step whose sampled tokens are not known yet (async scheduling): computed
        tokens advance, each sampling sequence gets a ``PENDING_TOKEN`` as its last token, and
        those that reach their length limit finish. The next ``schedule()`` may run before
        ``resolve`` fills the placeholders in."""
        pending = PendingStep(output, [], list(output.finished))
        row = 0
        for seq, start, n, samples in output.prefills:
            if seq.status is _RUNNING:
                seq.num_computed_tokens = start + n
                if samples:
                    self._place(seq, row, pending)
            row += samples
        for seq in output.decodes:
            if seq.status is _RUNNING:
                seq.num_computed_tokens = len(seq.token_ids)
                self._place(seq, row, pending)
            row += 1
        if len(pending.finished) > len(output.finished):
            gone = {id(seq) for seq in pending.finished}
            self.running = [seq for seq in self.running if id(seq) not in gone]
        return pending

    def _place(self, seq: Sequence, row: int, pending: PendingStep) -> None:
        seq.token_ids.append(PENDING_TOKEN)
        pending.slots.append((row, seq, len(seq.token_ids) - 1))
        if len(seq.token_ids) >= seq.max_num_tokens:
            self._finish(seq, FinishReason.LENGTH)
            pending.finished.append(seq)

    def resolve(
        self,
        pending: PendingStep,
        sampled_token_ids: Iterable[int],
        next_output: SchedulerOutput | None = None,
    ) -> list[Sequence]:
        """Put an advanced step's sampled tokens (one per sequence of its ``sampling_seqs``, in
        that order) in place of its placeholders and finish the sequences that hit a stop token.
        ``next_output``, the step scheduled since (whose inputs the placeholders were), lets the
        blocks these tokens filled join the prefix cache. Returns the sequences the step
        finished, those finished while scheduling it included."""
        output = pending.output
        tokens = list(sampled_token_ids)
        expected = sum(c.samples for c in output.prefills) + len(output.decodes)
        if len(tokens) != expected:
            raise ValueError(f"expected {expected} sampled tokens, got {len(tokens)}")
        finished = pending.finished
        now = self.clock()
        block_size = self.block_manager.block_size
        scheduled: dict[int, int] | None = None
        for row, seq, index in pending.slots:
            token = tokens[row]
            seq.token_ids[index] = token
            if seq.first_token_time is None:
                seq.first_token_time = now
            if token in seq.stop_token_ids and (
                index + 1 - seq.num_prompt_tokens >= seq.params.min_tokens
            ):
                if seq.seq_id in self._unfinished:
                    self.finish(seq.seq_id, FinishReason.STOP)
                    finished.append(seq)
                elif seq.finish_reason is FinishReason.LENGTH and any(s is seq for s in finished):
                    seq.finish_reason = FinishReason.STOP  # its last token was a stop token
            elif next_output is not None and (index + 1) % block_size == 0 and seq.block_table:
                # The block this token fills was left out of the prefix cache while the token was
                # unknown: share it now if the next step writes its KV.
                if scheduled is None:
                    scheduled = _scheduled_ends(next_output)
                end = scheduled.get(id(seq), 0)
                if end > index:
                    self.block_manager.commit(seq, end)
        return finished


def _is_token_id(t: object) -> bool:
    try:
        return 0 <= operator.index(t) < 2**63
    except TypeError:
        return False


def _scheduled_ends(output: SchedulerOutput) -> dict[int, int]:
    """id(seq) -> the number of its tokens whose KV is written by the end of this step."""
    ends = {id(seq): len(seq.token_ids) for seq in output.decodes}
    for seq, start, n, _ in output.prefills:
        ends[id(seq)] = start + n
    return ends
