"""The device's time of steps over a grid of batch shapes: the first part of a profile.

Each shape is a ``StepInput`` run through the engine's own runner (CUDA graphs for decode-only
batches of a captured size, eager otherwise; tensor-parallel workers take part), with the
device kept busy while the host launches it (``torch.cuda._sleep``), so that CUDA events time
the kernels alone: the host's launch is the loop's business, measured on real workloads. On a
synchronous device (the CPU) a call's own time is the device's.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterable

import torch

from nano_engine.model_runner import StepInput
from nano_scheduler import SamplingParams, Sequence
from nano_scheduler.sim.profile import SAMPLING_KINDS, GridPoint

# The sampling each kind stands for (the requests of a simulated workload use one kind).
SAMPLING = {
    "greedy": SamplingParams(temperature=0.0),
    "random": SamplingParams(temperature=0.8),
    "top_p": SamplingParams(temperature=0.8, top_p=0.9, top_k=50),
    "logprobs": SamplingParams(temperature=0.0, logprobs=5),
    "penalties": SamplingParams(temperature=0.8, repetition_penalty=1.1, frequency_penalty=0.2),
}
assert set(SAMPLING) == set(SAMPLING_KINDS)


class DeviceClock:
    """The median device seconds of a call over ``repeat`` runs (after one warm-up run)."""

    def __init__(self, device: torch.device, repeat: int = 5) -> None:
        self.cuda = device.type == "cuda"
        self.repeat = repeat
        if self.cuda:
            start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            torch.cuda.synchronize()
            start.record()
            torch.cuda._sleep(20_000_000)
            end.record()
            end.synchronize()
            self.cycles_per_s = 20_000_000 / (start.elapsed_time(end) / 1e3)

    def __call__(self, fn: Callable[[], object]) -> float:
        if not self.cuda:
            fn()
            samples = []
            for _ in range(self.repeat):
                start = time.perf_counter()
                fn()
                samples.append(time.perf_counter() - start)
            return statistics.median(samples)
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        launch = time.perf_counter() - start
        torch.cuda.synchronize()
        # Long enough that the whole launch is queued before the first kernel may start.
        cycles = int((2 * launch + 3e-4) * self.cycles_per_s)
        begin, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
        samples = []
        for _ in range(self.repeat):
            torch.cuda._sleep(cycles)
            begin.record()
            fn()
            end.record()
            end.synchronize()
            samples.append(begin.elapsed_time(end) / 1e3)
        return statistics.median(samples)


def grid_step(
    prefills: Iterable[tuple[int, int]],
    num_decodes: int,
    decode_context: int,
    block_size: int,
    num_blocks: int,
) -> StepInput:
    """A step of chunks (new tokens over cached ones) and decodes (of one context each), every
    sequence sampling, each on blocks of its own while the cache has room (then reused: the
    content does not matter, only the work)."""
    ids, query_lens, seq_lens, tables, rows = [], [], [], [], []
    next_block = 0

    def table(length: int) -> list[int]:
        nonlocal next_block
        count = -(-length // block_size)
        blocks = [(next_block + i) % num_blocks for i in range(count)]
        next_block += count
        return blocks

    prefills = list(prefills)
    for n, cached in prefills:
        ids += [1] * n
        query_lens.append(n)
        seq_lens.append(cached + n)
        tables.append(table(cached + n))
        rows.append(len(ids) - 1)
    for _ in range(num_decodes):
        ids.append(1)
        query_lens.append(1)
        seq_lens.append(decode_context)
        tables.append(table(decode_context))
        rows.append(len(ids) - 1)
    return StepInput(ids, query_lens, seq_lens, tables, len(prefills), rows)


class Grid:
    """The shapes a profile measures, within the engine's limits. ``quick``: a few of them
    (a CPU, a test)."""

    def __init__(
        self,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        capacity: int,
        graph_sizes: list[int],
        quick: bool = False,
    ) -> None:
        self.max_num_seqs, self.budget = max_num_seqs, max_num_batched_tokens
        self.max_len, self.capacity = max_model_len, capacity
        self.graph_sizes, self.quick = graph_sizes, quick

    def _fits(self, tokens: int, length: int) -> bool:
        return tokens <= self.budget and length <= self.max_len

    def contexts(self, batch: int) -> list[int]:
        """Decode contexts for a batch: powers of two from 16 up to what the cache holds."""
        ratio = 8 if self.quick else 2
        out, c = [], 16
        while c < self.max_len and batch * c <= self.capacity:
            out.append(c)
            c *= ratio
        top = min(self.max_len - 1, self.capacity // batch)
        if top >= 2 and (not out or top > out[-1] * 1.25):
            out.append(top)
        return out

    def decode_graphs(self) -> list[tuple[int, int]]:
        """(batch, context) for every captured size."""
        return [(b, c) for b in self.graph_sizes for c in self.contexts(b)]

    def eager(self) -> list[tuple[tuple[tuple[int, int], ...], int, int]]:
        """(chunks, decodes, decode context): single chunks over cached tokens, several
        chunks at once, chunks beside decodes, decodes alone."""
        ratio = 8 if self.quick else 2
        lengths, n = [], 16
        while n < self.budget:
            lengths.append(n)
            n *= ratio
        lengths.append(self.budget)
        cached = (0, 256) if self.quick else (0, 512, 2048, 8192)
        shapes = [(((n, c),), 0, 0) for n in lengths for c in cached if self._fits(n, n + c)]
        for total in (1024,) if self.quick else (1024, 8192):
            for k in (4,) if self.quick else (4, 16, 64):
                n = total // k
                for c in (0,) if self.quick else (0, 1024):
                    if n >= 1 and self._fits(total, n + c):
                        shapes.append((((n, c),) * k, 0, 0))
        seqs = sorted({b for b in (8, 64, self.max_num_seqs) if b <= self.max_num_seqs})
        contexts = (256,) if self.quick else (256, 2048)
        for b in seqs:
            for ctx in contexts:
                if b * ctx > self.capacity or ctx >= self.max_len:
                    continue
                for n in (64,) if self.quick else (64, 512, 4096):
                    if self._fits(n + b, n):
                        shapes.append((((n, 0),), b, ctx))
                shapes.append(((), b, ctx))
        if 1 not in seqs:
            shapes += [((), 1, ctx) for ctx in contexts if ctx < self.max_len]
        return shapes

    def sampling_rows(self) -> list[int]:
        rows, r = [], 1
        while r < self.max_num_seqs:
            rows.append(r)
            r *= 4 if self.quick else 2
        return [*rows, self.max_num_seqs]


def measure_forwards(engine, shapes, clock: DeviceClock, progress) -> list[GridPoint]:
    """The forward's device time of each (chunks, decodes, context) shape."""
    runner, workers = engine.runner, engine.workers
    points = []
    for i, (chunks, num_decodes, context) in enumerate(shapes):
        step = grid_step(chunks, num_decodes, context, runner.block_size, runner.num_blocks)

        def forward(step=step):
            if workers is not None:
                workers.send(step, None)
            return runner.execute(step)

        points.append(GridPoint(tuple(chunks), num_decodes, context, clock(forward)))
        progress(i + 1, len(shapes))
    return points


def measure_sampling(engine, rows: list[int], clock: DeviceClock, progress) -> dict:
    """The sampler's device time over [rows, vocab] logits, for every kind of sampling."""
    runner, sampler = engine.runner, engine.sampler
    vocab = engine.model_config.vocab_size
    out: dict[str, list[tuple[int, float]]] = {}
    done, total = 0, len(rows) * len(SAMPLING)
    for kind, params in SAMPLING.items():
        out[kind] = []
        for n in rows:
            seqs = []
            for i in range(n):
                seq = Sequence(i, [1 + (i + j) % 100 for j in range(16)], params)
                seq.token_ids += [2 + (i + j) % 50 for j in range(8)]  # outputs: penalties
                seqs.append(seq)
            logits = torch.randn(n, vocab, device=runner.device).to(runner.dtype)
            batch = sampler.prepare(seqs)
            seconds = clock(lambda logits=logits, batch=batch: sampler.sample(logits, batch))
            out[kind].append((n, seconds))
            done += 1
            progress(done, total)
    return out
