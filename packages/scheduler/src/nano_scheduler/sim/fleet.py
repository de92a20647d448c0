"""A fleet of data-parallel replicas on one virtual clock: each an engine (``Simulator``: the
real scheduler and block manager, the step-time model, its own host), the requests routed as
they arrive by the server's own router (``nano_scheduler.router``).

The router sees what the server's fleet sees: each request's cost when routed, the tokens a
replica reports as its loop publishes them, the end of each request. The replicas advance in
time order: before a request is routed at its arrival time, every replica has run its
iterations that start earlier, and the router has taken in the outputs published by then.
Each replica's host is the profile's (the HTTP server's event loop beside the engine's loop
with ``server`` costs): the front end's own work of routing and relaying between processes is
not modelled. With the server's event loop, a request routed to a replica whose loop model
has already run past its arrival (within the iteration that was under way) is taken from where
that model is: up to one iteration late. So one replica behind the router can differ from the
engine alone (``Simulator``) by that much; offline (no server costs) they are the same.
"""

from __future__ import annotations

import heapq
import math
from array import array
from collections.abc import Callable

from nano_scheduler.config import SchedulerConfig
from nano_scheduler.router import Router, make_router, request_cost
from nano_scheduler.sim.cost_model import CostModel
from nano_scheduler.sim.host import ServerCosts
from nano_scheduler.sim.metrics import SimResult, Timeline
from nano_scheduler.sim.simulator import Simulator
from nano_scheduler.sim.workload import Request


class FleetSimulator:
    """``replicas`` engines of one configuration behind ``router`` (a policy name of
    ``nano_scheduler.router.ROUTERS``, or a ``Router``). Arguments as ``Simulator``'s."""

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
        replicas: int = 1,
        router: str | Router = "least_tokens",
        async_scheduling: bool = True,
        server: ServerCosts | None = None,
    ) -> None:
        if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
            raise ValueError(f"replicas must be an integer >= 1, got {replicas!r}")
        self.router = (
            make_router(router, replicas, block_size) if isinstance(router, str) else router
        )
        if self.router.num_replicas != replicas:
            raise ValueError(
                f"the router has {self.router.num_replicas} replicas, the fleet {replicas}"
            )
        self.engines = [
            Simulator(
                requests,
                cost_model,
                config,
                num_blocks,
                block_size,
                enable_prefix_caching,
                seed,
                async_scheduling=async_scheduling,
                server=server,
            )
            for _ in range(replicas)
        ]
        self.requests = self.engines[0].requests  # (in arrival order, as each engine has them)
        self._prompt_lens = [r.prompt_len for r in requests]  # (by request index)
        self.routed = [0] * replicas  # requests sent to each replica
        self._published: list[tuple[float, int, list[tuple[int, bool]]]] = []  # a heap
        self._order = 0  # (ties of the heap, in publication order)
        self._started: set[int] = set()  # requests with a first output
        for engine in self.engines:
            engine.on_publish = self._on_publish
            engine.on_reject = self.router.finish

    def run(self, progress: Callable[[int, int], None] | None = None) -> SimResult:
        """Route and simulate every request; ``progress(done, total)`` as requests finish."""
        total = len(self.requests)
        if progress is not None:
            finished = [0]

            def count(_: int) -> None:
                finished[0] += 1
                progress(finished[0], total)

            for engine in self.engines:
                engine._progress = count
        loops = [engine.iterations() for engine in self.engines]
        ready: list[tuple[float, int]] = []  # (clock, replica) of replicas with work
        idle = set(range(len(loops)))
        for replica in range(len(loops)):
            self._advance(loops, replica, ready, idle)
        position = 0
        while True:
            arrival = self.requests[position].arrival_time if position < total else math.inf
            for engine in self.engines:
                engine.horizon = arrival
            if ready and ready[0][0] < arrival:  # (a request arriving at t is taken in at t)
                _, replica = heapq.heappop(ready)
                self._advance(loops, replica, ready, idle)
            elif position < total:
                replica = self._route(position, arrival)
                position += 1
                if replica in idle:
                    self._advance(loops, replica, ready, idle)
            else:
                break
        return self._result()

    def _advance(self, loops, replica: int, ready: list, idle: set[int]) -> None:
        """Run ``replica``'s loop to the start of its next iteration."""
        t = next(loops[replica])
        if t == math.inf:
            idle.add(replica)
        else:
            idle.discard(replica)
            heapq.heappush(ready, (t, replica))

    def _route(self, position: int, arrival: float) -> int:
        self._catch_up(arrival)
        req = self.requests[position]
        index = self.engines[0]._index[position]
        ids = req.token_ids(index, self.engines[0].seed) if self.router.reads_prompts else ()
        replica = self.router.route(index, ids, request_cost(req.prompt_len, 1, req.output_len))
        self.routed[replica] += 1
        self.engines[replica].send(position)
        return replica

    def _on_publish(self, t: float, streams: list[tuple[int, bool]]) -> None:
        self._order += 1
        heapq.heappush(self._published, (t, self._order, streams))

    def _catch_up(self, t: float) -> None:
        """The router takes in every output published by ``t``: a first output of a request
        is its prompt and one token, any other one token."""
        published, router, started = self._published, self.router, self._started
        while published and published[0][0] <= t:
            for request, finished in heapq.heappop(published)[2]:
                if finished:
                    router.finish(request)
                    started.discard(request)
                elif request in started:
                    router.progress(request, 1)
                else:
                    started.add(request)
                    router.progress(request, self._prompt_lens[request] + 1)

    def _result(self) -> SimResult:
        parts = [engine.result() for engine in self.engines]
        timeline = Timeline()
        rows = sorted(
            (row for part in parts for row in zip(*_columns(part.timeline))), key=lambda r: r[0]
        )
        for row in rows:
            timeline.record(*row)
        hits = sum(e.block_manager.hit_tokens for e in self.engines)
        queried = hits + sum(e.block_manager.miss_tokens for e in self.engines)
        itl = array("d")
        for part in parts:
            itl.extend(part.itl)
        return SimResult(
            [r for part in parts for r in part.requests],
            [r for part in parts for r in part.rejected],
            itl,
            timeline,
            sum(part.num_steps for part in parts),
            sum(part.num_preemptions for part in parts),
            hits / queried if queried else 0.0,
            replicas=parts,
            routed=list(self.routed),
        )


def _columns(timeline: Timeline) -> tuple:
    return (
        timeline.time,
        timeline.batch_size,
        timeline.num_tokens,
        timeline.kv_usage,
        timeline.running,
        timeline.waiting,
    )
