"""The calibrated step-time model: built from an engine profile (``nano-engine profile``).

Device time of a step:
- a decode-only batch that fits a CUDA graph runs in the smallest captured graph that holds it
  (padding rows cost their matmul rows, no attention): interpolated over the profiled total
  context for that graph size (between graph sizes too, for what-if configurations), at
  least that of an equal batch of a share of its longest context (a ragged batch waits for
  its longest sequence), times the ratio of served steps to the grid's (the share and the
  ratio fitted on the profile's served steps);
- any other step runs eagerly: a fit with non-negative coefficients over the batch's features
  (a convex piecewise-linear cost of its tokens for the matmuls, attention pairs weighted by
  the chunks' lengths, KV read by prefill chunks and decodes, per-sequence costs);
- sampling: interpolated over the sampled rows, for the kind of sampling the requests use;
  none after a CUDA-graph decode whose rows take the fused pass (greedy, random: the graph
  draws them itself, and the profiled graph time includes the draw).

Host time of each phase of the loop (``StepCost``, ``resolve_cost``): non-negative linear fits
(the publish phase: interpolated by its outputs), each summing to what it was fitted to,
over the step records the profile measured through the chosen frontend (``offline``: the
Python API, wall seconds; ``server``: the HTTP server with streaming clients: with the engine in
a process of its own, wall seconds; in the server's process, the loop thread's own CPU seconds,
as the simulator shares the interpreter lock with the server's event loop itself), and in wall
time, what the phases leave: the loop's time between iterations and what each request taken
in costs it.
``server_costs``: the event loop's work per request, prompt token, pass over the streams and
chunk sent (a fit to its thread's CPU time, or the front process's, over the profile's
workloads), the network's latency (what the first token of a lone request took beyond
them), a request's hop to the engine after its handling and the share of a pass that relays
the outputs before its first chunk (fitted to the calmest workload's ways in and out).
``host_scale``: every host cost times this (a host that much slower than the profiled one).

No prediction is <= 0. A question far outside the profiled grid gets an answer extrapolated
from the grid's edge and one warning per kind of question.
"""

from __future__ import annotations

import math
import random
import warnings
from bisect import bisect_left
from itertools import pairwise

from nano_scheduler.config import cuda_graph_sizes, piecewise_graph_sizes
from nano_scheduler.sim.cost_model import BatchShape, StepCost
from nano_scheduler.sim.fit import Piecewise, increasing, log_hats, nnlad, nnls
from nano_scheduler.sim.host import ServerCosts
from nano_scheduler.sim.profile import (
    HOST_PHASES,
    SAMPLING_KINDS,
    GridPoint,
    Profile,
    StepRecord,
)

# The sampling kinds whose rows a decode CUDA graph draws itself (the sampler's fused pass).
GRAPH_DRAWN = ("greedy", "random")
_FAR = 1.25  # asked beyond this factor of the profiled range: warn
_IDLE = 0.05  # seconds left between iterations beyond which the loop waited for something else


class ProfiledCostModel:
    """Step times from a profile, for the engine settings the simulation uses.

    ``max_num_seqs``: decides the CUDA-graph batch sizes as the engine would (default the
    profile's); ``frontend``: ``server`` or ``offline`` host costs; ``sampling``: which of the
    profiled sampling costs the requests pay (greedy, random, top_p, logprobs, penalties).
    """

    def __init__(
        self,
        profile: Profile,
        frontend: str = "server",
        sampling: str = "greedy",
        max_num_seqs: int | None = None,
        max_num_batched_tokens: int | None = None,
        host_scale: float = 1.0,
    ) -> None:
        if not (host_scale > 0 and math.isfinite(host_scale)):
            raise ValueError(f"the host scale must be a positive number, got {host_scale}")
        self.profile = profile
        self.host_scale = host_scale
        self.synchronous = bool(profile.device.get("synchronous", False))
        if frontend not in profile.host:
            raise ValueError(
                f"the profile has no {frontend!r} host measurements; it has {sorted(profile.host)}"
            )
        if sampling not in profile.sampling:
            known = [k for k in SAMPLING_KINDS if k in profile.sampling]
            raise ValueError(f"the profile has no {sampling!r} sampling costs; it has {known}")
        self.frontend, self.sampling = frontend, sampling
        self._warned: set[str] = set()
        engine = profile.engine
        self.block_size = engine.block_size
        seqs = max_num_seqs if max_num_seqs is not None else engine.max_num_seqs
        self.graph_sizes = cuda_graph_sizes(seqs) if engine.cuda_graph_sizes else []
        self._graph_limit = self.graph_sizes[-1] if self.graph_sizes else 0
        self._decode = DecodeGraphModel(profile.decode_graphs) if self.graph_sizes else None
        served = profile.host.get("server") or profile.host[frontend]
        self._ragged, self._served = self._served_graphs(served)
        self._eager = EagerModel(profile.eager, self._piecewise(engine.max_num_batched_tokens))
        self._eager_served = self._served_eager(served)
        budget = max_num_batched_tokens or engine.max_num_batched_tokens
        self._eager.sizes = self._piecewise(budget)  # (the what-if's, from here on)
        self._sample = Piecewise(profile.sampling[sampling])
        # (the loop thread's CPU time where the simulation shares the lock with the event
        # loop itself; its wall time in an engine process of its own, where the lock's other
        # holders, the threads carrying requests and outputs, are part of the loop's cost)
        own = bool(profile.server.get("engine_process", False))
        cpu = frontend == "server" and not own
        self._host = HostModel(
            profile.host[frontend], engine.block_size, cpu=cpu, synchronous=self.synchronous
        )
        self._outputs_edge = self._host.publish.xs[-1]  # (the most outputs the profile saw)
        self.server_costs = (
            server_costs(profile.host["server"], profile.server).scaled(host_scale)
            if frontend == "server"
            else None
        )

    def _piecewise(self, max_num_batched_tokens: int) -> list[int]:
        """The token counts of the piecewise CUDA graphs the engine would capture."""
        if not self.profile.engine.piecewise_graphs:
            return []
        return piecewise_graph_sizes(max_num_batched_tokens)

    # ---- device --------------------------------------------------------------------------

    def forward_time(self, batch: BatchShape) -> float:
        """Device seconds of the model's forward (the LM head included)."""
        n_dec = len(batch.decodes)
        context = batch.decode_context
        if n_dec and not batch.prefills and n_dec <= self._graph_limit:
            size = self.graph_sizes[bisect_left(self.graph_sizes, n_dec)]
            self._check("decode context", context / n_dec, self._decode.max_context)
            self._check("CUDA-graph batch size", size, self._decode.sizes[-1])
            longest = max(batch.decodes)
            return self._served * self._decode(size, max(context, self._ragged * size * longest))
        eager = self._eager
        self._check("tokens in a step", batch.num_tokens, eager.max_tokens)
        if batch.prefills:
            self._check(
                "cached tokens before a chunk", max(c for _, c in batch.prefills), eager.max_cached
            )
        return self._eager_served * eager(batch.prefills, n_dec, context)

    def _served_eager(self, records: list[StepRecord]) -> float:
        """What a step outside the decode graphs takes when served, over the grid's time of
        its shape: the geometric mean over the profile's served such steps that the device
        bounded (launched in less than half the grid's time: the device did not wait for the
        host), 1 without 20 of them. The grid times each shape from an idle device, at its
        highest clock; serving runs them back to back, where a GPU at its power limit lowers
        its clock within tens of milliseconds of sustained compute (an H200 at 700 W: a
        compute-bound product 1.20-1.25x slower after 90 ms of them, memory-bound work not).
        On an H200: 1.16 (Qwen3-8B) and 1.21-1.24 (Qwen3-0.6B), where traces replayed apart
        measured 1.14-1.16 and 1.06-1.22. (On a synchronous device, a CPU, the forward's
        time is the whole call's, its launch 0: the ratio is then what serving beside the
        server's other work took over the grid's calls alone.)"""
        logs = []
        for r in records:
            if not (r.eager and r.forward and r.num_tokens):
                continue
            grid = self._eager(r.prefills, r.decodes[0], r.decodes[1])
            if _device_bound(r, grid):
                logs.append(math.log(r.forward / grid))
        return math.exp(sum(logs) / len(logs)) if len(logs) >= 20 else 1.0

    def _served_graphs(self, records: list[StepRecord]) -> tuple[float, float]:
        """What a decode graph takes when served, beyond the grid's equal batches replayed
        alone: ``floor``, how its time follows its longest context, not only the total (a
        served batch's contexts are ragged, and the longest sequence's attention is the last
        to finish: a batch costs at least an equal batch of ``floor`` x its longest context);
        ``scale``, the ratio of the served steps' time to the grid's (inputs copied beside
        the replay, another stream's work, clocks: 2-8% more on an H200). The pair that fits
        the profile's served graph steps best (least squared log error; the device's time of
        each is in its record): 0.25-0.3 and 1.03-1.08 on an H200 (Qwen3-0.6B); the floor took
        the error's spread from 13% to 8% on the profile's steps and from 8% to 6% on a trace
        replayed apart; (0, 1) without 50 such steps."""
        sizes = sorted(self.profile.engine.cuda_graph_sizes)  # (the graphs it ran)
        if self._decode is None or not sizes:
            return 0.0, 1.0
        steps = [
            r
            for r in records
            if r.forward and not r.eager and not r.prefills and 0 < r.decodes[0] <= sizes[-1]
        ]
        if len(steps) < 50:
            return 0.0, 1.0
        # (padded as the profiled engine padded them, whatever the what-if's graphs)
        shapes = [(sizes[bisect_left(sizes, r.decodes[0])], r) for r in steps]
        best = None
        for floor in (i / 20 for i in range(21)):
            logs = []
            for size, r in shapes:
                _, total, longest = r.decodes
                equal = self._decode(size, max(total, floor * size * longest))
                logs.append(math.log(r.forward / equal))
            shift = sum(logs) / len(logs)  # (the scale that fits best with this floor)
            error = sum((x - shift) ** 2 for x in logs)
            if best is None or error < best[0]:
                best = (error, floor, math.exp(shift))
        return best[1], best[2]

    def sample_time(self, rows: int) -> float:
        if not rows:
            return 0.0
        self._check("sampled rows", rows, self._sample.span[1])
        return self._sample(rows)

    # ---- the loop ----------------------------------------------------------------------------

    def is_eager(self, batch: BatchShape) -> bool:
        return bool(batch.prefills) or len(batch.decodes) > self._graph_limit

    def step_cost(self, batch: BatchShape) -> StepCost:
        eager = self.is_eager(batch)
        drawn = not eager and self.sampling in GRAPH_DRAWN
        host = self._host
        if host.schedule[5] > 0:  # (a queue's cost the profile measured)
            self._check(
                "requests waiting",
                batch.num_waiting,
                host.max_waiting,
                "the scheduler's time is held at what the profile measured there",
            )
        schedule, launch, sample = host.step(batch, eager, drawn)
        device_sample = 0.0 if drawn else self.sample_time(batch.num_sampled)
        forward = self.forward_time(batch)
        x = self.host_scale
        return StepCost(
            schedule * x, launch * x, forward, sample * x, device_sample, host.rest(eager) * x
        )

    def intake_cost(self, prompt_tokens: int) -> float:
        return self._host.intake_cost(prompt_tokens) * self.host_scale

    def resolve_cost(self, resolved: int, finished: int, outputs: int) -> tuple[float, float]:
        self._check("outputs published at once", outputs, self._outputs_edge)
        post, publish = self._host.resolve(resolved, finished, outputs)
        return post * self.host_scale, publish * self.host_scale

    def host_ratio(self, records: list[StepRecord]) -> float:
        """The loop thread's host time in a step log over what this model predicts for the
        same steps (1: the host ran as fast as when it was profiled; 2: half as fast, e.g.
        a machine whose CPUs slowed down since, or another host). nan: no step to compare."""
        measured = predicted = 0.0
        for r in records:
            if not r.num_tokens or (self._host.cpu and r.cpu is None):
                continue
            shape = BatchShape.of_record(r)
            drawn = not r.eager and self.sampling in GRAPH_DRAWN
            schedule, launch, sample = self._host.step(shape, r.eager, drawn, spread=False)
            post, publish = self._host.resolve(r.resolved, r.finished, r.outputs)
            predicted += schedule + launch + sample + post + publish
            measured += (
                sum(r.cpu) if self._host.cpu else sum(getattr(r, phase) for phase in HOST_PHASES)
            )
        return measured / predicted if predicted > 0 else math.nan

    def device_ratio(self, records: list[StepRecord]) -> tuple[float, float]:
        """The device's time in a step log over what this model predicts for the same steps:
        (decode graphs, steps outside them that the device bounded), each a geometric mean
        (1: the device ran as profiled; a GPU whose clock differs, e.g. at its power limit
        more or less often than the profile saw, reads otherwise); nan where no step fits."""
        logs: tuple[list, list] = ([], [])
        for r in records:
            if not (r.forward and r.num_tokens):
                continue
            predicted = self.forward_time(BatchShape.of_record(r))
            if r.eager and not _device_bound(r, predicted / self._eager_served):
                continue
            if predicted > 0:
                logs[r.eager].append(math.log(r.forward / predicted))
        return tuple(math.exp(sum(x) / len(x)) if x else math.nan for x in logs)

    def _check(
        self,
        what: str,
        value: float,
        limit: float,
        then: str = "the time is extrapolated (profile the engine with a larger configuration)",
    ) -> None:
        if value > _FAR * limit and what not in self._warned:
            self._warned.add(what)
            warnings.warn(
                f"nano-sim: {what} {value:,.0f} is far beyond the profile's {limit:,.0f}; {then}",
                RuntimeWarning,
                stacklevel=3,
            )


def _device_bound(record: StepRecord, grid: float) -> bool:
    """Whether the device bounded an eager step of ``grid`` seconds on the grid: its launch
    took less than half that (the device did not wait for the host)."""
    return grid > 0 and record.launch < 0.5 * grid


class DecodeGraphModel:
    """CUDA-graph decode forwards: per captured size, interpolated over the batch's total
    context; between profiled sizes, interpolated over the size."""

    def __init__(self, points: list[GridPoint]) -> None:
        by_size: dict[int, list[tuple[float, float]]] = {}
        for p in points:
            by_size.setdefault(p.num_decodes, []).append(
                (p.num_decodes * p.decode_context, p.seconds)
            )
        self.sizes = sorted(by_size)
        self.curves = {s: Piecewise(_distinct(by_size[s])) for s in self.sizes}
        self.max_context = max(p.decode_context for p in points)

    def __call__(self, size: int, context: int) -> float:
        curve = self.curves.get(size)
        if curve is not None:
            return curve(context)
        sizes = self.sizes
        i = bisect_left(sizes, size)
        if i == 0 or len(sizes) == 1:
            return self.curves[sizes[0 if i == 0 else -1]](context)
        lo, hi = (sizes[-2], sizes[-1]) if i == len(sizes) else (sizes[i - 1], sizes[i])
        a, b = self.curves[lo](context), self.curves[hi](context)
        return max(a, a + (b - a) * (size - lo) / (hi - lo))  # (past the last: its trend)


def _distinct(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """One point per x (the mean of repeated measurements)."""
    groups: dict[float, list[float]] = {}
    for x, y in points:
        groups.setdefault(x, []).append(y)
    return [(x, sum(ys) / len(ys)) for x, ys in groups.items()]


class EagerModel:
    """Eager forwards: t = sum_k c_k f_k(batch) with every c_k >= 0, fitted on relative error.

    Features: a constant; the step's tokens and ramps max(0, tokens - knot) at the profiled
    token counts (a convex piecewise-linear matmul cost; with piecewise CUDA graphs, ``sizes``,
    the tokens padded to the graph that runs them); each chunk's attention pairs weighted
    by hat functions of log(chunk length) (short chunks use the tensor cores worse); keys read
    by chunks; chunks; decodes; decode context.
    """

    def __init__(self, points: list[GridPoint], sizes: list[int] = ()) -> None:
        self.sizes = list(sizes)
        tokens = sorted({self.padded(p.num_tokens) for p in points})
        self.token_knots = _thin(tokens[:-1], 12)
        lengths = sorted({n for p in points for n, _ in p.prefills}) or [1]
        self.length_knots = _geometric(lengths[0], lengths[-1], 8.0)
        self.max_tokens = tokens[-1]
        self.max_cached = max((c for p in points for _, c in p.prefills), default=0) or 1
        rows = [
            self.features(p.prefills, p.num_decodes, p.num_decodes * p.decode_context)
            for p in points
        ]
        times = [p.seconds for p in points]
        self.coef = nnls(rows, times, [1 / t**2 for t in times])
        self.floor = min(times) / 2

    def padded(self, tokens: int) -> int:
        """The tokens a step's matmuls compute: padded to its piecewise graph's size."""
        if not self.sizes or tokens > self.sizes[-1]:
            return tokens
        return self.sizes[bisect_left(self.sizes, tokens)]

    def features(self, prefills, num_decodes: int, decode_context: int) -> list[float]:
        t = self.padded(sum(n for n, _ in prefills) + num_decodes)
        f = [1.0, t]
        f += [t - k if t > k else 0.0 for k in self.token_knots]
        pairs = [0.0] * len(self.length_knots)
        keys = 0
        for n, cached in prefills:
            p = n * cached + n * (n + 1) / 2
            for j, w in enumerate(log_hats(n, self.length_knots)):
                if w:
                    pairs[j] += w * p
            keys += cached + n
        f += pairs
        f += [keys, len(prefills), num_decodes, decode_context]
        return f

    def __call__(self, prefills, num_decodes: int, decode_context: int) -> float:
        f = self.features(prefills, num_decodes, decode_context)
        return max(self.floor, sum(c * x for c, x in zip(self.coef, f)))


def _thin(values: list[int], most: int) -> list[int]:
    """At most ``most`` of ascending values, spread evenly in log scale."""
    if len(values) <= most:
        return values
    lo, hi = math.log(values[0]), math.log(values[-1])
    picked = []
    for k in range(most):
        target = math.exp(lo + (hi - lo) * k / (most - 1))
        best = min(values, key=lambda v: abs(math.log(v) - math.log(target)))
        if best not in picked:
            picked.append(best)
    return sorted(picked)


def _geometric(lo: float, hi: float, ratio: float) -> list[float]:
    knots = [float(lo)]
    while knots[-1] * ratio < hi:
        knots.append(knots[-1] * ratio)
    if hi > knots[-1]:
        knots.append(float(hi))
    return knots


class HostModel:
    """The loop's host time per phase, each a non-negative linear fit over step records. The
    launch is fitted apart for CUDA-graph steps (a replay) and eager ones (every kernel of the
    model launched, tens of milliseconds on a GPU, and varying widely from step to step: an
    eager launch takes its fit times a ratio drawn from those measured, scaled to a mean of 1,
    so the simulation sees the spread too, around the fit. Unscaled, the ratios' mean was
    1.12 on an H200: a tail of slow launches under the profile's bursts of requests, which
    put nano-sim's eager launches 15-20% above what trace replays measured)."""

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
        self.launch_graph = self._fit(graphs, self._launch_features, 1) if graphs else None
        self.launch_eager = self._fit(eager, self._launch_features, 1) if eager else None
        self._spread = [1.0]
        if eager:
            fitted = [self._dot(self.launch_eager, self._launch_features(r)) for r in eager]
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
        launch = self._dot(coef, row)
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


def server_costs(records: list[StepRecord], server: dict) -> ServerCosts:
    """The server's event-loop costs, from its thread's CPU time in the engine's step log. A
    pass over the streams follows each publication of outputs: its cost by the number of
    streams is the mean over iterations that took no request in, in bins of the number, made
    non-decreasing (it grows faster than linearly: caches). A request's handling: its cost per
    request and per prompt token, fitted to what the passes leave of the event loop's CPU time
    from each iteration to the next, by the requests (and their prompt tokens) accepted in it,
    over the workloads whose requests were sent one by one over time, as a trace sends them.
    A burst sent at once costs less a request (one wake-up of the event loop serves many),
    and mixed in, it made the fit put everything on the tokens: 0 ms + 3.0-3.9 us a token on
    an H200, where the spread-out requests measure 1.1-1.4 ms + 1.2-1.7 us, as replayed
    traces do. (A profile whose workloads do not say how they were sent: all of them but the
    first, a cold start.) The ways in and out of the workload sent at the lowest rate give the
    network's latency, a pass's relay before its first chunk and a request's hop from the
    front to the engine's process (``_way_out``, ``_hop``)."""
    if not any(r.server_cpu_at is not None for r in records):
        raise ValueError(
            "the profile lacks the server's event-loop measurements (profiled with "
            "--no-server?): use --frontend offline, or profile through the server"
        )
    # The pass over an iteration's outputs runs once they are published, mostly before the
    # next iteration begins: the event loop's CPU from one iteration's start to the next's.
    bins: dict[int, list[tuple[int, float]]] = {}
    for a, b in pairwise(records):
        if a.outputs and not a.accepted and not b.accepted and b.server_cpu_at is not None:
            cpu = b.server_cpu_at - a.server_cpu_at
            bins.setdefault(int(math.log2(a.outputs) * 2), []).append((a.outputs, cpu))
    points = [
        (sum(n for n, _ in group) / len(group), sum(c for _, c in group) / len(group), len(group))
        for _, group in sorted(bins.items())
        if len(group) >= 3
    ]
    if not points:
        raise ValueError("the profile's server measurements hold no pass over the streams")
    passes = Piecewise(increasing(points))
    own = bool(server.get("engine_process", False))
    request, prompt_token, busy = _request_costs(
        records, server.get("workloads", []), passes, shared=not own
    )
    first = float(server.get("first_request_s") or 0.0)
    ingress, egress = _calmest(server)
    latency, relay = _way_out(egress, server.get("egress", []), passes)
    # (an engine in the front's process has a request once the front handled it)
    hop, hop_token = _hop(ingress, latency, request, prompt_token) if own else (0.0, 0.0)
    points = tuple(zip(passes.xs, passes.ys))
    return ServerCosts(
        request, prompt_token, points, latency, first, busy, own, hop, hop_token, relay
    )


def _calmest(server: dict) -> tuple[list, list]:
    """The ingress and egress samples of the workload sent at the lowest rate over time (of
    10 requests at least), where a request seldom waits behind others: the samples follow
    the workloads' order. None ([], []) where the profile cannot say which workload a sample
    is from, or sent every workload at once: a burst's samples queued, and the simulation
    queues its requests itself."""
    ingress, egress = server.get("ingress", []), server.get("egress", [])
    workloads = server.get("workloads", [])
    if any(len(w) < 6 for w in workloads) or sum(int(w[2]) for w in workloads) != len(ingress):
        return [], []
    spans, start = [], 0
    for w in workloads:
        if w[5] > 0 and w[2] >= 10:
            spans.append((w[2] / w[5], start, start + int(w[2])))
        start += int(w[2])
    if not spans:
        return [], []
    _, first, end = min(spans)
    # (a sample for each request with a first token: aligned where every request has one)
    return ingress[first:end], egress[first:end] if len(egress) == len(ingress) else []


def _hop(ingress: list, latency: float, request: float, prompt_token: float) -> tuple[float, float]:
    """The way in that the front's handling and the network leave: seconds and seconds per
    prompt token, a median's fit (least absolute deviations) of each request's way in (sent
    -> the engine has it) less the network's latency and its handling."""
    if len(ingress) < 10:
        return 0.0, 0.0
    rows = [[1.0, float(tokens)] for tokens, _ in ingress]
    left = [s - latency - request - prompt_token * tokens for tokens, s in ingress]
    hop, per_token = nnlad(rows, left)
    return hop, per_token


def _way_out(calm: list, egress: list, passes: Piecewise) -> tuple[float, float]:
    """The network's latency, and the share of a pass over n streams spent before its first
    chunk goes out (the relay), from the first tokens' way out (published -> received) in the
    calmest workload: a median's fit of way out - one stream's chunk = latency + relay x the
    rest of the pass (latency + relay x pass(n) + (1 - relay) x pass(n) / n for a stream
    first in its pass, as a new one is), where 10 of them at least came with other streams;
    else the latency alone, from the lone first tokens (their median less a pass over one
    stream: the calmest workload's, else all of them), and no relay."""
    calm = [(n, seconds) for n, seconds in calm if n >= 1]
    if sum(n >= 2 for n, _ in calm) >= 10:  # (relay: CPU time, the way out: wall; at most 1)
        rows = [[1.0, passes(n) - passes(n) / n] for n, _ in calm]
        left = [seconds - passes(n) / n for n, seconds in calm]
        latency, relay = nnlad(rows, left)
        return latency, min(1.0, relay)
    lone = sorted(seconds for n, seconds in calm if n == 1) or sorted(
        seconds for n, seconds in egress if n == 1
    )
    return (max(0.0, lone[len(lone) // 2] - passes(1)) if lone else 0.0), 0.0


def _request_costs(
    records: list[StepRecord], workloads: list, passes, shared: bool = True
) -> tuple[float, float, float]:
    """The event loop's handling of a request: seconds per request and per prompt token, and
    how much more it costs while the loop thread computes (``ServerCosts.busy``). Fitted on
    the event loop's CPU seconds of each iteration less its passes, as (requests, prompt
    tokens) times 1 + busy x the share of the iteration the loop thread computed (its CPU
    seconds over the iteration's; 0 where the log has none), ``busy`` the best of a grid
    (0 where the two do not share an interpreter: not ``shared``)."""
    spread = [w for w in workloads if len(w) > 5 and w[5] > 0]
    rows, residual, shares = [], [], []
    for first, end, *_ in spread or workloads[1:]:
        first, end = int(first), min(int(end), len(records) - 1)
        for a, b in pairwise(records[first : end + 1]):
            if a.server_cpu_at is None or b.server_cpu_at is None:
                continue
            cpu = b.server_cpu_at - a.server_cpu_at - (passes(a.outputs) if a.outputs else 0.0)
            rows.append((b.accepted, b.accepted_tokens or 0))
            residual.append(cpu)
            shares.append(min(1.0, sum(a.cpu) / (b.t - a.t)) if a.cpu and b.t > a.t else 0.0)
    if not any(accepted for accepted, _ in rows):
        return 0.0, 0.0, 0.0
    best = None
    for busy in [i / 20 for i in range(41)] if shared and any(shares) else [0.0]:
        scaled = [[n * (1 + busy * s), t * (1 + busy * s)] for (n, t), s in zip(rows, shares)]
        coef = nnls(scaled, residual)
        error = sum((coef[0] * x + coef[1] * y - r) ** 2 for (x, y), r in zip(scaled, residual))
        if best is None or error < best[0]:
            best = (error, coef[0], coef[1], busy)
    return best[1], best[2], best[3]
