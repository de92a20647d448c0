"""Per-request output streams, fed by the engine's step loop and read from any thread or from
asyncio."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable, Iterator

from nano_engine.outputs import RequestOutput, WireOutput


class EngineDeadError(RuntimeError):
    """The engine's step loop stopped (an error, a dead worker, or shutdown)."""


class RequestStream:
    """Incremental ``RequestOutput``s of one request, ending with one whose ``finished`` is
    True. Iterate it (blocking) or ``async for`` it; an engine failure is raised to the reader.
    Several streams read by one coroutine can share one event (``attach``)."""

    wire = False  # its outputs published as they travel between processes (a replica's)

    def __init__(self, request_id: str, notify: Callable[[RequestStream], None] | None = None):
        self.request_id = request_id
        self._items: deque[RequestOutput | BaseException] = deque()
        self._cond = threading.Condition()
        self._notify = notify
        self._waker: tuple[asyncio.AbstractEventLoop, asyncio.Event] | None = None
        self.finished = False
        self.engine_index = 0  # the replica that serves it, in a fleet

    def put(self, item: RequestOutput | BaseException) -> None:
        """Called by the engine's thread."""
        publish([(self, item)])

    def _append(self, item) -> tuple[asyncio.AbstractEventLoop, asyncio.Event] | None:
        with self._cond:
            self._items.append(item)
            self._cond.notify_all()
            return self._waker

    def attach(self, event: asyncio.Event) -> None:
        """Set ``event`` (from the engine's thread, on the running loop) whenever an output
        arrives; read the outputs with ``get_nowait``."""
        with self._cond:
            self._waker = (asyncio.get_running_loop(), event)
            if self._items:
                event.set()

    def get(self, timeout: float | None = None) -> RequestOutput | None:
        """The next output, blocking up to ``timeout`` seconds (None: no new output yet)."""
        with self._cond:
            if not self._items and not self._cond.wait_for(lambda: self._items, timeout):
                return None
            return self._take()

    def get_nowait(self) -> RequestOutput | None:
        with self._cond:
            return self._take() if self._items else None

    def drain(self) -> list[RequestOutput | BaseException]:
        """Every output waiting, at once (an engine failure as the last item, not raised)."""
        with self._cond:
            items = list(self._items)
            self._items.clear()
        if items:
            last = items[-1]
            self.finished = isinstance(last, BaseException) or last.finished
        return items

    def _take(self) -> RequestOutput:
        item = self._items.popleft()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        self.finished = item.finished
        return item

    def __iter__(self) -> Iterator[RequestOutput]:
        while not self.finished:
            item = self.get()
            if item is not None:
                yield item

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        event = asyncio.Event()
        self.attach(event)
        while not self.finished:
            item = self.get_nowait()
            if item is not None:
                yield item
                continue
            await event.wait()
            event.clear()


def publish(
    items: Iterable[tuple[RequestStream, RequestOutput | WireOutput | BaseException]],
) -> None:
    """Append outputs to their streams, waking each asyncio loop once for all of them (one
    wake-up per stream and step would cost the loop more than the outputs themselves)."""
    wake: dict[asyncio.AbstractEventLoop, list[asyncio.Event]] = {}
    try:
        for stream, item in items:
            waker = stream._append(item)
            if waker is not None:
                wake.setdefault(waker[0], []).append(waker[1])
            if stream._notify is not None:
                stream._notify(stream)
    finally:  # what was appended is read, even if a notify callback failed
        for loop, events in wake.items():
            with contextlib.suppress(RuntimeError):  # a closed loop: nobody is waiting there
                loop.call_soon_threadsafe(_set_all, events)


def _set_all(events: list[asyncio.Event]) -> None:
    for event in events:
        event.set()
