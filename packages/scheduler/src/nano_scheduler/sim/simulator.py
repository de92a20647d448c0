"""Discrete-event simulation of a serving engine on a virtual clock.

The very same ``Scheduler`` and ``BlockManager`` as the real engine decide every step, called
in the order of the engine's step loop; a ``CostModel`` says how long each phase of the step
takes on the host and on the device, and the simulator overlaps them as the loop does. With
async scheduling, iteration k schedules and launches step k, then waits for step k-1's tokens,
resolves and publishes them, then launches step k's sampling: the device runs step k while the
host works, and a request that arrives while the device runs step k-1 is admitted by iteration
k+1, whose step runs after step k. Without it, an iteration runs its own step to the end.

A ``Frontend`` (the HTTP server) adds the time from a client's send to the engine's accepting
the request (``ingress``) and from an output's publication to the client's receipt
(``egress``); records are in the client's times. Sampled tokens never stop a request early:
each produces exactly its output length, as with ignore_eos.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable
from typing import Protocol

from nano_kvcache import BlockManager
from nano_scheduler.config import SchedulerConfig
from nano_scheduler.sampling_params import SamplingParams
from nano_scheduler.scheduler import PendingStep, Scheduler
from nano_scheduler.sequence import Sequence
from nano_scheduler.sim.cost_model import BatchShape, CostModel
from nano_scheduler.sim.metrics import RequestRecord, SimResult, Timeline
from nano_scheduler.sim.workload import Request

_SAMPLED_TOKEN = 1  # what the simulated model emits (requests stop on length, never on a token)


class Frontend(Protocol):
    """What serving through a frontend adds to each request (seconds)."""

    first_request: float  # extra for the first request (a cold path)

    def ingress(self, prompt_tokens: int) -> float:
        """From the client's send to the engine's accepting the request."""
        ...

    def egress(self, outputs: int) -> float:
        """From an output's publication (with ``outputs`` others) to the client's receipt."""
        ...


class Simulator:
    def __init__(
        self,
        requests: list[Request],
        cost_model: CostModel,
        config: SchedulerConfig,
        num_blocks: int,
        block_size: int = 16,
        enable_prefix_caching: bool = True,
        seed: int = 0,
        *,
        async_scheduling: bool = True,
        frontend: Frontend | None = None,
    ) -> None:
        if not requests:
            raise ValueError("the workload is empty")
        # In arrival order; records and rejections name each request by its index in ``requests``.
        self._index = sorted(range(len(requests)), key=lambda i: requests[i].arrival_time)
        self.requests = [requests[i] for i in self._index]
        self.cost_model = cost_model
        self.config = config
        self.seed = seed
        self.async_scheduling = async_scheduling
        self.frontend = frontend
        self.now = 0.0
        self.block_manager = BlockManager(num_blocks, block_size, enable_prefix_caching)
        self.scheduler = Scheduler(config, self.block_manager, clock=lambda: self.now)

    def _accept_times(self) -> list[float]:
        """When the engine accepts each request (in ``self.requests`` order)."""
        fe = self.frontend
        if fe is None:
            return [r.arrival_time for r in self.requests]
        accept = [r.arrival_time + fe.ingress(r.prompt_len) for r in self.requests]
        accept[0] += fe.first_request
        return accept

    def run(self, progress: Callable[[int, int], None] | None = None) -> SimResult:
        """Simulate until every request has finished; ``progress(done, total)`` after each."""
        sched, bm, cost = self.scheduler, self.block_manager, self.cost_model
        total = len(self.requests)
        accept = self._accept_times()
        order = sorted(range(total), key=accept.__getitem__)
        egress = self.frontend.egress if self.frontend is not None else None
        sync_device, overlap = cost.synchronous, self.async_scheduling
        records: list[RequestRecord] = []
        rejected: list[tuple[int, str]] = []
        itl = array("d")
        first_token: dict[int, float] = {}
        last_token: dict[int, float] = {}
        timeline = Timeline()
        host = device_free = 0.0  # the loop's clock; when the device's queued work ends
        in_flight: tuple[PendingStep, float] | None = None  # a launched step, its device end
        added = num_steps = 0
        while added < total or sched.has_unfinished() or in_flight is not None:
            if in_flight is None and not sched.has_unfinished():
                host = max(host, accept[order[added]])  # idle until the next request
            while added < total and accept[order[added]] <= host:
                self._add(order[added], rejected)
                added += 1
            self.now = t = host
            out = sched.schedule() if sched.has_unfinished() else None
            if out is not None and out.is_empty and not out.finished:
                out = None
            ended = list(out.finished) if out is not None else []  # no room to go on
            resolved: list[Sequence] = []  # sequences with a token to publish
            done: list[Sequence] = []  # those of them that ended with it
            if out is not None and not out.is_empty:
                batch = BatchShape.of(out, len(sched.running), len(sched.waiting))
                step = cost.step_cost(batch)
                begin = t + step.schedule
                t = begin + step.launch
                if sync_device:
                    t += step.forward
                    forward_end = t
                else:
                    forward_end = max(max(device_free, begin) + step.forward, t)
            else:
                step = None
            if in_flight is not None:  # (async scheduling) the previous step's tokens
                pending, device_end = in_flight
                in_flight = None
                t = max(t, device_end)
                resolved, done = self._resolve(pending, out)
                t += cost.resolve_cost(len(resolved), len(done), len(resolved) + len(ended))[0]
            if step is not None:
                t += step.sample_host
                if sync_device:
                    t += step.sample
                    device_end = t
                else:
                    device_end = device_free = max(forward_end, t) + step.sample
                self.now = t
                pending = sched.advance(out)
                num_steps += 1
                if overlap:
                    in_flight = (pending, device_end)
                else:
                    t = max(t, device_end)
                    resolved, done = self._resolve(pending, None)
                    t += cost.resolve_cost(len(resolved), len(done), len(resolved) + len(ended))[0]
            outputs = len(resolved) + len(ended)
            t += cost.resolve_cost(0, 0, outputs)[1]
            host = t
            if outputs:
                receipt = t + (egress(outputs) if egress is not None else 0.0)
                for seq in resolved:
                    sid = seq.seq_id
                    previous = last_token.get(sid)
                    if previous is None:
                        first_token[sid] = receipt
                    else:
                        itl.append(receipt - previous)
                    last_token[sid] = receipt
                for seq in {s.seq_id: s for s in done + ended}.values():
                    records.append(self._record(seq, first_token, receipt))
                    last_token.pop(seq.seq_id, None)
                    if progress is not None:
                        progress(len(records), total)
            if step is not None:
                timeline.record(
                    t,
                    out.num_seqs,
                    out.num_batched_tokens,
                    bm.usage,
                    len(sched.running),
                    len(sched.waiting),
                )
        return SimResult(
            records, rejected, itl, timeline, num_steps, sched.num_preemptions, bm.stats().hit_rate
        )

    def _resolve(self, pending: PendingStep, next_out) -> tuple[list[Sequence], list[Sequence]]:
        """Resolve a step's tokens: the sequences that got one, and those that ended with it."""
        expected = sum(c.samples for c in pending.output.prefills) + len(pending.output.decodes)
        self.scheduler.resolve(pending, [_SAMPLED_TOKEN] * expected, next_out)
        seqs = [seq for _, seq, _ in pending.slots]
        return seqs, [seq for seq in seqs if seq.is_finished]

    def _record(self, seq: Sequence, first_token: dict[int, float], finish: float) -> RequestRecord:
        arrival = seq.arrival_time
        first = first_token.pop(seq.seq_id, finish)
        return RequestRecord(
            seq.seq_id,
            arrival,
            seq.first_scheduled_time if seq.first_scheduled_time is not None else finish,
            first,
            finish,
            seq.num_prompt_tokens,
            seq.num_output_tokens,
            seq.num_preemptions,
            seq.finish_reason.value,
        )

    def _add(self, position: int, rejected: list[tuple[int, str]]) -> None:
        req, index = self.requests[position], self._index[position]
        params = SamplingParams(max_tokens=req.output_len, ignore_eos=True)
        seq = Sequence(index, req.token_ids(index, self.seed), params, req.arrival_time)
        try:
            self.scheduler.add(seq)
        except ValueError as e:
            rejected.append((index, str(e)))
