"""One data-parallel replica: an engine in its own process (a Ray actor, or a process of this
host), and the handle through which the front reaches it.

The front (``Fleet``) validates and routes a request, then sends the replica its spec
(``RequestSpec``). The replica's ``ReplicaCore`` queues it in its ``LLMEngine`` and collects
the outputs of all its requests as the loop publishes them; the front fetches them in batches
(``outputs``: every output since the last fetch, a request's deltas merged, with the engine's
state for /metrics), one round trip for any number of requests. Outputs travel without their
prompt, which the front holds.
"""

from __future__ import annotations

import os
import socket
import threading
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from nano_engine.config import EngineConfig
from nano_engine.interpreter import tune_for_serving
from nano_engine.outputs import CompletionOutput, RequestOutput, WireOutput
from nano_engine.stats import EngineStats
from nano_engine.streams import RequestStream
from nano_scheduler import SamplingParams

# A replica sends a batch at least this often, outputs or not: the front's /metrics gauges of
# its queues are at most this old (at 0.5 s a short request could run and finish between two
# batches, never seen running).
STATS_PERIOD = 0.1


@dataclass(frozen=True)
class RequestSpec:
    """A validated request, as the front sends it to a replica."""

    request_id: str
    text: str | None
    token_ids: list[int]
    params: SamplingParams
    stream_deltas: bool
    reasoning: bool
    # when the front validated it, on its host's monotonic clock (another host's replica,
    # a Ray actor's, reads it on another clock: for the step log of a replica beside its front)
    received: float | None = None


@dataclass(frozen=True)
class ReplicaInfo:
    """A started replica: where it runs and what its engine holds."""

    pid: int
    host: str
    device: str
    num_blocks: int
    block_size: int
    max_model_len: int


def merge_wire(total: WireOutput, delta: WireOutput) -> WireOutput:
    """A request's later output folded into its earlier one, as ``merge_outputs`` folds
    ``RequestOutput``s: each completion's text, tokens and logprobs extended, the rest the
    later's (the prompt logprobs: whichever came)."""
    by_index = {c[0]: c for c in total[3]}
    for c in delta[3]:
        old = by_index.get(c[0])
        if old is not None:
            logprobs = old[4] if c[4] is None else (old[4] or []) + c[4]
            c = (c[0], old[1] + c[1], old[2] + c[2], c[3], logprobs, c[5])
        by_index[c[0]] = c
    completions = [by_index[i] for i in sorted(by_index)]
    prompt_logprobs = delta[4] if delta[4] is not None else total[4]
    return total[0], delta[1], max(total[2], delta[2]), completions, prompt_logprobs, delta[5]


def from_wire(wire: WireOutput, prompt: str | None, prompt_token_ids: list[int]) -> RequestOutput:
    """The output a replica sent, with its request's prompt (metrics: the caller's)."""
    request_id, finished, cached, completions, prompt_logprobs, _ = wire
    return RequestOutput(
        request_id,
        prompt,
        prompt_token_ids,
        [CompletionOutput(*c) for c in completions],
        finished,
        cached,
        prompt_logprobs=prompt_logprobs,
    )


@dataclass(frozen=True)
class Batch:
    """What a replica sends back: outputs as they travel (``WireOutput``; a message instead: the
    request failed there), its engine's state, and why the engine stopped, if it did."""

    outputs: list[tuple[str, str] | WireOutput]
    stats: EngineStats
    error: str | None = None


class ReplicaGone(RuntimeError):
    """A replica's process ended, or cannot be reached."""


class _QueuedStream(RequestStream):
    """A request's stream in a replica's process, which only the core reads: each output goes
    onto the core's one queue as the loop publishes it (``enqueue``), in the form it travels
    (``wire``), without the lock and the wake-up of a stream that a reader waits on (~1.7 us
    a stream and step on the loop's thread, and 1.4 us for the collector to drain it, in the
    server's engine process)."""

    wire = True

    def __init__(
        self, request_id: str, enqueue: Callable[[str, WireOutput | BaseException], None]
    ) -> None:
        super().__init__(request_id)
        self._enqueue = enqueue

    def _append(self, item: WireOutput | BaseException) -> None:
        self._enqueue(self.request_id, item)


class ReplicaCore:
    """The engine of a replica, in the replica's process. Thread-safe: the front's calls may
    come on several threads (``outputs`` long-polls on one while others submit)."""

    def __init__(self, config: EngineConfig, index: int) -> None:
        from nano_engine.engine import LLMEngine

        # (the step loop shares this process's interpreter lock with the threads that take
        # the front's commands and send it the outputs)
        tune_for_serving()
        self.index = index
        self.engine = LLMEngine(config)
        self._cond = threading.Condition()
        # every request's outputs in the order the loop published them (_QueuedStream)
        self._ready: deque[tuple[str, WireOutput | BaseException]] = deque()
        self._failed: list[tuple[str, str]] = []
        self._waiting = False  # ``outputs`` waits for one (set and cleared under ``_cond``)

    def info(self) -> ReplicaInfo:
        engine = self.engine
        return ReplicaInfo(
            os.getpid(),
            socket.gethostname(),
            str(engine.runner.device),
            engine.block_manager.num_blocks,
            engine.block_manager.block_size,
            engine.max_model_len,
        )

    def submit(self, specs: list[RequestSpec]) -> None:
        requests = []
        for spec in specs:
            try:
                request = self.engine.make_request(
                    spec.token_ids,
                    spec.params,
                    spec.request_id,
                    stream_deltas=spec.stream_deltas,
                    reasoning=spec.reasoning,
                )
            except Exception as e:  # (the front validated it: an engine that stopped, say)
                self._fail(spec.request_id, str(e))
                continue
            request.prompt, request.received = spec.text, spec.received
            request.stream = _QueuedStream(request.request_id, self._queue)
            requests.append(request)
        if not requests:
            return
        try:
            self.engine.submit(requests)
        except Exception as e:
            for request in requests:
                self._fail(request.request_id, str(e))

    def abort(self, request_id: str) -> None:
        """(The transports keep the order of the front's calls: an abort comes after its
        request's submission.)"""
        self.engine.abort(request_id)

    def outputs(self, timeout: float = STATS_PERIOD) -> Batch:
        """Every output since the last call (waiting up to ``timeout`` seconds for one)."""
        with self._cond:
            if not self._ready and not self._failed:
                self._waiting = True
                if not self._ready:  # (again: one appended meanwhile did not notify)
                    self._cond.wait(timeout)
                self._waiting = False
            # (taken one by one from the loop's queue: an output it appends meanwhile stays
            # there for the next call)
            ready = [self._ready.popleft() for _ in range(len(self._ready))]
            failed, self._failed = self._failed, []
        # (by request id: the front holds an id until its request's last output is delivered)
        by_request: dict[str, list[WireOutput | BaseException]] = {}
        for request_id, item in ready:
            by_request.setdefault(request_id, []).append(item)
        outputs: list[tuple[str, str] | WireOutput] = list(failed)
        for request_id, items in by_request.items():
            merged = items[0]
            if len(items) > 1 or isinstance(merged, BaseException):
                # The engine stopped: its error (the first: a step in flight may still
                # publish after it, when another thread failed the engine).
                error = next((i for i in items if isinstance(i, BaseException)), None)
                if error is not None:
                    outputs.append((request_id, str(error)))
                    continue
                for delta in items[1:]:
                    merged = merge_wire(merged, delta)
            outputs.append(merged)
        error = self.engine.error
        return Batch(outputs, self.engine.replica_stats()[0], None if error is None else str(error))

    def reset_prefix_cache(self) -> int:
        return self.engine.reset_prefix_cache()

    def describe(self) -> dict:
        return self.engine.describe()

    def record_steps(self, path: str, front: int | None = None) -> None:
        """The engine's step log, to ``path``, with the CPU time of the front's process
        (``front``, its pid) where it runs on this host."""
        self.engine.record_steps(path, watch=front)

    def stop_recording(self) -> None:
        self.engine.stop_recording()

    def shutdown(self) -> None:
        self.engine.shutdown()

    def _queue(self, request_id: str, item: WireOutput | BaseException) -> None:
        """(The loop's, for every output it publishes: the lock only when ``outputs`` waits.
        It sets ``_waiting`` before it looks at the queue a last time, so an append it did
        not see finds the flag set and wakes it: the two threads' reads and writes are
        ordered by the interpreter lock.)"""
        self._ready.append((request_id, item))
        if self._waiting:
            with self._cond:
                self._cond.notify()

    def _fail(self, request_id: str, message: str) -> None:
        with self._cond:
            self._failed.append((request_id, message))
            self._cond.notify()


class ReplicaHandle(ABC):
    """The front's end of a replica (``index``, started: ``info``). ``submit`` and ``abort``
    return at once; ``poll`` blocks for the next ``Batch`` (a fraction of a second at most)
    and raises ``ReplicaGone`` once the replica has ended."""

    index: int
    info: ReplicaInfo | None = None  # (once started)

    @abstractmethod
    def submit(self, specs: list[RequestSpec]) -> None: ...

    @abstractmethod
    def abort(self, request_id: str) -> None: ...

    @abstractmethod
    def poll(self) -> Batch: ...

    @abstractmethod
    def call(self, method: str, *args: object) -> object:
        """Run a ``ReplicaCore`` method there (with ``args``, which it must be able to
        pickle) and return its result."""

    @abstractmethod
    def stop(self) -> None:
        """Ask the replica to end (at once: its poll raises ``ReplicaGone`` once it has)."""

    @abstractmethod
    def close(self, timeout: float) -> None:
        """Shut the engine down and end the process (killed after ``timeout`` seconds)."""

    def describe(self) -> str:
        info = self.info
        if info is None:
            return f"replica {self.index} (starting)"
        return f"replica {self.index} (pid {info.pid} on {info.host}, {info.device})"
