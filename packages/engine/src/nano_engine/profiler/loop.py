"""The loop's host time on real workloads: the second part of a profile.

The engine's own loop runs synthetic workloads with its step log on: small and large decode
batches, admissions beside running decodes, prompts of many lengths. ``offline`` submits them
as ``LLM.generate`` does; ``server`` sends them through ``nano-engine serve`` (a process of its
own, as in production) from client processes that stream every token, and also yields each
request's ingress (client send to engine accept) and egress (first token published to first
token received).
"""

from __future__ import annotations

import math
import queue
import random
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from nano_engine.config import EngineConfig
from nano_engine.replay import ServedEngine, Target, client_pool, replay, serve_options
from nano_scheduler import SamplingParams
from nano_scheduler.sim.profile import StepRecord, read_step_log
from nano_scheduler.sim.workload import Request


class Workloads:
    """The synthetic workloads, sized to the engine (``quick``: short ones)."""

    def __init__(self, max_num_seqs: int, max_model_len: int, vocab: int, quick: bool) -> None:
        self.max_num_seqs, self.quick = max_num_seqs, quick
        self.served = 0.0  # requests/s of the mixed workload offline (``offline`` sets it)
        self.longest = max(2, min(4096, max_model_len // 2))
        self.vocab = min(vocab, 10_000)
        self.rng = random.Random(0)

    def sweep(self) -> list[list[Request]]:
        """Batches of one size each, all at once: decode steps from 1 to max_num_seqs, after
        prompts of several lengths."""
        sizes = (1, 8) if self.quick else (1, 4, 16, 64)
        sizes = sorted({n for n in sizes if n < self.max_num_seqs} | {self.max_num_seqs})
        prompts = [min(p, self.longest) for p in (2048, 128, 1024, 512, 256)]
        output = 8 if self.quick else 48
        return [
            [Request(0.0, prompts[i % len(prompts)], output) for _ in range(n)]
            for i, n in enumerate(sizes)
        ]

    def mixed(
        self, rate: float | None, count: int, outputs: int = 160, shortest: int = 4
    ) -> list[Request]:
        """Prompts and outputs of log-uniform lengths (outputs from ``shortest`` to
        ``outputs`` tokens), arriving at ``rate`` per second (None: all at once): admissions
        beside decodes of many context lengths."""
        rng, now, out = self.rng, 0.0, []
        longest_output = min(32 if self.quick else outputs, self.longest)
        shortest = min(shortest, longest_output)
        for _ in range(count):
            if rate is not None:
                now += rng.expovariate(rate)
            prompt = round(2 ** rng.uniform(4, max(4.0, math.log2(self.longest))))
            output = round(2 ** rng.uniform(math.log2(shortest), math.log2(longest_output)))
            out.append(Request(now, max(1, prompt), max(1, output)))
        return out

    def saturating(self) -> list[Request]:
        """Three full batches' worth of requests at once, outputs of 32 to 1,024 tokens: a
        server far above its capacity. The batch stays at max_num_seqs with a queue behind
        it, each step that ends sequences admits prompt chunks beside the other decodes,
        and the front passes over every stream each step: the steps a saturated server runs
        most, which the other workloads reach only in passing."""
        return self.mixed(None, 3 * self.max_num_seqs, 1024, shortest=32)


def offline(engine, work: Workloads, progress) -> list[StepRecord]:
    """Step records of workloads submitted as ``LLM.generate`` does. Sets ``work.served``:
    the requests per second of the mixed workload, all submitted at once."""
    recorder = engine.record_steps()
    mixed = work.mixed(None, 2 * work.max_num_seqs)
    runs = [*work.sweep(), mixed]
    for i, requests in enumerate(runs):
        seconds = _generate(engine, requests, work.vocab)
        progress(i + 1, len(runs))
    work.served = len(mixed) / seconds
    engine.stop_recording()
    return recorder.steps


def _generate(engine, requests: list[Request], vocab: int) -> float:
    ready: queue.SimpleQueue = queue.SimpleQueue()
    batch = [
        engine.make_request(
            [t % vocab for t in r.token_ids(i, 0)],
            SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True),
            notify=ready.put,
            stream_deltas=False,
        )
        for i, r in enumerate(requests)
    ]
    start = time.perf_counter()
    engine.submit(batch)
    remaining = len(batch)
    while remaining:
        stream = ready.get()
        while (out := stream.get_nowait()) is not None:
            remaining -= out.finished
    return time.perf_counter() - start


def server(
    config: EngineConfig, work: Workloads, engine_process: bool, progress
) -> tuple[list[StepRecord], dict]:
    """Step records of workloads sent through ``nano-engine serve`` (started here with
    ``config``, its step log on, its engine in a process of its own or not) by streaming
    clients, and the server's costs: ingress and egress samples, the first request's extra
    time, each workload's span of the log, and how the engine ran (``engine_process``)."""
    with tempfile.TemporaryDirectory(prefix="nano-engine-profile-") as tmp:
        step_log = Path(tmp) / "steps.jsonl"
        from nano_engine.options import engine_flags

        options = engine_flags(config)
        if not engine_process:
            options.append("--disable-frontend-multiprocessing")
        sweep = work.sweep()
        # The mixed workload arriving at 40% and 70% of the rate the engine served it
        # offline (admissions beside few, then tens to a hundred decodes: a prompt chunk's
        # launch depends on the decodes beside it, and a trace served under load makes
        # most of its chunks beside those), then long outputs at twice it (queues, long
        # contexts), then a saturated server's full batches.
        count = 2 * work.max_num_seqs
        mixed = [
            work.mixed(0.4 * work.served, count),
            work.mixed(0.7 * work.served, work.max_num_seqs),
            work.mixed(2 * work.served, count, 1024),
            work.saturating(),
        ]
        one = [Request(0.0, min(128, work.longest), 8)]
        workloads = [one, one, one, *sweep, *mixed]  # (a cold request first, then warm ones)
        largest = max(len(requests) for requests in workloads)
        options = serve_options(options, largest)  # (each request holds a connection)
        with ServedEngine(config.model, options, step_log, Path(tmp) / "out", "profile") as url:
            target = Target(url, "profile", vocab=work.vocab)
            # spans: [start, end (monotonic), requests, prompt tokens, seconds they were sent over]
            replays, spans = [], []
            with client_pool(4) as clients:
                for requests in workloads:
                    ids = replace(target, request_ids=f"profile{len(replays)}")
                    processes = min(4, len(requests))
                    start = time.monotonic()
                    replays.append(replay(ids, requests, processes, pool=clients))
                    prompt = sum(r.prompt_tokens for r in replays[-1].records)
                    sent_over = requests[-1].arrival_time - requests[0].arrival_time
                    spans.append([start, time.monotonic(), len(requests), prompt, sent_over])
                    progress(len(replays), len(workloads))
        log = read_step_log(step_log)
    failed = [r.error for run in replays for r in run.failures]
    if failed:
        raise RuntimeError(f"{len(failed)} profile requests failed; the first: {failed[0]}")
    costs = {**_server_costs(log, replays), "workloads": _workload_cpu(log.steps, spans)}
    costs["engine_process"] = engine_process
    cold, *warm = (run.records[0] for run in replays[:3])
    ttft = min(r.times[0] - r.sent for r in warm)
    costs["first_request_s"] = max(0.0, cold.times[0] - cold.sent - ttft)
    return log.steps, costs


def _workload_cpu(steps: list[StepRecord], spans: list[list[float]]) -> list[list[float]]:
    """Each workload as [first step, end step, requests, prompt tokens, the event loop's CPU
    seconds from its first iteration to the next workload's (requests are taken in between
    iterations too), the seconds its requests were sent over (0: all at once)]."""
    starts = [
        next((i for i, r in enumerate(steps) if r.t >= start), len(steps)) for start, *_ in spans
    ]
    ends = [*starts[1:], len(steps)]
    out = []
    for first, end, (_, _, requests, prompt, sent_over) in zip(starts, ends, spans):
        if first >= end or steps[first].server_cpu_at is None:
            continue
        last = steps[end - 1]
        cpu = (
            steps[end].server_cpu_at
            if end < len(steps)
            else last.server_cpu_at + (last.server_cpu or 0.0)
        ) - steps[first].server_cpu_at
        out.append([first, end, requests, prompt, cpu, sent_over])
    return out


def _server_costs(log, replays) -> dict:
    """Ingress (prompt tokens, client send -> engine accept) and egress (outputs published
    with it, first token published -> received) of every request of the replays, matched
    with the step log by request id."""
    timings = {t.id: t for t in log.requests}
    ingress, egress = [], []
    for k, run in enumerate(replays):
        for client in run.records:
            timing = timings.get(f"profile{k}-{client.index}-0")
            if timing is None:
                raise RuntimeError(f"request {client.index} of workload {k} is not in the step log")
            ingress.append([client.prompt_tokens, max(0.0, timing.arrival - client.sent)])
            if timing.first_token is not None and timing.first_step is not None:
                outputs = log.steps[timing.first_step].outputs
                egress.append([outputs, max(0.0, client.times[0] - timing.first_token)])
    return {"ingress": ingress, "egress": egress}
