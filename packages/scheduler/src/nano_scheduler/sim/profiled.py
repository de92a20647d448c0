"""The calibrated step-time model: built from an engine profile (``nano-engine profile``), of
the parts in ``device_time``, ``host_time`` and ``server_costs``.

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
import warnings
from bisect import bisect_left

from nano_scheduler.config import cuda_graph_sizes, piecewise_graph_sizes
from nano_scheduler.sim.cost_model import BatchShape, StepCost
from nano_scheduler.sim.device_time import DecodeGraphModel, EagerModel
from nano_scheduler.sim.fit import Piecewise
from nano_scheduler.sim.host_time import HostModel
from nano_scheduler.sim.profile import (
    HOST_PHASES,
    SAMPLING_KINDS,
    Profile,
    StepRecord,
)
from nano_scheduler.sim.server_costs import server_costs

# The sampling kinds whose rows a decode CUDA graph draws itself (the sampler's fused pass).
GRAPH_DRAWN = ("greedy", "random")
_FAR = 1.25  # asked beyond this factor of the profiled range: warn


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
