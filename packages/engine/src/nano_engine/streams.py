"""Per-request output streams, fed by the engine's step loop and read from any thread or from
asyncio."""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator

from nano_engine.outputs import RequestOutput


class EngineDeadError(RuntimeError):
    """The engine's step loop stopped (an error, a dead worker, or shutdown)."""


class RequestStream:
    """Incremental ``RequestOutput``s of one request, ending with one whose ``finished`` is
    True. Iterate it (blocking) or ``async for`` it; an engine failure is raised to the reader."""

    def __init__(self, request_id: str, notify: Callable[[RequestStream], None] | None = None):
        self.request_id = request_id
        self._items: deque[RequestOutput | BaseException] = deque()
        self._cond = threading.Condition()
        self._notify = notify
        self._loop: asyncio.AbstractEventLoop | None = None
        self._event: asyncio.Event | None = None
        self.finished = False

    def put(self, item: RequestOutput | BaseException) -> None:
        """Called by the engine's thread."""
        with self._cond:
            self._items.append(item)
            self._cond.notify_all()
            loop, event = self._loop, self._event
        if loop is not None:
            loop.call_soon_threadsafe(event.set)
        if self._notify is not None:
            self._notify(self)

    def get(self, timeout: float | None = None) -> RequestOutput | None:
        """The next output, blocking up to ``timeout`` seconds (None: no new output yet)."""
        with self._cond:
            if not self._items and not self._cond.wait_for(lambda: self._items, timeout):
                return None
            return self._take()

    def get_nowait(self) -> RequestOutput | None:
        with self._cond:
            return self._take() if self._items else None

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
        with self._cond:
            self._loop = asyncio.get_running_loop()
            self._event = asyncio.Event()
        while not self.finished:
            item = self.get_nowait()
            if item is not None:
                yield item
                continue
            await self._event.wait()
            self._event.clear()
