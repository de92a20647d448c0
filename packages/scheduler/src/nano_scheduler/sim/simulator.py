"""Discrete-event simulation of a serving engine on a virtual clock.

The very same ``Scheduler`` and ``BlockManager`` as the real engine decide every step, called
in the order of the engine's step loop; a ``CostModel`` says how long each phase of the step
takes on the host and on the device, and the simulator overlaps them as the loop does. With
async scheduling, iteration k schedules and launches step k, then waits for step k-1's tokens,
resolves and publishes them, then launches step k's sampling: the device runs step k while the
host works, and a request that arrives while the device runs step k-1 is admitted by iteration
k+1, whose step runs after step k. Without it, an iteration runs its own step to the end.

The loop thread's host work runs through a host (``nano_scheduler.sim.host``): alone (the
Python API), or beside the HTTP server's event loop (``server``), which takes requests in and
streams outputs out and shares the interpreter lock with the loop thread; records are then in
the client's times. Sampled tokens never stop a request early: each produces exactly its
output length, as with ignore_eos.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Callable, Iterator

from nano_kvcache import BlockManager
from nano_scheduler.config import SchedulerConfig
from nano_scheduler.sampling_params import SamplingParams
from nano_scheduler.scheduler import PENDING_TOKEN, PendingStep, Scheduler, SchedulerOutput
from nano_scheduler.sequence import Sequence
from nano_scheduler.sim.cost_model import BatchShape, CostModel
from nano_scheduler.sim.host import OfflineHost, ServerCosts, ServerHost
from nano_scheduler.sim.metrics import RequestRecord, SimResult, Timeline
from nano_scheduler.sim.workload import Request

_SAMPLED_TOKEN = 1  # what the simulated model emits (requests stop on length, never on a token)


class Simulator:
    """One engine (its scheduler, block manager and loop) on the virtual clock. ``run``
    simulates a whole workload; a fleet of them (``nano_scheduler.sim.fleet``) is driven
    iteration by iteration through ``iterations``, with requests sent as they are routed."""

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
        server: ServerCosts | None = None,
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
        self.server = server
        self.now = 0.0
        self.block_manager = BlockManager(num_blocks, block_size, enable_prefix_caching)
        self.scheduler = Scheduler(config, self.block_manager, clock=lambda: self.now)
        self.host = ServerHost(server, self._receive) if server else OfflineHost(self._receive)
        # Iterations never fast-forward past this time (a fleet's next arrival, which may
        # be routed here).
        self.horizon = math.inf
        # (seconds, [(seq_id, finished)]) of each step's outputs as the loop publishes them,
        # and the index of a request the scheduler refused: a fleet's router follows both.
        self.on_publish: Callable[[float, list[tuple[int, bool]]], None] | None = None
        self.on_reject: Callable[[int], None] | None = None
        self.records: list[RequestRecord] = []
        self.rejected: list[tuple[int, str]] = []
        self.itl = array("d")
        self.timeline = Timeline()
        self.num_steps = 0
        self._first_token: dict[int, float] = {}  # received
        self._last_token: dict[int, float] = {}
        self._accepted: dict[int, float] = {}  # when the engine had each request
        self._first_published: dict[int, float] = {}  # when its loop published its first token
        self._ended: dict[int, Sequence] = {}  # finished, their last output not received yet
        self._progress: Callable[[int, int], None] | None = None

    def run(self, progress: Callable[[int, int], None] | None = None) -> SimResult:
        """Simulate until every request has finished; ``progress(done, total)`` after each."""
        self._progress = (lambda done: progress(done, len(self.requests))) if progress else None
        for position in range(len(self.requests)):
            self.send(position)
        for t in self.iterations():
            if t == math.inf:
                break
        return self.result()

    def send(self, position: int) -> None:
        """Send the request at ``position`` (in arrival order) at its arrival time."""
        req = self.requests[position]
        self.host.send(req.arrival_time, position, req.prompt_len)

    def result(self) -> SimResult:
        t = self.host.drain(self.now)
        self.now = max(self.now, t)
        return SimResult(
            self.records,
            self.rejected,
            self.itl,
            self.timeline,
            self.num_steps,
            self.scheduler.num_preemptions,
            self.block_manager.stats().hit_rate,
        )

    def _receive(self, seq_id: int, when: float, finished: bool) -> None:
        previous = self._last_token.get(seq_id)
        if previous is None:
            self._first_token[seq_id] = when
        else:
            self.itl.append(when - previous)
        self._last_token[seq_id] = when
        if finished:
            seq = self._ended.pop(seq_id)
            self.records.append(self._record(seq, self._first_token, when))
            del self._last_token[seq_id]
            if self._progress is not None:
                self._progress(len(self.records))

    def _publish(self, t: float, streams: list[tuple[int, bool]]) -> None:
        self.host.publish(t, streams)
        if self.on_publish is not None:
            self.on_publish(t, streams)

    def iterations(self) -> Iterator[float]:
        """The engine's loop, one iteration per item: the clock where the next iteration
        starts (requests sent by then are taken in first), or inf while nothing is accepted
        and nothing is on its way (the loop idles until a request is sent)."""
        sched, bm, cost, host = self.scheduler, self.block_manager, self.cost_model, self.host
        timeline = self.timeline
        sync_device, overlap = cost.synchronous, self.async_scheduling
        t = device_free = 0.0  # the loop thread's clock; when the device's queued work ends
        in_flight: tuple[PendingStep, float] | None = None  # a launched step, its device end
        while True:
            if in_flight is None and not sched.has_unfinished():
                nxt = host.next_accept(t)  # idle until the next request is in
                if nxt == math.inf:
                    yield nxt
                    continue
                t = nxt
            self.now = t
            yield t
            for when, position in host.accepted(t):
                self._add(position, when)
                t = host.cpu(t, cost.intake_cost(self.requests[position].prompt_len))
            if overlap and not sync_device and in_flight is not None and not sched.waiting:
                clocks = self._steady_decodes(host, in_flight, t, device_free, timeline)
                if clocks is not None:
                    t, device_free, in_flight, steps = clocks
                    self.num_steps += steps
                    continue
            self.now = t
            out = sched.schedule() if sched.has_unfinished() else None
            ended = out.finished if out is not None else []  # no room to go on
            resolved: list[Sequence] = []  # sequences with a token to publish
            done: list[Sequence] = []  # those of them that ended with it
            step = None
            if out is not None and (out.prefills or out.decodes):
                batch = BatchShape.of(out, len(sched.running), len(sched.waiting))
                step = cost.step_cost(batch)
                start = t
                t = host.cpu(t, step.schedule + step.launch)
                if sync_device:  # (the device's work is the thread's, without the lock)
                    t = forward_end = host.free(t, t + step.forward)
                elif cost.is_eager(batch):  # (kernels start as they are launched)
                    begin = max(start + step.schedule, t - step.launch)
                    forward_end = max(max(device_free, begin) + step.forward, t)
                else:  # a CUDA graph starts once its inputs are in and it is replayed
                    forward_end = max(device_free, t) + step.forward
            # The loop thread's work after the launch, in its order: resolve the step in
            # flight (async) or this one, launch the sampling, publish the outputs.
            pending = None
            if in_flight is not None:
                pending, device_end = in_flight
                in_flight = None
                t = host.free(t, device_end)
                resolved, done = self._resolve(pending, out)
            outputs = len(resolved) + len(ended)
            post, publish = cost.resolve_cost(len(resolved), len(done), outputs)
            if step is not None:
                t = host.cpu(t, (post if pending is not None else 0.0) + step.sample_host)
                if sync_device:
                    t = device_end = host.free(t, t + step.sample)
                else:
                    device_end = device_free = max(forward_end, t) + step.sample
                self.now = t
                advanced = sched.advance(out)
                self.num_steps += 1
                if overlap:
                    in_flight = (advanced, device_end)
                else:
                    t = host.free(t, device_end)
                    resolved, done = self._resolve(advanced, None)
                    outputs = len(resolved) + len(ended)
                    post, publish = cost.resolve_cost(len(resolved), len(done), outputs)
                    t = host.cpu(t, post)
            elif pending is not None:
                t = host.cpu(t, post)
            t = host.cpu(t, publish)
            self.now = t
            if outputs:
                for seq in done:
                    self._ended[seq.seq_id] = seq
                streams = [(s.seq_id, s.is_finished and s in done) for s in resolved]
                published = self._first_published
                for seq_id, _ in streams:
                    if seq_id not in published:
                        published[seq_id] = t
                for seq in ended:
                    self._ended[seq.seq_id] = seq
                    streams.append((seq.seq_id, True))
                self._publish(t, streams)
            if step is not None:
                timeline.record(
                    t,
                    out.num_seqs,
                    out.num_batched_tokens,
                    bm.usage,
                    len(sched.running),
                    len(sched.waiting),
                )
                t = host.cpu(t, step.between)

    def _steady_decodes(self, host, in_flight, t: float, device_free: float, timeline):
        """Run, without the scheduler, the iterations that would repeat the step in flight
        with one more token each: its decodes are every running sequence, none of them ends
        and the free blocks cover the ones they grow into, no request comes in (so the
        scheduler would decide the same). The host and the device do the same work as in the
        loop (the step's cost taken again every block's worth of steps, as the contexts grow);
        the sequences get their tokens and blocks at once after. None when fewer than two such
        iterations lie ahead; else the clocks, the step now in flight and the number of steps
        (one at least)."""
        pending, device_end = in_flight
        out, running = pending.output, self.scheduler.running
        seqs = out.decodes
        if out.prefills or pending.finished or len(seqs) != len(running) or not seqs:
            return None
        # (each holds the step in flight's placeholder as its last token; step j of the run
        # schedules its length + j - 1 tokens, and finishes it at its length + j)
        lengths = [len(seq.token_ids) for seq in seqs]
        steps = min(seq.max_num_tokens - length for seq, length in zip(seqs, lengths)) - 1
        if steps < 2:
            return None
        if seqs[0] is not running[0] or any(a is not b for a, b in zip(seqs, running)):
            return None
        bm = self.block_manager
        grows = self._block_steps(seqs, lengths, steps)
        if len(grows) > bm.num_free_blocks:  # (the step that would run out preempts)
            steps = min(steps, grows[bm.num_free_blocks][0] - 1)
            if steps < 2:
                return None
        cost, n, block_size = self.cost_model, len(seqs), bm.block_size
        post, publish = cost.resolve_cost(n, 0, n)
        streams = [(seq.seq_id, False) for seq in seqs]
        used, num_blocks = bm.num_used_blocks, bm.num_blocks
        cpu, free, accepted_by = host.cpu, host.free, host.accepted_by
        quiet = host.quiet_until()  # (no request comes in before: none to look for)
        publish_to = host.publish if self.on_publish is None else self._publish
        horizon = self.horizon
        done = grown = 0
        times: list[float] = []  # (the timeline's rows of the run's steps)
        usages: list[float] = []
        while done < steps:
            if done and ((t >= quiet and accepted_by(t)) or t >= horizon):
                break  # (a request may come in here)
            if not done % block_size:
                batch = BatchShape([], [length + done for length in lengths], n, n, 0)
                step, eager = cost.step_cost(batch), cost.is_eager(batch)
                launch, resolve_and_sample = step.schedule + step.launch, post + step.sample_host
                forward, sample, between = step.forward, step.sample, step.between
            start = t
            t = cpu(t, launch)
            if eager:
                begin = max(start + step.schedule, t - step.launch)
                forward_end = max(max(device_free, begin) + forward, t)
            else:
                forward_end = max(device_free, t) + forward
            t = free(t, device_end)
            t = cpu(t, resolve_and_sample)
            device_end = device_free = max(forward_end, t) + sample
            t = cpu(t, publish)
            publish_to(t, streams)
            done += 1
            while grown < len(grows) and grows[grown][0] <= done:
                grown += 1
            times.append(t)
            usages.append((used + grown) / num_blocks)
            t = cpu(t, between)
        timeline.record_run(times, usages, n, n, n, 0)
        # The scheduler's state after those steps: the placeholder of the step that was in
        # flight and done - 1 more tokens known, the blocks that hold them as the steps'
        # scheduling and resolving left them, the last step's token in flight.
        self.now = t
        self._replay_blocks(seqs, lengths, done, grows)
        slots = []
        for row, (seq, length) in enumerate(zip(seqs, lengths)):
            tokens = seq.token_ids
            tokens[length - 1 :] = array("q", [_SAMPLED_TOKEN]) * done
            seq.num_computed_tokens = len(tokens)
            tokens.append(PENDING_TOKEN)
            slots.append((row, seq, len(tokens) - 1))
        advanced = PendingStep(SchedulerOutput(decodes=list(seqs), num_batched_tokens=n), slots, [])
        return t, device_free, (advanced, device_end), done

    def _block_steps(
        self, seqs: list[Sequence], lengths: list[int], steps: int
    ) -> list[tuple[int, int]]:
        """The steps of a run (1 to ``steps``) at which a sequence takes a new block, as
        (step, row), one per block, in order: step j schedules ``length + j - 1`` tokens (its
        table holds the step in flight's: the first new block comes at step 1 to
        block_size)."""
        block_size = self.block_manager.block_size
        grows = []
        for row, (seq, length) in enumerate(zip(seqs, lengths)):
            first = len(seq.block_table) * block_size - length + 2
            grows.extend((j, row) for j in range(first, steps + 1, block_size))
        grows.sort()
        return grows

    def _replay_blocks(
        self, seqs: list[Sequence], lengths: list[int], done: int, grows: list[tuple[int, int]]
    ) -> None:
        """The block manager's calls of a run's ``done`` steps, in the loop's order (taking a
        block may evict a cached one, whose key a block filled in the run may take over):
        iteration j schedules step j (a sequence whose ``length + j - 1`` tokens, the last a
        placeholder, pass its table takes a block: ``grows``), then resolves step j - 1 (a
        block that its token filled is shared, step j writing past it)."""
        bm, block_size = self.block_manager, self.block_manager.block_size
        # (step, 0: a block taken / 1: a block shared, row)
        events = [(j, 0, row) for j, row in grows if j <= done]
        if bm.enable_prefix_caching:  # (step j's token length + j - 1 ends a block)
            for row, length in enumerate(lengths):
                filled = (1 - length) % block_size or block_size
                events.extend((j, 1, row) for j in range(filled, done + 1, block_size))
            events.sort()
        for j, shared, row in events:
            seq, tokens = seqs[row], seqs[row].token_ids
            n = lengths[row] + j - 1  # (the tokens step j schedules)
            known = len(tokens) - (tokens[-1] == PENDING_TOKEN)
            if known < n:
                tokens[known:] = array("q", [_SAMPLED_TOKEN]) * (n - known)
            if shared:
                bm.commit(seq, n)
            else:
                tokens[n - 1] = PENDING_TOKEN  # (still being sampled when step j is scheduled)
                bm.may_append(seq)
                tokens[n - 1] = _SAMPLED_TOKEN

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
            self._accepted.pop(seq.seq_id, None),
            self._first_published.pop(seq.seq_id, None),
        )

    def _add(self, position: int, accepted: float) -> None:
        req, index = self.requests[position], self._index[position]
        params = SamplingParams(max_tokens=req.output_len, ignore_eos=True)
        seq = Sequence(index, req.token_ids(index, self.seed), params, req.arrival_time)
        self._accepted[index] = accepted
        try:
            self.scheduler.add(seq)
        except ValueError as e:
            self.rejected.append((index, str(e)))
            del self._accepted[index]
            if self.on_reject is not None:
                self.on_reject(index)
