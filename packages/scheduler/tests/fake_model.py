"""A deterministic stand-in for a model: the next token is a function of the whole history, so
recomputation after preemption must reproduce exactly the same outputs."""

from __future__ import annotations

import zlib

from nano_kvcache import BlockManager
from nano_scheduler import (
    PENDING_TOKEN,
    SamplingParams,
    Scheduler,
    SchedulerConfig,
    SchedulerOutput,
    Sequence,
)

VOCAB = 50


def next_token(token_ids: list[int]) -> int:
    return zlib.crc32(bytes(str(list(token_ids)), "ascii")) % VOCAB


def make(num_blocks: int = 64, block_size: int = 4, clock=None, **config) -> Scheduler:
    kwargs = {"clock": clock} if clock else {}
    sched = Scheduler(SchedulerConfig(**config), BlockManager(num_blocks, block_size), **kwargs)
    sched.fake_kv = {}  # (block, row) -> the token prefix whose last token's KV the slot holds
    return sched


def seq(seq_id: int, prompt, max_tokens: int = 4, **params) -> Sequence:
    return Sequence(seq_id, list(prompt), SamplingParams(max_tokens=max_tokens, **params))


def run_model(sched: Scheduler, out, pending: dict[int, int] | None = None) -> None:
    """Store the KV of every scheduled token, then check that each sequence's whole context is
    in its blocks and was computed for its own tokens (what attention would read). ``pending``:
    the tokens of the step in flight, by seq_id, that stand behind placeholders."""
    kv, bs = sched.fake_kv, sched.block_manager.block_size
    work = [(c.seq, c.start, c.num_tokens) for c in out.prefills]
    work += [(s, s.num_tokens - 1, 1) for s in out.decodes]
    for seq, start, n in work:
        tokens = history(seq, pending)
        for pos in range(start, start + n):
            kv[seq.block_table[pos // bs], pos % bs] = tuple(tokens[: pos + 1])
    for seq, start, n in work:
        tokens = history(seq, pending)
        for pos in range(start + n):
            slot = seq.block_table[pos // bs], pos % bs
            assert kv.get(slot) == tuple(tokens[: pos + 1]), (seq, pos)


def history(seq: Sequence, pending: dict[int, int] | None) -> list[int]:
    """The sequence's tokens as the model sees them: a placeholder is the token behind it."""
    if seq.token_ids and seq.token_ids[-1] == PENDING_TOKEN:
        return [*seq.token_ids[:-1], pending[seq.seq_id]]
    return seq.token_ids


def run_pipelined(sched: Scheduler, max_steps: int = 10_000) -> int:
    """Async scheduling: each step is scheduled and run before the previous step's tokens are
    resolved (``advance`` right after the run, ``resolve`` one step later)."""
    in_flight, steps = None, 0
    while sched.has_unfinished() or in_flight:
        out = sched.schedule() if sched.has_unfinished() else SchedulerOutput()
        tokens_behind = in_flight[2] if in_flight else None
        run_model(sched, out, tokens_behind)
        sampled = [next_token(history(s, tokens_behind)) for s in out.sampling_seqs]
        if in_flight:
            sched.resolve(in_flight[0], in_flight[1], out if not out.is_empty else None)
        in_flight = None
        if not out.is_empty:
            by_seq = {s.seq_id: t for s, t in zip(out.sampling_seqs, sampled)}
            in_flight = (sched.advance(out), sampled, by_seq)
        steps += 1
        assert steps < max_steps, "the scheduler does not make progress"
    return steps


def step(sched: Scheduler, tokens: dict[int, int] | None = None):
    """One step: schedule, 'run' (checking the KV the step relies on), update."""
    out = sched.schedule()
    run_model(sched, out)
    sampled = [(tokens or {}).get(s.seq_id, next_token(s.token_ids)) for s in out.sampling_seqs]
    finished = sched.update(out, sampled)
    return out, finished


def run_to_completion(sched: Scheduler, max_steps: int = 10_000) -> int:
    steps = 0
    while sched.has_unfinished():
        out, _ = step(sched)
        assert not out.is_empty or out.finished, "an empty step while requests are unfinished"
        steps += 1
        assert steps < max_steps, "the scheduler does not make progress"
    return steps
