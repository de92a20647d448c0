"""Host time of each phase of the engine's loop (``ProfiledCostModel``'s part): non-negative
linear fits over the profile's step records, each summing to what it was fitted to; the
publish phase interpolated by its outputs; in wall time, what the phases leave: the loop's
time between iterations and what each request taken in costs it (``HostModel``)."""

from __future__ import annotations

import math
import random
from itertools import pairwise

from nano_scheduler.sim.cost_model import BatchShape
from nano_scheduler.sim.fit import Piecewise, increasing, nnls
from nano_scheduler.sim.profile import HOST_PHASES, StepRecord

_IDLE = 0.05  # seconds left between iterations beyond which the loop waited for something else


class HostModel:
    """The loop's host time per phase, each a non-negative linear fit over step records. The
    launch is fitted apart for CUDA-graph steps (a replay) and eager ones (every kernel of the
    model launched, tens of milliseconds on a GPU, and varying widely from step to step: an
    eager launch takes its fit times a ratio drawn from those measured, scaled to a mean of 1,
    so the simulation sees the spread too, around the fit. Unscaled, the ratios' mean was
    1.12 on an H200: a tail of slow launches under the profile's bursts of requests, which
    put nano-sim's eager launches 15-20% above what trace replays measured). Each launch is
    fitted with the requests the engine received meanwhile (taken in at the next iteration)
    beside its shape: the thread that receives them holds the interpreter lock a while, and
    on an H200 a graph launch with one of them took 1.3-1.4x its fit, an eager one 1.05-1.1x
    (1.1-1.25x with three). Left in the fit, that cost of the profile's bursts overestimated
    the launches of a trace that sends its requests apart; kept out, what it costs the loop
    lands in each request's intake, fitted to what the phases leave (``_rest``)."""

    def __init__(
        self,
        records: list[StepRecord],
        block_size: int,
        cpu: bool = False,
        synchronous: bool = False,
    ) -> None:
        """``cpu``: fit the loop thread's CPU seconds (where measured), not the wall time;
        ``synchronous``: the device's work ran on the loop's thread (a CPU), outside its
        phases and waits."""
        self.block_size, self.synchronous = block_size, synchronous
        if cpu:
            records = [r for r in records if r.cpu is not None]
        steps = [r for r in records if r.num_tokens]
        if not steps:
            raise ValueError("the profile's host measurements hold no step")
        self.cpu = cpu
        graphs, eager = [r for r in steps if not r.eager], [r for r in steps if r.eager]
        self.schedule = self._fit(steps, self._schedule_features, 0)
        # The waiting queue's cost is known only as far as the profile saw it (tens of requests
        # behind a burst), where it is entangled with the admissions that come with a queue:
        # fitted per waiting request, 2-11 us on an H200, it put 1.5-7 ms on each step of a
        # saturated trace's 600 waiting (up to 7x off the engine's capacity), yet bench_host
        # measures no cost of 1,000 waiting (benchmarks/RESULTS.md). Beyond, it is held at
        # the edge.
        self.max_waiting = max(r.waiting for r in steps)
        received = {id(a): b.accepted for a, b in pairwise(records)}  # (during each iteration)

        def launch_features(r: StepRecord) -> list[float]:
            return [*self._launch_features(r), received.get(id(r), 0)]

        # (each fit's last coefficient, per request received meanwhile, stays out of the
        # launch: ``_launch_row`` has one feature fewer)
        self.launch_graph = self._fit(graphs, launch_features, 1) if graphs else None
        self.launch_eager = self._fit(eager, launch_features, 1) if eager else None
        self._spread = [1.0]
        if eager:
            fitted = [self._dot(self.launch_eager, launch_features(r)) for r in eager]
            measured = [self._time(r, 1) for r in eager]
            self._spread = [m / f for m, f in zip(measured, fitted) if f > 0] or [1.0]
            mean = sum(self._spread) / len(self._spread)
            self._spread = [x / mean for x in self._spread]
        self._rng = random.Random(0)
        # The sampler's host work: next to nothing after a graph that drew the tokens itself,
        # its whole launch after an eager step: fitted apart, as the launch is.
        self.sample_graph = self._fit(graphs, lambda r: [1.0, r.sampled], 3) if graphs else None
        self.sample_eager = self._fit(eager, lambda r: [1.0, r.sampled], 3) if eager else None
        resolving = [r for r in records if r.resolved]
        self.post = self._fit(resolving or steps, self._post_features, 2)
        self.publish = self._by_outputs(records)
        self.between, self.intake = self._rest(records)

    def _rest(self, records: list[StepRecord]) -> tuple[list[float], list[float]]:
        """What the phases leave of the loop's time: seconds between one iteration's publish
        and the next iteration (statistics, the step log, the inbox), after a graph step and
        after an eager one, and per request taken in meanwhile and per prompt token of them
        (receiving it, and the thread that receives it holding the interpreter lock:
        iterations that take requests in run 0.4-2.5 ms longer on an H200, though no phase
        counts it). A non-negative fit of each iteration's time, less its wait for the device
        and its phases as modelled, to the next iteration's start (an iteration followed by a
        stall of more than ``_IDLE`` is left out: a burst of hundreds of requests taken in at
        once among them, so the intake's fit is that of requests arriving over time). None in
        CPU seconds (the simulation charges the lock's sharing itself) or without iterations
        in a row."""
        if self.cpu:
            return [0.0, 0.0], [0.0, 0.0]
        rows, rest = [], []
        for a, b in pairwise(records):
            # (b resolves a's step: the loop did not idle between them)
            if not a.num_tokens or not b.resolved or b.t <= a.t:
                continue
            shape = BatchShape.of_record(a)
            schedule, launch, sample = self.step(shape, a.eager, not a.eager, spread=False)
            post, publish = self.resolve(a.resolved, a.finished, a.outputs)
            left = b.t - a.t - a.wait - (schedule + launch + sample + post + publish)
            if self.synchronous:  # (the step's compute, on the loop's thread)
                left -= (a.forward or 0.0) + (a.sample_device or 0.0)
            if left < _IDLE:
                rows.append([float(not a.eager), float(a.eager), b.accepted, b.accepted_tokens])
                rest.append(left)
        if len(rows) < 10:
            return [0.0, 0.0], [0.0, 0.0]
        coef = nnls(rows, rest)
        return coef[:2], coef[2:]

    def _time(self, r: StepRecord, phase: int) -> float:
        return r.cpu[phase] if self.cpu else getattr(r, HOST_PHASES[phase])

    def _fit(self, records: list[StepRecord], features, phase: int) -> list[float]:
        """Least squares weighted by 1 / time, between absolute and relative error: the small
        steps most serving is made of count, as the large ones do (a plain fit, dominated by
        the large, overestimated the small by 20-50% on the GPU); then scaled so that it sums
        to what it was fitted to. The weights favour the records that came out fast, and the
        loop's time is a sum: unscaled, the phases' fits summed to 0.84-0.93 of the measured
        on an H200, and nano-sim's saturated throughput came out 6% high."""
        times = [self._time(r, phase) for r in records]
        floor = max(sorted(times)[len(times) // 10], 1e-6)  # (no weight for a time of ~0)
        rows = [features(r) for r in records]
        coef = nnls(rows, times, [1 / max(t, floor) for t in times])
        fitted = sum(self._dot(coef, row) for row in rows)
        return [c * sum(times) / fitted for c in coef] if fitted > 0 else coef

    def _by_outputs(self, records: list[StepRecord]) -> Piecewise:
        """The publish phase by the number of outputs: the mean of each bin of the number (bins
        half an octave wide, of 3 records at least), made non-decreasing, interpolated. Not a
        line: on an H200 it cost ~5 us an output up to a hundred, ~10 us beyond 150."""
        bins: dict[int, list[tuple[int, float]]] = {}
        for r in records:
            key = int(math.log2(r.outputs) * 2) if r.outputs else -1
            bins.setdefault(key, []).append((r.outputs, self._time(r, 4)))
        groups = [g for _, g in sorted(bins.items()) if len(g) >= 3] or [
            g for _, g in sorted(bins.items())
        ]
        points = increasing(
            [(sum(n for n, _ in g) / len(g), sum(t for _, t in g) / len(g), len(g)) for g in groups]
        )
        # (past the largest bin: at most its cost an output; the last two bins' slope was
        # twice that on an H200)
        last_n, last_t = points[-1]
        return Piecewise(points, tail=last_t / last_n if last_n > 0 else 0.0)

    @staticmethod
    def _dot(coef: list[float], features: list[float]) -> float:
        return sum(c * x for c, x in zip(coef, features))

    @staticmethod
    def _schedule_features(r: StepRecord) -> list[float]:
        prefill_tokens = sum(n for n, _ in r.prefills)
        return [1.0, r.decodes[0], len(r.prefills), prefill_tokens, r.running, r.waiting]

    def _launch_features(self, r: StepRecord) -> list[float]:
        longest = max([r.decodes[2]] + [n + c for n, c in r.prefills])
        return self._launch_row(r.decodes[0], len(r.prefills), longest, r.num_tokens)

    def _launch_row(self, decodes: int, chunks: int, longest: int, tokens: int) -> list[float]:
        # the step's inputs: one int32 buffer with every block table padded to the longest
        table = (decodes + chunks) * -(-longest // self.block_size)
        return [1.0, table, decodes + chunks, tokens, chunks]

    @staticmethod
    def _post_features(r: StepRecord) -> list[float]:
        return [1.0, r.resolved, r.finished, r.outputs]

    def step(
        self, batch: BatchShape, eager: bool, drawn: bool, spread: bool = True
    ) -> tuple[float, float, float]:
        """The step's host phases: scheduling, launch (of a graph or eager) and the sampler's
        (next to nothing where the graph drew the tokens, its whole launch otherwise)."""
        n_dec = len(batch.decodes)
        prefill_tokens = sum(n for n, _ in batch.prefills)
        s = self.schedule
        schedule = (
            s[0]
            + s[1] * n_dec
            + s[2] * len(batch.prefills)
            + s[3] * prefill_tokens
            + s[4] * batch.num_running
            + s[5] * min(batch.num_waiting, self.max_waiting)
        )
        longest = max(batch.decodes) if batch.decodes else 0
        for n, c in batch.prefills:
            longest = max(longest, n + c)
        row = self._launch_row(n_dec, len(batch.prefills), longest, prefill_tokens + n_dec)
        coef = self.launch_eager if eager else self.launch_graph
        coef = coef or self.launch_eager or self.launch_graph  # (a regime never measured)
        launch = self._dot(coef[: len(row)], row)
        if eager and spread:  # (without: the fit, the draws' mean)
            launch *= self._rng.choice(self._spread)
        s = self.sample_graph if drawn else self.sample_eager
        s = s or self.sample_eager or self.sample_graph
        return schedule, launch, s[0] + s[1] * batch.num_sampled

    def rest(self, eager: bool) -> float:
        return self.between[1 if eager else 0]

    def intake_cost(self, prompt_tokens: int) -> float:
        return self.intake[0] + self.intake[1] * prompt_tokens

    def resolve(self, resolved: int, finished: int, outputs: int) -> tuple[float, float]:
        p = self.post
        post = p[0] + p[1] * resolved + p[2] * finished + p[3] * outputs
        return post, self.publish(outputs)
