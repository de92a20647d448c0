"""The step log: every iteration of the engine's loop and every request, with their times.

Each iteration becomes a ``nano_scheduler.sim.profile.StepRecord``: the step's batch, the
host's seconds in each phase of the loop, and the device's seconds of the forward and of
sampling (CUDA events on a GPU; the calls' own time on a synchronous device such as the CPU).
Each request becomes a ``RequestTiming``: when it was accepted and when its first and last
outputs were published. ``nano-engine profile`` fits nano-sim's host model to these records;
``nano-engine serve --step-log FILE`` and ``bench --step-log FILE`` write them as JSON lines
(a header, then ``{"step": ...}`` and ``{"request": ...}`` lines), every few seconds and at
shutdown, so a long run holds only the last few seconds in memory.
"""

from __future__ import annotations

import contextlib
import gc
import json
import threading
import time
from pathlib import Path

import torch

from nano_scheduler import Scheduler, SchedulerOutput
from nano_scheduler.sim.profile import (
    HOST_PHASES,
    STEP_LOG_FORMAT,
    VERSION,
    RequestTiming,
    StepRecord,
)

_FLUSH_EVERY = 2.0  # seconds between writes to the file
_HOST = HOST_PHASES


class CollectorClock:
    """The seconds Python's cyclic garbage collector has run since ``start`` (in any thread:
    a collection holds the GIL, so it stalls them all), through ``gc.callbacks``."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._began = 0.0

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._began = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._began

    def start(self) -> None:
        gc.callbacks.append(self._callback)

    def stop(self) -> None:
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)


class WatchedClock:
    """The CPU clock of a thread of this process, or of another process of this host (the
    server's front, when the engine runs in a process of its own: Linux lets a process read
    another's CPU clock, not its threads'). A clock that is gone (its thread or process ended)
    keeps its last reading."""

    def __init__(self, watch: threading.Thread | int) -> None:
        if isinstance(watch, threading.Thread):
            self.clock = time.pthread_getcpuclockid(watch.ident)
        else:  # (the clock id glibc's clock_getcpuclockid(pid) makes: CPUCLOCK_SCHED)
            self.clock = (~watch << 3) | 2
        self.origin = self.last = time.clock_gettime(self.clock)

    @classmethod
    def of(cls, watch: threading.Thread | int | None) -> WatchedClock | None:
        """The clock of ``watch`` (None: nothing to watch, or a process not of this host)."""
        if watch is None:
            return None
        try:
            return cls(watch)
        except OSError:
            return None

    def read(self) -> float:
        with contextlib.suppress(OSError):
            self.last = time.clock_gettime(self.clock)
        return self.last


class Phases:
    """Times one iteration of the loop by phase: ``mark(phase)`` adds the seconds since the
    previous mark to ``phase``. On a synchronous device a call computes before it returns:
    ``mark(phase, device=name)`` then adds them to the device's ``name`` instead. With
    ``cpu``, the loop thread's own CPU seconds of each host phase too (the wall time less what
    it waited for the GIL, held by the server's event loop, say)."""

    def __init__(
        self,
        synchronous: bool,
        cpu: bool = False,
        watch: WatchedClock | None = None,
        collector: CollectorClock | None = None,
    ) -> None:
        self.synchronous = synchronous
        self.seconds = dict.fromkeys((*_HOST, "wait", "forward", "sample_device"), 0.0)
        self.cpu = dict.fromkeys(_HOST, 0.0) if cpu else None
        self.resolved = self.finished = self.outputs = 0  # tokens read, sequences ended, outputs
        self.start = time.monotonic()  # (the iteration's, on the clock of the step log)
        self._last = time.perf_counter()
        self._last_cpu = time.thread_time() if cpu else 0.0
        # another thread's or process's CPU clock (the server's), and its reading now
        self._watch = watch
        self._watch_start = watch.read() if watch is not None else 0.0
        self._collector = collector
        self._gc_start = collector.seconds if collector is not None else 0.0

    def mark(self, phase: str, device: str | None = None) -> None:
        now = time.perf_counter()
        if device is not None and self.synchronous:
            phase = device
        self.seconds[phase] += now - self._last
        self._last = now
        if self.cpu is not None:
            cpu = time.thread_time()
            if phase in self.cpu:
                self.cpu[phase] += cpu - self._last_cpu
            self._last_cpu = cpu

    @property
    def host(self) -> float:
        return sum(self.seconds[p] for p in _HOST)

    @property
    def device(self) -> float:
        """Seconds spent waiting for the device, or in its computing calls (synchronous)."""
        s = self.seconds
        return s["wait"] + s["forward"] + s["sample_device"]

    def fill(self, record: StepRecord) -> None:
        for phase in (*_HOST, "wait"):
            setattr(record, phase, self.seconds[phase])
        record.resolved, record.finished, record.outputs = (
            self.resolved,
            self.finished,
            self.outputs,
        )
        if self.cpu is not None:
            record.cpu = [self.cpu[phase] for phase in _HOST]
        if self._collector is not None:
            record.gc = self._collector.seconds - self._gc_start
        if self._watch is not None:
            record.server_cpu = self._watch.read() - self._watch_start
            record.server_cpu_at = self._watch_start - self._watch.origin
        if self.synchronous:
            record.forward, record.sample_device = (
                self.seconds["forward"],
                self.seconds["sample_device"],
            )


def describe_device(device: torch.device) -> dict:
    """The device's type and name, and whether a call computes before it returns."""
    cuda = device.type == "cuda"
    name = torch.cuda.get_device_name(device) if cuda else device.type
    return {"type": device.type, "name": name, "synchronous": not cuda}


class DeviceTimer:
    """CUDA events around a step's forward and its sampling (None on other devices: there the
    calls are timed, as they compute before they return)."""

    def __init__(self) -> None:
        self.events = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
        self.marked = [False] * 4

    def mark(self, i: int) -> None:
        self.events[i].record()
        self.marked[i] = True

    def seconds(self) -> tuple[float, float]:
        """(forward, sampling); the step's tokens must have arrived (the events are done).
        Sampling is 0 where a CUDA graph drew the tokens (its time is the forward's)."""
        e = self.events
        sampling = e[2].elapsed_time(e[3]) / 1e3 if all(self.marked[2:]) else 0.0
        return e[0].elapsed_time(e[1]) / 1e3, sampling


class StepLogEntry:
    """One iteration's record on its way to the log: device events marked around its step's
    forward (0, 1) and sampling (2, 3); ``close`` fills in the host's phases at the end of the
    iteration, ``end`` hands it to the log once its step's tokens have arrived."""

    def __init__(self, recorder: StepRecorder, record: StepRecord) -> None:
        self.recorder, self.record = recorder, record
        self.timer: DeviceTimer | None = None

    def mark(self, event: int) -> None:
        if self.recorder.cuda:
            if self.timer is None:
                self.timer = DeviceTimer()
            self.timer.mark(event)

    def close(self, clock: Phases, done: bool) -> None:
        clock.fill(self.record)
        if done:
            self.end()

    def end(self) -> None:
        if self.timer is not None:
            self.record.forward, self.record.sample_device = self.timer.seconds()
        self.recorder.end(self.record)


class NullEntry:
    """What the loop marks when nothing is recorded."""

    def mark(self, event: int) -> None:
        pass

    def close(self, clock: Phases, done: bool) -> None:
        pass

    def end(self) -> None:
        pass


NO_ENTRY = NullEntry()


class StepRecorder:
    """Collects the loop's step records and request timings; writes them to ``path`` (JSON
    lines) when given, else keeps them all (``steps``, ``requests``)."""

    def __init__(
        self,
        device: torch.device,
        path: str | Path | None = None,
        watch: threading.Thread | int | None = None,
    ) -> None:
        """``watch``: a thread whose CPU time each iteration records (the server's event
        loop, which competes with the loop thread for the GIL), or the pid of a process of
        this host (the server's front, when the engine runs in a process of its own)."""
        self.device = device
        self.watch = WatchedClock.of(watch)
        self.cuda = device.type == "cuda"
        self.collector = CollectorClock()
        self.collector.start()
        self.path = Path(path) if path is not None else None
        self.steps: list[StepRecord] = []
        self.requests: list[RequestTiming] = []
        self._open: dict[str, RequestTiming] = {}  # requests not finished yet
        self._begun = 0  # iterations begun since the start (written ones too)
        self._accepted = [0, 0]  # requests taken in since the last iteration began, and tokens
        self._flushed = time.monotonic()
        if self.path is not None:
            device = describe_device(device)
            header = {"format": STEP_LOG_FORMAT, "version": VERSION, "device": device}
            self.path.write_text(json.dumps(header) + "\n")

    # ---- the loop's hooks --------------------------------------------------------------------

    def begin(
        self, out: SchedulerOutput, scheduler: Scheduler, eager: bool, start: float
    ) -> StepRecord:
        """A record for the iteration that began at ``start`` and scheduled ``out`` (it may be
        empty); ``end`` it once complete (its step's device times known), in the order begun."""
        self._begun += 1
        (accepted, tokens), self._accepted = self._accepted, [0, 0]
        decodes = [len(s.token_ids) for s in out.decodes]
        return StepRecord(
            accepted=accepted,
            accepted_tokens=tokens,
            t=start,
            prefills=[[c.num_tokens, c.start] for c in out.prefills],
            decodes=[len(decodes), sum(decodes), max(decodes, default=0)],
            sampled=sum(c.samples for c in out.prefills) + len(decodes),
            running=len(scheduler.running),
            waiting=len(scheduler.waiting),
            eager=eager,
        )

    def end(self, record: StepRecord) -> None:
        self.steps.append(record)
        if self.path is not None and time.monotonic() - self._flushed > _FLUSH_EVERY:
            self.flush()

    def accepted(
        self, request_id: str, arrival: float, prompt_tokens: int, received: float | None = None
    ) -> None:
        timing = RequestTiming(request_id, arrival, prompt_tokens, received=received)
        self._open[request_id] = timing
        self._accepted[0] += 1
        self._accepted[1] += prompt_tokens

    def published(
        self, request_id: str, tokens: int, finished: bool, first_scheduled: float | None
    ) -> None:
        """A request's output went out now (``tokens``: new tokens in it)."""
        timing = self._open.get(request_id)
        if timing is None:
            return
        now = time.monotonic()
        if tokens and timing.first_token is None:
            timing.first_token, timing.first_step = now, self._begun - 1
        timing.output_tokens += tokens
        if finished:
            timing.finish, timing.last_step = now, self._begun - 1
            timing.first_scheduled = first_scheduled
            self.requests.append(self._open.pop(request_id))

    # ---- output ------------------------------------------------------------------------------

    def close(self) -> None:
        """Write out what is left and stop timing the collector."""
        self.collector.stop()
        self.flush()

    def flush(self) -> None:
        """Write what was recorded since the last flush (and forget it)."""
        self._flushed = time.monotonic()
        if self.path is None or not (self.steps or self.requests):
            return
        lines = [json.dumps({"step": r.to_dict()}) for r in self.steps]
        lines += [json.dumps({"request": _timing_dict(r)}) for r in self.requests]
        with self.path.open("a") as f:
            f.write("\n".join(lines) + "\n")
        self.steps.clear()
        self.requests.clear()


def _timing_dict(timing: RequestTiming) -> dict:
    return dict(vars(timing))
