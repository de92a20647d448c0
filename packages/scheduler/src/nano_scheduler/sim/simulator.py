"""Discrete-event simulation of a serving engine on a virtual clock.

The very same ``Scheduler`` and ``BlockManager`` as the real engine decide every step; a
``CostModel`` says how long the step takes on the GPU; the clock jumps by that much (or to the
next arrival when idle). Sampled tokens never stop a request early: each produces exactly its
output length, as with ignore_eos.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable

from nano_kvcache import BlockManager
from nano_scheduler.config import SchedulerConfig
from nano_scheduler.sampling_params import SamplingParams
from nano_scheduler.scheduler import Scheduler
from nano_scheduler.sequence import Sequence
from nano_scheduler.sim.cost_model import BatchShape, CostModel
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
    ) -> None:
        if not requests:
            raise ValueError("the workload is empty")
        # In arrival order; records and rejections name each request by its index in ``requests``.
        self._index = sorted(range(len(requests)), key=lambda i: requests[i].arrival_time)
        self.requests = [requests[i] for i in self._index]
        self.cost_model = cost_model
        self.config = config
        self.seed = seed
        self.now = 0.0
        self.block_manager = BlockManager(num_blocks, block_size, enable_prefix_caching)
        self.scheduler = Scheduler(config, self.block_manager, clock=lambda: self.now)

    def run(self, progress: Callable[[int, int], None] | None = None) -> SimResult:
        """Simulate until every request has finished; ``progress(done, total)`` after each."""
        sched, bm, requests = self.scheduler, self.block_manager, self.requests
        records: list[RequestRecord] = []
        rejected: list[tuple[int, str]] = []
        itl = array("d")
        last_token_time: dict[int, float] = {}
        timeline = Timeline()
        next_arrival, num_steps = 0, 0
        while next_arrival < len(requests) or sched.has_unfinished():
            if not sched.has_unfinished():
                self.now = max(self.now, requests[next_arrival].arrival_time)
            while next_arrival < len(requests) and requests[next_arrival].arrival_time <= self.now:
                self._add(next_arrival, rejected)
                next_arrival += 1
            if not sched.has_unfinished():
                continue
            out = sched.schedule()
            self.now += self.cost_model.step_time(BatchShape.of(out))
            sampling = out.sampling_seqs
            finished = sched.update(out, [_SAMPLED_TOKEN] * len(sampling))
            num_steps += 1
            now = self.now
            for seq in sampling:
                previous = last_token_time.get(seq.seq_id)
                if previous is not None:
                    itl.append(now - previous)
                last_token_time[seq.seq_id] = now
            timeline.record(
                now,
                out.num_seqs,
                out.num_batched_tokens,
                bm.usage,
                len(sched.running),
                len(sched.waiting),
            )
            for seq in finished:
                last_token_time.pop(seq.seq_id, None)
                records.append(RequestRecord.of(seq))
                if progress is not None:
                    progress(len(records), len(requests))
        return SimResult(
            records, rejected, itl, timeline, num_steps, sched.num_preemptions, bm.stats().hit_rate
        )

    def _add(self, position: int, rejected: list[tuple[int, str]]) -> None:
        req, index = self.requests[position], self._index[position]
        params = SamplingParams(max_tokens=req.output_len, ignore_eos=True)
        seq = Sequence(index, req.token_ids(index, self.seed), params, req.arrival_time)
        try:
            self.scheduler.add(seq)
        except ValueError as e:
            rejected.append((index, str(e)))
