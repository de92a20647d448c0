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

from array import array
from collections.abc import Callable

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

    def run(self, progress: Callable[[int, int], None] | None = None) -> SimResult:
        """Simulate until every request has finished; ``progress(done, total)`` after each."""
        sched, bm, cost = self.scheduler, self.block_manager, self.cost_model
        total = len(self.requests)
        records: list[RequestRecord] = []
        rejected: list[tuple[int, str]] = []
        itl = array("d")
        first_token: dict[int, float] = {}
        last_token: dict[int, float] = {}
        ended_seqs: dict[int, Sequence] = {}  # finished, their last output not received yet

        def receive(seq_id: int, when: float, finished: bool) -> None:
            previous = last_token.get(seq_id)
            if previous is None:
                first_token[seq_id] = when
            else:
                itl.append(when - previous)
            last_token[seq_id] = when
            if finished:
                seq = ended_seqs.pop(seq_id)
                records.append(self._record(seq, first_token, when))
                del last_token[seq_id]
                if progress is not None:
                    progress(len(records), total)

        host = ServerHost(self.server, receive) if self.server else OfflineHost(receive)
        for position, req in enumerate(self.requests):
            host.send(req.arrival_time, position, req.prompt_len)
        timeline = Timeline()
        sync_device, overlap = cost.synchronous, self.async_scheduling
        t = device_free = 0.0  # the loop thread's clock; when the device's queued work ends
        in_flight: tuple[PendingStep, float] | None = None  # a launched step, its device end
        added = num_steps = 0
        while added < total or sched.has_unfinished() or in_flight is not None:
            if in_flight is None and not sched.has_unfinished():
                t = host.next_accept(t)  # idle until the next request is in
            for position in host.accepted(t):
                self._add(position, rejected)
                added += 1
            if overlap and not sync_device and in_flight is not None and not sched.waiting:
                clocks = self._steady_decodes(host, in_flight, t, device_free, timeline)
                if clocks is not None:
                    t, device_free, in_flight, steps = clocks
                    num_steps += steps
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
                num_steps += 1
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
            if outputs:
                for seq in done:
                    ended_seqs[seq.seq_id] = seq
                streams = [(s.seq_id, s.is_finished and s in done) for s in resolved]
                for seq in ended:
                    ended_seqs[seq.seq_id] = seq
                    streams.append((seq.seq_id, True))
                host.publish(t, streams)
            if step is not None:
                timeline.record(
                    t,
                    out.num_seqs,
                    out.num_batched_tokens,
                    bm.usage,
                    len(sched.running),
                    len(sched.waiting),
                )
        host.drain(t)
        return SimResult(
            records, rejected, itl, timeline, num_steps, sched.num_preemptions, bm.stats().hit_rate
        )

    def _steady_decodes(self, host, in_flight, t: float, device_free: float, timeline):
        """Run, without the scheduler, the iterations that would repeat the step in flight
        unchanged: its decodes are every running sequence, none of them ends or needs a block
        or fills one, no request comes in (so the scheduler would decide the same). The host
        and the device do the same work as in the loop; the sequences get their tokens at
        once after. None when fewer than two such iterations lie ahead; else the clocks, the
        step now in flight and the number of steps (one at least)."""
        pending, device_end = in_flight
        out, running = pending.output, self.scheduler.running
        seqs = out.decodes
        if out.prefills or pending.finished or len(seqs) != len(running) or not seqs:
            return None
        block_size = self.block_manager.block_size
        steps = 1 << 30
        for seq in seqs:  # (each holds the step in flight's placeholder as its last token)
            length = len(seq.token_ids)
            room = min(
                block_size - 1 - (length - 1) % block_size,  # lengths that end no block
                len(seq.block_table) * block_size - length + 1,  # lengths its blocks hold
                seq.max_num_tokens - length - 1,  # before it reaches its length limit
            )
            if room < steps:
                steps = room
                if steps < 2:
                    return None
        if seqs[0] is not running[0] or any(a is not b for a, b in zip(seqs, running)):
            return None
        cost = self.cost_model
        batch = BatchShape([], [len(s.token_ids) for s in seqs], len(seqs), len(seqs), 0)
        step = cost.step_cost(batch)
        eager = cost.is_eager(batch)
        n = len(seqs)
        post, publish = cost.resolve_cost(n, 0, n)
        streams = [(seq.seq_id, False) for seq in seqs]
        usage = self.block_manager.usage
        cpu, free, publish_to, record, accepted_by = (
            host.cpu,
            host.free,
            host.publish,
            timeline.record,
            host.accepted_by,
        )
        launch, resolve_and_sample = step.schedule + step.launch, post + step.sample_host
        forward, sample = step.forward, step.sample
        done = 0
        while done < steps:
            if done and accepted_by(t):  # (the loop takes a request in here)
                break
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
            record(t, n, n, usage, n, 0)
            done += 1
        # The scheduler's state after those steps: the placeholder of the step that was in
        # flight and done - 1 more tokens known, the last step's token in flight.
        self.now = t
        slots = []
        for row, seq in enumerate(seqs):
            tokens = seq.token_ids
            tokens[-1] = _SAMPLED_TOKEN
            tokens.extend([_SAMPLED_TOKEN] * (done - 1))
            seq.num_computed_tokens = len(tokens)
            tokens.append(PENDING_TOKEN)
            slots.append((row, seq, len(tokens) - 1))
        advanced = PendingStep(SchedulerOutput(decodes=list(seqs), num_batched_tokens=n), slots, [])
        return t, device_free, (advanced, device_end), done

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
