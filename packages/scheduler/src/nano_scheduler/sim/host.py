"""The host side of serving: the engine's loop thread, and the HTTP server's event loop beside it.

The simulator runs the loop thread's work through a host: ``cpu(t, c)`` (the thread computes
for ``c`` seconds from ``t``; returns when done) and ``free(t, until)`` (it waits for the
device, or idles). A host turns requests sent into requests accepted (``send``, ``accepted``)
and outputs published into outputs received (``publish``, the ``receive`` callback).

``OfflineHost`` is the Python API: nothing else runs; a request is accepted when sent, an output
received when published. ``ServerHost`` models the server's event loop thread as work taken in
arrival order: each request's handling (parsing, validation, submission), and passes over
the streams with new outputs (one pass takes every output published by the time it starts,
so a loop that fell behind sends merged deltas, as the server does). The two threads share one
interpreter lock: while both have work, each gets half of the time (CPython hands the lock over
every switch interval); while the loop thread waits for the device, the event loop runs alone.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property

from nano_scheduler.sim.fit import Piecewise

Receive = Callable[[int, float, bool], None]  # (seq_id, time, finished)


class OfflineHost:
    def __init__(self, receive: Receive) -> None:
        self.receive = receive
        self._accepted: deque[tuple[float, int]] = deque()

    def send(self, t: float, position: int, prompt_tokens: int) -> None:
        self._accepted.append((t, position))

    def next_accept(self, t: float) -> float:
        """When the next request is accepted, at the earliest ``t`` (inf: none is pending)."""
        return max(t, self._accepted[0][0]) if self._accepted else math.inf

    def accepted(self, t: float) -> list[int]:
        """The requests accepted by ``t`` (each once), in order."""
        out = []
        while self._accepted and self._accepted[0][0] <= t:
            out.append(self._accepted.popleft()[1])
        return out

    def cpu(self, t: float, seconds: float) -> float:
        return t + seconds

    def free(self, t: float, until: float) -> float:
        return max(t, until)

    def publish(self, t: float, streams: list[tuple[int, bool]]) -> None:
        for seq_id, finished in streams:
            self.receive(seq_id, t, finished)

    def drain(self, t: float) -> float:
        return t


@dataclass(frozen=True)
class ServerCosts:
    """The event loop's CPU seconds: per request (and prompt token) received, and of a pass
    over ``n`` streams with new outputs (``passes``: measured (n, seconds), interpolated);
    ``latency``: the network's, each way; ``first_request``: the first request's extra
    handling (a cold path)."""

    request: float
    prompt_token: float
    passes: tuple[tuple[float, float], ...]
    latency: float = 0.0
    first_request: float = 0.0

    @cached_property
    def _passes(self) -> Piecewise:
        return Piecewise(self.passes)

    def pass_seconds(self, streams: int) -> float:
        return self._passes(streams)


class _Item:
    __slots__ = ("available", "marks", "position", "streams", "work")

    def __init__(self, available: float, work: float, position: int = -1) -> None:
        self.available, self.work, self.position = available, work, position
        self.streams: dict[int, bool] | None = None  # a pass: seq_id -> finished
        self.marks: list[float] = []  # (a pass) the work left when each stream is sent


class ServerHost:
    def __init__(self, costs: ServerCosts, receive: Receive) -> None:
        self.costs, self.receive = costs, receive
        self.t = 0.0  # the event loop is simulated up to here
        self._requests: deque[_Item] = deque()  # in the order sent
        self._publications: deque[_Item] = deque()
        self._current: _Item | None = None
        self._accepted: deque[tuple[float, int]] = deque()
        self._first = True

    # ---- what the simulator calls ------------------------------------------------------------

    def send(self, t: float, position: int, prompt_tokens: int) -> None:
        c = self.costs
        work = c.request + c.prompt_token * prompt_tokens
        if self._first:
            work += c.first_request
            self._first = False
        self._requests.append(_Item(t + c.latency, work, position))

    def next_accept(self, t: float) -> float:
        """Run the event loop alone from ``t`` until it accepts a request; its time (inf if no
        request is on its way)."""
        self.free(t, t)
        while not self._accepted:
            item = self._current or self._start()
            if item is not None:
                self._advance(item, item.work, 1.0)
            elif self._next_arrival() < math.inf:
                self.t = self._next_arrival()
            else:
                return math.inf
        return max(t, self._accepted[0][0])

    def accepted(self, t: float) -> list[int]:
        out = []
        while self._accepted and self._accepted[0][0] <= t:
            out.append(self._accepted.popleft()[1])
        return out

    def cpu(self, t: float, seconds: float) -> float:
        """The loop thread computes for ``seconds`` once the event loop lets it: the event
        loop keeps the lock while it has work (the loop thread releases the lock around
        every torch call and waits a switch interval to get it back; the event loop holds it
        for whole intervals), as measured: a pass over 256 streams delays the loop thread by
        its whole length."""
        self.free(t, t)
        while seconds > 1e-12:
            item = self._current or self._start()
            if item is not None:
                self._advance(item, item.work, 1.0)
            else:  # the event loop is idle until its next arrival
                dt = min(seconds, self._next_arrival() - self.t)
                self.t += dt
                seconds -= dt
        return self.t

    def free(self, t: float, until: float) -> float:
        """The loop thread holds no lock until ``until``: the event loop runs alone."""
        self.t = max(self.t, t)
        while self.t < until:
            item = self._current or self._start()
            if item is None:
                self.t = min(until, self._next_arrival())
            else:
                self._advance(item, min(until - self.t, item.work), 1.0)
        return max(self.t, until)

    def publish(self, t: float, streams: list[tuple[int, bool]]) -> None:
        if streams:
            item = _Item(t, 0.0)
            item.streams = dict(streams)
            self._publications.append(item)

    def drain(self, t: float) -> float:
        """Run the event loop until it has sent everything; the time it is done."""
        self.free(t, t)
        while True:
            item = self._current or self._start()
            if item is not None:
                self._advance(item, item.work, 1.0)
            elif self._next_arrival() < math.inf:
                self.t = self._next_arrival()
            else:
                return self.t

    # ---- the event loop ----------------------------------------------------------------------

    def _next_arrival(self) -> float:
        r, p = self._requests, self._publications
        return min(r[0].available if r else math.inf, p[0].available if p else math.inf)

    def _start(self) -> _Item | None:
        """The next item to arrive, if it has: a pass takes every publication made by now."""
        r, p = self._requests, self._publications
        if r and r[0].available <= self.t and (not p or r[0].available <= p[0].available):
            item = r.popleft()
        elif p and p[0].available <= self.t:
            item = p.popleft()
        else:
            return None
        if item.streams is not None:
            streams = _Streams(item.streams)
            while p and p[0].available <= self.t:
                streams.merge(p.popleft().streams)
            n = len(streams)
            item.work = self.costs.pass_seconds(n)
            item.marks = [item.work * (n - 1 - i) / n for i in range(n)]
            item.streams = streams
        self._current = item
        return item

    def _advance(self, item: _Item, dt: float, share: float) -> None:
        """``dt`` seconds of the event loop working on ``item`` at ``share`` of the time."""
        start, before = self.t, item.work
        self.t += dt
        item.work -= dt * share
        if item.streams is not None:
            # a stream's chunk is sent once the pass has done the work up to it
            while item.marks and item.marks[0] >= item.work - 1e-15:
                when = start + (before - item.marks.pop(0)) / share
                seq_id, finished = item.streams.popitem_first()
                self.receive(seq_id, when + self.costs.latency, finished)
        if item.work <= 1e-15:
            self._current = None
            if item.streams is None:
                self._accepted.append((self.t, item.position))


class _Streams(dict):
    """The streams of a pass in order (seq_id -> finished), taken from the front."""

    def merge(self, other: dict[int, bool]) -> None:
        for seq_id, finished in other.items():
            self[seq_id] = self.get(seq_id, False) or finished

    def popitem_first(self) -> tuple[int, bool]:
        seq_id = next(iter(self))
        return seq_id, self.pop(seq_id)
