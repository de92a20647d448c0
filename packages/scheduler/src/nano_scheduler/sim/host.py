"""The host side of serving: the engine's loop thread, and the HTTP server's event loop beside it.

The simulator runs the loop thread's work through a host: ``cpu(t, c)`` (the thread computes
for ``c`` seconds from ``t``; returns when done) and ``free(t, until)`` (it waits for the
device, or idles). A host turns requests sent into requests accepted (``send``, ``accepted``)
and outputs published into outputs received (``publish``, the ``receive`` callback).

``OfflineHost`` is the Python API: nothing else runs; a request is accepted when sent, an output
received when published. ``ServerHost`` models the server's event loop thread (uvicorn on
uvloop) iteration by iteration: each iteration runs the callbacks the previous one queued (the
handling of requests: parsing, validation, submission; passes over the streams that outputs
woke, a stream woken twice sending one merged chunk), then polls, where libuv accepts one new
connection at most (a streaming client holds a connection per request, so each request comes
on a new one): a request is read the iteration after its connection is accepted and handled
the one after that. While passes over many streams fill the iterations, connections wait to
be accepted (measured: new requests waited 150-600 ms on an H200 whose front was 95-97% busy;
a model that took each request in arrival order predicted 15 ms). A client keeps a finished
request's connection open (HTTP keep-alive) and sends its next request on it: read by the poll
that finds it, handled the iteration after, never behind the connections waiting to be
accepted (measured far above capacity: new connections waited up to 5.5 s to be accepted,
while about as many requests a second as finished came in within 100 ms). Beside that work, a
request validated takes a while more to reach the engine (``ServerCosts.hop``), and a pass
begins with the outputs' relay (unpacked and handed to their streams) before its first
chunk is written (``ServerCosts.relay``). With the engine in the
server's process the two threads share one interpreter lock: the event loop keeps it while it
has work, the loop thread computes in between; while the loop thread waits for the device, the
event loop runs alone. With the engine in a process of its own (``ServerCosts.own_process``,
the server's default), the event loop is the front process's work and runs beside the loop
thread: it delays requests and outputs, never the loop.
"""

from __future__ import annotations

import math
import random
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace
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

    def accepted_by(self, t: float) -> bool:
        """Whether a request is accepted by ``t`` (and not taken yet)."""
        return bool(self._accepted) and self._accepted[0][0] <= t

    def quiet_until(self) -> float:
        """No request is accepted before this time (inf: none is on its way)."""
        return self._accepted[0][0] if self._accepted else math.inf

    def accepted(self, t: float) -> list[tuple[float, int]]:
        """The requests accepted by ``t`` (each once), in order: (when, position)."""
        out = []
        while self._accepted and self._accepted[0][0] <= t:
            out.append(self._accepted.popleft())
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
    ``latency``: each way, the network's and the host's wake-ups (``scaled`` with the host);
    ``first_request``: the first request's extra handling (a cold path); ``busy``: how much
    more a request's handling costs while the loop thread computes beside it, as a share
    (0.5: 1.5 times; the two threads trade the interpreter lock and the caches: on an H200 a
    request of 1,000 prompt tokens took 1.9-2.4 ms while the loop thread waited for the
    device, 3.2 ms beside an eager launch);
    ``own_process``: the engine runs in a process of its own (the event loop's work is the
    front process's and never holds the loop thread's lock); ``hop`` and ``hop_token``: the
    seconds, and per prompt token, from a request's handling to the engine having it (the
    front's sender thread, the pipe, the engine's command thread: a delay, in order, that
    keeps no event loop busy); ``relay``: the share of a pass spent before its first chunk
    is written (the batch of outputs unpacked and handed to its streams); ``keep_alive``:
    the seconds a finished request's connection stays open for the client's next request
    (``nano-engine serve --keep-alive-timeout``'s default and httpx's: 5; 0: every request
    on a new connection); ``spread``: what a pass over the streams took over its cost as
    measured, by octave of streams ((octave, ratios of mean 1), from the profile's passes):
    each pass costs its mean times a ratio drawn from its octave's (the nearest measured),
    so that a pass sometimes outlasts the next step and merges its tokens, as the front's
    do; none: every pass its mean."""

    request: float
    prompt_token: float
    passes: tuple[tuple[float, float], ...]
    latency: float = 0.0
    first_request: float = 0.0
    busy: float = 0.0
    own_process: bool = False
    hop: float = 0.0
    hop_token: float = 0.0
    relay: float = 0.0
    keep_alive: float = 5.0
    spread: tuple[tuple[int, tuple[float, ...]], ...] = ()

    def __post_init__(self) -> None:
        if not 0.0 <= self.relay <= 1.0:
            raise ValueError(f"relay is a share of a pass, in [0, 1]; got {self.relay}")
        for octave, ratios in self.spread:
            if not ratios or not all(x > 0 and math.isfinite(x) for x in ratios):
                raise ValueError(f"the passes' spread of octave {octave} must be ratios > 0")
        names = ("request", "prompt_token", "latency", "first_request", "busy", "hop")
        for name in (*names, "hop_token", "keep_alive"):
            if not getattr(self, name) >= 0:  # (NaN too)
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")

    def scaled(self, factor: float) -> ServerCosts:
        """These costs on a host ``factor`` times as slow (its CPU's work and wake-ups)."""
        return replace(
            self,
            request=self.request * factor,
            prompt_token=self.prompt_token * factor,
            passes=tuple((n, seconds * factor) for n, seconds in self.passes),
            latency=self.latency * factor,
            first_request=self.first_request * factor,
            hop=self.hop * factor,
            hop_token=self.hop_token * factor,
        )

    @cached_property
    def _passes(self) -> Piecewise:
        return Piecewise(self.passes)

    def pass_seconds(self, streams: int) -> float:
        return self._passes(streams)

    def pass_ratios(self, streams: int) -> tuple[float, ...]:
        """The ratios a pass over ``streams`` streams draws from: its octave's, else the
        nearest measured octave's; (1.0,) without a spread."""
        if not self.spread:
            return (1.0,)
        octave = max(0, int(math.log2(max(1, streams))))
        return min(self.spread, key=lambda item: abs(item[0] - octave))[1]


class ServerHost:
    """The event loop's iterations follow one another while they have work (it has the lock
    first); the loop thread computes only while the event loop has nothing to do."""

    def __init__(self, costs: ServerCosts, receive: Receive) -> None:
        self.costs, self.receive = costs, receive
        self.busy_until = 0.0  # the event loop's work started so far ends here
        self._requests: deque[tuple[float, int, int]] = deque()  # (arrival, position, tokens)
        self._backlog: deque[tuple[float, int, int]] = deque()  # new connections, to accept
        self._idle: deque[float] = deque()  # kept-alive connections: since when idle
        self._publications: deque[tuple[float, list[tuple[int, bool]]]] = deque()
        self._accepted: deque[tuple[float, int]] = deque()  # (when the engine has it, position)
        self._first = True
        self._handed = 0.0  # when the last request handled reaches the engine
        # The callbacks the event loop's last iteration queued for its next: the requests
        # whose connection it accepted (their bytes read next) and whose bytes it read
        # (handled next), as (position, prompt tokens); the streams it woke (seq_id,
        # finished), passed over next.
        self._to_read: list[tuple[int, int]] = []
        self._to_handle: list[tuple[int, int]] = []
        self._to_pass: list[tuple[int, bool]] = []
        # (a pass's mean cost and the ratios it draws from, by its streams, as asked)
        self._passes: dict[int, tuple[float, tuple[float, ...]]] = {}
        self._next = math.inf  # when the event loop starts its next piece of work
        self._computing = False  # the loop thread has work to do (in ``cpu``)
        self._rng = random.Random(0)  # (the passes' spread: drawn the same way each run)

    # ---- what the simulator calls ------------------------------------------------------------

    def send(self, t: float, position: int, prompt_tokens: int) -> None:
        arrival = t + self.costs.latency
        self._requests.append((arrival, position, prompt_tokens))
        self._next = min(self._next, max(arrival, self.busy_until))

    def next_accept(self, t: float) -> float:
        """When the next request is accepted, at the earliest ``t`` (inf: none is on its
        way); the event loop runs until then."""
        self._run(t)
        while not self._accepted:
            if self._next == math.inf:
                return math.inf
            self._run(self._next)
        return max(t, self._accepted[0][0])

    def accepted_by(self, t: float) -> bool:
        self._run(t)
        return bool(self._accepted) and self._accepted[0][0] <= t

    def quiet_until(self) -> float:
        """No request is accepted before this time: the next one's arrival at the front,
        where none is further on its way (its outputs may be passed over later: the event
        loop's timeline does not depend on when it is run)."""
        if self._accepted or self._to_read or self._to_handle or self._backlog:
            return self._accepted[0][0] if self._accepted else self.busy_until
        return self._requests[0][0] if self._requests else math.inf

    def accepted(self, t: float) -> list[tuple[float, int]]:
        self._run(t)
        out = []
        while self._accepted and self._accepted[0][0] <= t:
            out.append(self._accepted.popleft())
        return out

    def cpu(self, t: float, seconds: float) -> float:
        """The loop thread computes for ``seconds`` from ``t``, only while the event loop is
        idle: the event loop keeps the lock while it has work (the loop thread releases it
        around every torch call and waits a switch interval to get it back; the event loop
        holds it for whole intervals), as measured: a pass over 256 streams delays the loop
        thread by its whole length. The event loop's work that starts meanwhile is the
        costlier work beside a computing thread (``ServerCosts.busy``). An engine in a
        process of its own computes undisturbed."""
        if self.costs.own_process:  # (its event loop runs when asked what it has done)
            return t + seconds
        if t >= self._next:
            self._run(t)  # (begun while the loop thread did not compute)
        self._computing = True
        try:
            while True:
                if self.busy_until > t:
                    t = self.busy_until
                    self._run(t)
                    continue
                start = self._next
                if t + seconds <= start:
                    return t + seconds
                seconds -= start - t
                t = start
                self._run(t)
        finally:
            self._computing = False

    def free(self, t: float, until: float) -> float:
        """The loop thread holds no lock until ``until``: the event loop runs beside it."""
        if until >= self._next and not self.costs.own_process:
            self._run(until)
        return max(t, until)

    def publish(self, t: float, streams: list[tuple[int, bool]]) -> None:
        if streams:
            self._publications.append((t, streams))
            if t < self._next:
                self._next = max(t, self.busy_until)

    def _poll(self, t: float, to_handle: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """The requests that have come by the poll at ``t``: each on a kept-alive connection
        read now (into ``to_handle``, for the next iteration), the others queued as new
        connections, one of which is accepted (returned: read by the next iteration)."""
        r, idle, backlog = self._requests, self._idle, self._backlog
        keep = self.costs.keep_alive
        while r and r[0][0] <= t:
            request = r.popleft()
            while idle and request[0] - idle[0] > keep:  # (closed meanwhile)
                idle.popleft()
            if idle and idle[0] <= request[0]:
                idle.popleft()
                to_handle.append(request[1:])
            else:
                backlog.append(request)
        return [backlog.popleft()[1:]] if backlog else []

    def drain(self, t: float) -> float:
        """Run the event loop until it has sent everything; the time it is done."""
        while self._next < math.inf:
            self._run(self._next)
        return max(t, self.busy_until)

    # ---- the event loop ----------------------------------------------------------------------

    def _run(self, t: float) -> None:
        """Run every iteration that starts by ``t``. An iteration runs the callbacks the
        previous one queued: the handling of the requests whose bytes it read (each accepted
        at its end, on its way to the engine), then a pass over the streams it woke, each
        stream's chunk sent in turn; then it polls (libuv's order): one new connection that
        has come by then accepted (its bytes read by the next iteration, its request handled
        by the one after), the outputs published by then taken (their streams woken for the
        next iteration, the callback that wakes them folded into it; a stream woken twice
        sends one merged chunk)."""
        if t < self._next:
            return
        r, p, c, receive = self._requests, self._publications, self.costs, self.receive
        backlog, idle, keep = self._backlog, self._idle, c.keep_alive > 0
        passes = self._passes
        to_read, to_handle, to_pass = self._to_read, self._to_handle, self._to_pass
        busy = self.busy_until
        while True:
            if to_read or to_handle or to_pass or backlog:  # (backlog: the next poll accepts)
                start = busy
                if start > t:
                    break
            else:  # (idle until something comes)
                start = min(r[0][0] if r else math.inf, p[0][0] if p else math.inf)
                start = max(start, busy)
                if start > t or start == math.inf:  # (nothing will come: done, even at inf)
                    break
                if not (r and r[0][0] <= start):  # outputs alone: the poll that takes them
                    to_pass = _woken(p, start)  # (an iteration of nothing else)
            work = 0.0
            for position, tokens in to_handle:
                cost = c.request + c.prompt_token * tokens
                if self._computing:
                    cost *= 1.0 + c.busy
                if self._first:
                    cost += c.first_request
                    self._first = False
                work += cost
                # (one pipe: requests reach the engine in order)
                self._handed = max(self._handed, start + work + c.hop + c.hop_token * tokens)
                self._accepted.append((self._handed, position))
            if to_pass:
                n = len(to_pass)
                if n not in passes:
                    passes[n] = (c.pass_seconds(n), c.pass_ratios(n))
                total, ratios = passes[n]
                if len(ratios) > 1:
                    total *= ratios[self._rng.randrange(len(ratios))]
                each = total * (1.0 - c.relay) / n
                when = start + work + c.latency + total * c.relay
                for seq_id, finished in to_pass:
                    when += each
                    receive(seq_id, when, finished)
                    if finished and keep:  # (its connection, kept alive for the next)
                        idle.append(when)
                work += total
            busy = start + work  # (the poll, after the callbacks)
            to_handle = to_read
            to_read = self._poll(busy, to_handle)
            to_pass = _woken(p, busy)
        self._to_read, self._to_handle, self._to_pass = to_read, to_handle, to_pass
        self.busy_until, self._next = busy, start


def _woken(publications: deque, start: float) -> list[tuple[int, bool]]:
    """The streams of the outputs published by ``start`` (taken from ``publications``), as
    (seq_id, finished): each once, finished if any of its outputs was the last."""
    woken: list[tuple[int, bool]] = []
    while publications and publications[0][0] <= start:
        streams = publications.popleft()[1]
        if woken:  # (outputs of several steps: a stream's merged)
            merged = dict(woken)
            for seq_id, finished in streams:
                merged[seq_id] = merged.get(seq_id, False) or finished
            woken = list(merged.items())
        else:
            woken = streams
    return woken
