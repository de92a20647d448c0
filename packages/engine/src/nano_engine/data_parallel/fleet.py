"""The front of data-parallel serving: ``data_parallel_size`` engine replicas, each in its own
process with its own GPU(s), behind the interface of one ``LLMEngine`` (``make_request``,
``submit``, ``abort``, streams), which the server and ``LLM`` use unchanged.

Requests are validated and tokenized here, routed by ``nano_scheduler.router`` (the policy
nano-sim's fleet uses), and sent to their replica; a thread per replica fetches its outputs in
batches and publishes them to the requests' streams, in this process's clock. A replica that
stops (its process died, its engine failed) is seen by that thread at once: its requests that
had streamed nothing yet go once to another replica, the others end with an error, and the
fleet serves on with the rest (``alive`` while one serves).
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import logging
import os
import threading
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path

from nano_engine.config import EngineConfig
from nano_engine.data_parallel.replica import (
    Batch,
    ReplicaGone,
    ReplicaHandle,
    RequestSpec,
    from_wire,
)
from nano_engine.outputs import RequestOutput
from nano_engine.requests import RequestFactory, eos_token_ids, load_tokenizer, reasoning_tokens
from nano_engine.stats import EngineStats
from nano_engine.streams import EngineDeadError, RequestStream, publish
from nano_engine.structured import GrammarCompiler
from nano_models import ModelConfig
from nano_scheduler import SamplingParams
from nano_scheduler.router import NoReplicaError, make_router, request_cost

log = logging.getLogger("nano_engine")


@dataclass
class FleetRequest:
    """A request validated by the front (``Fleet.make_request``), not sent yet."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    stream: RequestStream
    stream_deltas: bool
    reasoning: bool
    arrival: float = field(default_factory=time.monotonic)
    replica: int = -1  # where it runs
    first_token: float = 0.0  # when its first generated token came (this process's clock)
    streamed: bool = False  # whether an output went to its stream
    retried: bool = False  # whether it was sent again after its replica stopped
    aborted: bool = False

    def spec(self) -> RequestSpec:
        return RequestSpec(
            self.request_id,
            self.prompt,
            self.prompt_token_ids,
            self.params,
            self.stream_deltas,
            self.reasoning,
            self.arrival,
        )


class Fleet:
    """``config.data_parallel_size`` replicas of ``config``'s engine on the backend it names
    (``ray`` actors in placement groups, or ``mp`` processes of this host)."""

    def __init__(self, config: EngineConfig) -> None:
        from nano_engine.data_parallel import get_backend

        self.config = config
        self.model_config = mc = ModelConfig.from_pretrained(config.model)
        self.tokenizer = load_tokenizer(config)
        eos = eos_token_ids(config, mc, self.tokenizer)
        reasoning = reasoning_tokens(self.tokenizer, config.reasoning_parser)
        self.backend = get_backend(config.data_parallel_backend)
        self.replicas: list[ReplicaHandle] = self.backend.start(config)
        try:
            self._start(config, mc, eos, reasoning)
        except BaseException:
            self.backend.stop(self.replicas)
            self.backend.release()
            raise
        if len(self.replicas) == 1:
            log.info("the engine runs in its own process: %s", self.replicas[0].describe())
        else:
            log.info(
                "serving with %d replicas (%s routing): %s",
                len(self.replicas),
                config.router,
                "; ".join(r.describe() for r in self.replicas),
            )

    def _start(self, config: EngineConfig, mc: ModelConfig, eos: set[int], reasoning) -> None:
        """The front's state over the started replicas, and a reader of each."""
        infos = [r.info for r in self.replicas]
        if len({(i.num_blocks, i.max_model_len) for i in infos}) > 1:
            log.warning(
                "the replicas differ (KV blocks, max_model_len: %s): requests are checked "
                "against the smallest",
                [(i.num_blocks, i.max_model_len) for i in infos],
            )
        self.max_model_len = min(i.max_model_len for i in infos)
        num_blocks = min(i.num_blocks for i in infos)  # (a request must fit any replica)
        self.request_factory = RequestFactory(
            self.tokenizer,
            mc.vocab_size,
            self.max_model_len,
            config.max_logprobs,
            num_blocks,
            config.kvcache_block_size,
            GrammarCompiler(self.tokenizer, mc.vocab_size, sorted(eos)),
            reasoning,
        )
        n = len(self.replicas)
        self.routed = [0] * n  # requests sent to each replica (retries included)
        self.router = make_router(config.router, n, config.kvcache_block_size)
        self.retries = 0  # requests sent again after their replica stopped
        self._lock = threading.Lock()
        self._requests: dict[str, FleetRequest] = {}
        self._stats = [EngineStats(True, 0, 0, 0.0, 0, 0, 0) for _ in range(n)]
        self._why: list[str | None] = [None] * n  # why each replica stopped
        self._ids = itertools.count()
        self._stopping = False
        self._readers = [
            threading.Thread(
                target=self._read, args=(replica,), name=f"nano-fleet-{i}", daemon=True
            )
            for i, replica in enumerate(self.replicas)
        ]
        for thread in self._readers:
            thread.start()
        atexit.register(_shutdown_if_alive, weakref.ref(self))

    # ---- the engine's interface ----------------------------------------------------------------

    def add_request(self, prompt, params=None, request_id=None, notify=None) -> RequestStream:
        request = self.make_request(prompt, params, request_id, notify)
        self.submit([request])
        return request.stream

    def make_request(
        self,
        prompt,
        params=None,
        request_id=None,
        notify=None,
        stream_deltas: bool = True,
        reasoning: bool = False,
    ) -> FleetRequest:
        """As ``LLMEngine.make_request``: validated here, run on the replica it is routed to."""
        if not self.alive:
            raise EngineDeadError(f"the engine is not running: {self.error}")
        valid = self.request_factory.validate(prompt, params)
        request_id = request_id if request_id is not None else f"fleet-{next(self._ids)}"
        return FleetRequest(
            request_id,
            valid.text,
            valid.token_ids,
            valid.params,
            RequestStream(request_id, notify),
            stream_deltas,
            reasoning,
        )

    def submit(self, requests: list[FleetRequest]) -> None:
        """Route and send every request, or none (an error)."""
        with self._lock:
            if not self.alive:
                raise EngineDeadError(f"the engine is not running: {self.error}")
            ids = [r.request_id for r in requests]
            duplicate = sorted({i for i in ids if i in self._requests or ids.count(i) > 1})
            if duplicate:
                raise ValueError(f"request ids already in use: {duplicate}")
            batches: dict[int, list[FleetRequest]] = {}
            try:
                for request in requests:
                    replica = self._route(request)
                    self._requests[request.request_id] = request
                    batches.setdefault(replica, []).append(request)
            except NoReplicaError as e:  # (the last one stopped meanwhile)
                for request in requests:
                    self._requests.pop(request.request_id, None)
                    self.router.finish(request.request_id)
                raise EngineDeadError(f"the engine is not running: {e}") from e
            self._send(batches)

    def abort(self, request_id: str) -> None:
        with self._lock:
            request = self._requests.get(request_id)
            if request is not None:
                request.aborted = True  # (never sent elsewhere if its replica stops)
                with contextlib.suppress(ReplicaGone):  # (its reader ends the request)
                    self.replicas[request.replica].abort(request_id)

    def reset_prefix_cache(self) -> int:
        return sum(r.call("reset_prefix_cache") for r in self._serving())

    def has_unfinished(self) -> bool:
        return bool(self._requests)

    @property
    def num_requests(self) -> int:
        return len(self._requests)

    @property
    def num_sequences(self) -> int:
        return sum(r.params.n for r in list(self._requests.values()))

    @property
    def alive(self) -> bool:
        return not self._stopping and any(why is None for why in self._why)

    @property
    def error(self) -> BaseException | None:
        if self.alive:
            return None
        if self._stopping:
            return EngineDeadError("the engine was shut down")
        return EngineDeadError(
            "no replica serves: "
            + "; ".join(f"replica {i}: {why}" for i, why in enumerate(self._why))
        )

    def replica_stats(self) -> list[EngineStats]:
        """Each replica's state, as it last reported it (a stopped one: not serving)."""
        return list(self._stats)

    def describe(self) -> list[dict | None]:
        """Each replica's ``LLMEngine.describe`` (None: it stopped)."""
        described = []
        for replica in self.replicas:
            try:
                described.append(replica.call("describe") if self._serves(replica) else None)
            except ReplicaGone:
                described.append(None)
        return described

    def record_steps(
        self, path: str | Path | None = None, watch: threading.Thread | int | None = None
    ) -> None:
        """Start the step log of the one replica's engine, written to ``path`` there (at
        shutdown and every few seconds), with this process's CPU time in each iteration (the
        server's event loop and the threads that carry requests and outputs). ``watch`` is
        not used: the replica watches this whole process (``LLMEngine.record_steps``'s
        signature)."""
        if len(self.replicas) > 1:
            raise ValueError(
                "the step log records one engine's loop: run without data parallelism to record it"
            )
        if path is None:
            raise ValueError(
                "an engine in its own process writes its step log to a file: give a path"
            )
        # (a fleet of one is a process of this host: ``start_engine``)
        self.replicas[0].call("record_steps", str(path), os.getpid())

    def stop_recording(self) -> None:
        """End the step log that ``record_steps`` started (written out)."""
        if len(self.replicas) == 1 and self._serves(self.replicas[0]):
            with contextlib.suppress(ReplicaGone):
                self.replicas[0].call("stop_recording")

    def shutdown(self) -> None:
        """Stop every replica; requests still running end with an error."""
        with self._lock:
            if self._stopping:
                return
            self._stopping = True
            left = list(self._requests.values())
            self._requests.clear()
        error = EngineDeadError("the engine stopped: it was shut down")
        publish((r.stream, error) for r in left)
        self.backend.stop(self.replicas)
        for thread in self._readers:  # (each ends with its replica)
            thread.join(timeout=5)
        self.backend.release()

    def __enter__(self) -> Fleet:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # ---- replicas ------------------------------------------------------------------------------

    def _serving(self) -> list[ReplicaHandle]:
        return [r for r in self.replicas if self._serves(r)]

    def _serves(self, replica: ReplicaHandle) -> bool:
        return self._why[replica.index] is None

    def _route(self, request: FleetRequest, avoid: int | None = None) -> int:
        params = request.params
        most = params.max_tokens or self.max_model_len - len(request.prompt_token_ids)
        cost = request_cost(len(request.prompt_token_ids), params.n, most)
        replica = self.router.route(request.request_id, request.prompt_token_ids, cost, avoid)
        request.replica = request.stream.engine_index = replica
        self.routed[replica] += 1
        return replica

    def _send(self, batches: dict[int, list[FleetRequest]]) -> None:
        """Send each replica its requests (under the lock, so that an abort follows them)."""
        for replica, requests in batches.items():
            # (one gone: its reader sends them on or ends them)
            with contextlib.suppress(ReplicaGone):
                self.replicas[replica].submit([r.spec() for r in requests])

    def _read(self, replica: ReplicaHandle) -> None:
        """The replica's outputs to their streams, until it ends (stopped, or shut down). One
        whose engine failed is stopped, its last batches read and dropped until it ends."""
        failed = False
        while True:
            try:
                batch = replica.poll()
            except ReplicaGone as e:
                self._lost(replica.index, str(e))
                return
            except Exception as e:  # (unreadable: the replica is no use either)
                log.exception("%s: its outputs cannot be read", replica.describe())
                self._lost(replica.index, f"its outputs cannot be read: {e!r}")
                replica.stop()
                failed = True
                continue
            if failed:
                continue
            self._deliver(replica.index, batch)
            if batch.error is not None:
                self._lost(replica.index, f"its engine stopped: {batch.error}")
                replica.stop()
                failed = True

    def _deliver(self, index: int, batch: Batch) -> None:
        now = time.monotonic()
        items: list[tuple[RequestStream, RequestOutput | BaseException]] = []
        with self._lock:
            self._stats[index] = batch.stats
            for wire in batch.outputs:
                request_id = wire[0]
                request = self._requests.get(request_id)
                if request is None or request.replica != index:
                    continue  # (ended here already, or sent to another replica)
                if len(wire) == 2:  # (request id, why it failed there)
                    if batch.error is not None:
                        continue  # (the replica stopped: ``_lost`` decides)
                    del self._requests[request_id]
                    self.router.finish(request_id)
                    items.append((request.stream, EngineDeadError(wire[1])))
                    continue
                out = from_wire(wire, request.prompt, request.prompt_token_ids)
                done = sum(len(o.token_ids) for o in out.outputs)
                if not request.streamed:
                    done += request.params.n * len(request.prompt_token_ids)
                    request.streamed = True
                self.router.progress(request_id, done)
                span = wire[-1]
                if not request.first_token and span is not None:
                    # (the replica's clock is not this one: its span since the first token,
                    # back from now)
                    request.first_token = max(request.arrival, now - span)
                out.metrics = {
                    "arrival_time": request.arrival,
                    "first_token_time": request.first_token,
                    "last_token_time": now,
                }
                if out.finished:
                    del self._requests[request_id]
                    self.router.finish(request_id)
                items.append((request.stream, out))
        publish(items)

    def _lost(self, index: int, why: str) -> None:
        """Replica ``index`` stopped: its requests that streamed nothing go to another replica
        (once), the rest end with an error."""
        with self._lock:
            if self._why[index] is not None or self._stopping:
                return
            self._why[index] = why
            # (its counters stay as they were: Prometheus counters never go down)
            self._stats[index] = self._stats[index]._replace(
                serving=False, running=0, waiting=0, kv_usage=0.0
            )
            self.router.remove(index)
            failed, batches = [], {}
            for request in [r for r in self._requests.values() if r.replica == index]:
                self.router.finish(request.request_id)
                if not (request.streamed or request.retried or request.aborted):
                    try:
                        replica = self._route(request, avoid=index)
                    except NoReplicaError:
                        pass
                    else:
                        request.retried = True
                        self.retries += 1
                        batches.setdefault(replica, []).append(request)
                        continue
                del self._requests[request.request_id]
                failed.append(request)
            self._send(batches)
        serving = sum(w is None for w in self._why)
        log.error(
            "%s stopped (%s): %d of its requests sent to other replicas, %d ended with an "
            "error; %d of %d replicas serve",
            self.replicas[index].describe(),
            why,
            sum(len(b) for b in batches.values()),
            len(failed),
            serving,
            len(self.replicas),
        )
        error = EngineDeadError(
            f"replica {index} stopped while serving this request ({why}); "
            f"{serving} of {len(self.replicas)} replicas serve"
        )
        publish((r.stream, error) for r in failed)


def _shutdown_if_alive(ref: weakref.ref) -> None:
    """At exit: a fleet never shut down stops its replicas (processes of this host would
    otherwise keep the interpreter from exiting)."""
    fleet = ref()
    if fleet is not None:
        fleet.shutdown()
