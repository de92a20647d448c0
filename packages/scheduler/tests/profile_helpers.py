"""Profiles built from a known cost function (an engine whose every time is given by formula),
on the grid ``nano-engine profile`` measures: what the calibrated model is checked against."""

from __future__ import annotations

import random
from bisect import bisect_left

from nano_scheduler import cuda_graph_sizes, piecewise_graph_sizes
from nano_scheduler.sim.grid import Grid
from nano_scheduler.sim.profile import EngineSettings, GridPoint, Profile, StepRecord

MODEL = {
    "num_hidden_layers": 28,
    "hidden_size": 1024,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "intermediate_size": 3072,
    "vocab_size": 151936,
}
MAX_SEQS, BUDGET, MAX_LEN, BLOCKS = 64, 8192, 16384, 60_000


def eager_seconds(prefills, num_decodes: int, decode_context: int, sizes=()) -> float:
    """A roofline-like eager forward: matmuls bound by the weights' read up to a token count,
    then by compute (over the tokens padded to the smallest of ``sizes`` that holds them, as
    piecewise CUDA graphs do); attention whose efficiency per (query, key) pair grows with the
    chunk's length; the keys each chunk and decode reads; a launch cost per sequence."""
    tokens = sum(n for n, _ in prefills) + num_decodes
    if sizes and tokens <= sizes[-1]:
        tokens = sizes[bisect_left(sizes, tokens)]
    seconds = max(4096e-7, tokens * 1e-7) + 1.5e-4  # (the kink at a profiled count)
    for n, cached in prefills:
        pairs = n * cached + n * (n + 1) / 2
        seconds += pairs * 4e-13 * (1 + 256 / n) + (cached + n) * 2e-9 + 4e-6
    return seconds + decode_context * 3e-9 + num_decodes * 1e-6


def graph_seconds(size: int, context: int) -> float:
    """A CUDA-graph decode of ``size`` rows (padding included) over ``context`` tokens."""
    return 2.5e-4 + size * 1.5e-6 + context * 2.6e-9


def sample_seconds(rows: int) -> float:
    return 2e-5 + rows * 4e-7


def host_sample(rows: int, eager: bool) -> float:
    """The sampler's host work: its whole launch after an eager step, little after a decode
    graph that drew the tokens itself."""
    return 3e-4 + 1e-6 * rows if eager else 2e-5 + 1e-7 * rows


def host_record(rng: random.Random, t: float) -> StepRecord:
    """A loop iteration with host phases linear in its batch."""
    decodes = rng.randint(0, MAX_SEQS)
    chunks = rng.randint(0 if decodes else 1, 3)
    prefills = [[rng.randint(16, 2048), rng.choice((0, 512))] for _ in range(chunks)]
    context = decodes * rng.randint(100, 2000)
    r = StepRecord(t=t, prefills=prefills, decodes=[decodes, context, context // max(decodes, 1)])
    r.sampled = decodes + chunks
    r.running, r.eager = decodes + chunks, bool(chunks)
    r.resolved = r.outputs = r.sampled
    r.schedule = 2e-5 + 1e-6 * decodes + 5e-6 * chunks
    r.launch = (3e-3 if chunks else 4e-4) + 2e-7 * (decodes + chunks)
    r.post, r.sample, r.publish = 1e-5 + 2e-6 * r.resolved, host_sample(r.sampled, r.eager), 1e-5
    if r.eager:
        r.forward = eager_seconds(prefills, decodes, context)
    else:  # (in the CUDA graph that holds the batch)
        r.forward = graph_seconds(
            next(s for s in cuda_graph_sizes(MAX_SEQS) if s >= decodes), context
        )
    r.sample_device = sample_seconds(r.sampled)
    return r


def synthetic_profile(block_size: int = 16, piecewise: bool = False) -> Profile:
    sizes = cuda_graph_sizes(MAX_SEQS)
    pieces = piecewise_graph_sizes(BUDGET) if piecewise else ()
    grid = Grid(MAX_SEQS, BUDGET, MAX_LEN, BLOCKS * block_size, sizes)
    decode = [GridPoint((), b, c, graph_seconds(b, b * c)) for b, c in grid.decode_graphs()]
    eager = [
        GridPoint(tuple(ch), n, ctx, eager_seconds(ch, n, n * ctx, pieces))
        for ch, n, ctx in grid.eager()
        if ch
    ]
    rows = grid.sampling_rows()
    rng = random.Random(0)
    host, t = [], 0.0
    for _ in range(400):  # (each iteration starts as the one before ends)
        host.append(host_record(rng, t))
        t += host[-1].host
    engine = EngineSettings(
        block_size=block_size,
        num_kv_blocks=BLOCKS,
        max_num_seqs=MAX_SEQS,
        max_num_batched_tokens=BUDGET,
        max_model_len=MAX_LEN,
        enable_prefix_caching=True,
        enable_chunked_prefill=True,
        policy="decode_first",
        admission_lookahead=16,
        watermark=0.01,
        async_scheduling=True,
        cuda_graph_sizes=tuple(sizes),
        piecewise_graphs=piecewise,
    )
    return Profile(
        model=dict(MODEL),
        device={"type": "cuda", "name": "a formula", "synchronous": False},
        engine=engine,
        decode_graphs=decode,
        eager=eager,
        sampling={"greedy": [(r, sample_seconds(r)) for r in rows]},
        host={"offline": host},
        server={},
        meta={"model_name": "synthetic"},
    )
