"""The device's time of steps over a grid of batch shapes (``nano_scheduler.sim.grid``): the
first part of a profile.

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
                seq.token_ids.extend(2 + (i + j) % 50 for j in range(8))  # outputs: penalties
                seqs.append(seq)
            logits = torch.randn(n, vocab, device=runner.device).to(runner.dtype)
            batch = sampler.prepare(seqs)
            seconds = clock(lambda logits=logits, batch=batch: sampler.sample(logits, batch))
            out[kind].append((n, seconds))
            done += 1
            progress(done, total)
    return out
