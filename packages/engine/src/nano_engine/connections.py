"""What the server does before a request reaches its route: a cap on open connections, a time
limit on reading a request (headers and body), the body-size limit and the API key.

uvicorn closes idle keep-alive connections (``timeout_keep_alive``) but has no read timeout and
no cap that closes connections (``limit_concurrency`` answers 503 and keeps the socket), so the
protocol class below adds both; the body's limits are ASGI middleware (``Gate``).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import traceback

from fastapi.responses import JSONResponse

log = logging.getLogger("nano_engine.server")

RAW_SEND = "nano_engine.send"  # the scope's key of the connection's own ASGI send


def error_body(status: int, message: str, kind: str, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def error_response(
    status: int,
    message: str,
    kind: str = "invalid_request_error",
    param: str | None = None,
    headers: dict | None = None,
) -> JSONResponse:
    return JSONResponse(error_body(status, message, kind, param), status, headers=headers)


def escape(text: str) -> str:
    """A client's string as one printable ASCII line (newlines and lone surrogates escaped), for
    the log."""
    return ascii(text)[1:-1]


class Gate:
    """ASGI middleware in front of the routes: 413 for a request body over ``max_bytes``
    (declared or streamed), 408 for one not received within ``read_timeout`` seconds, then 401
    for the API routes without the right bearer key; an unexpected failure is logged on one
    escaped line (the traceback holds no client data). Plain ASGI: starlette's
    ``BaseHTTPMiddleware`` would add a task and a queue to every streamed chunk."""

    PROTECTED = ("/v1", "/tokenize", "/detokenize")

    def __init__(
        self, app, max_bytes: int, api_key: str | None = None, read_timeout: float = 30.0
    ) -> None:
        self.app, self.max_bytes, self.read_timeout = app, max_bytes, read_timeout
        self.authorization = f"Bearer {api_key}".encode() if api_key else None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        try:
            await self._gate(scope, receive, send)
        except Exception as e:  # (the app has answered 500 already, where it still could)
            log.error(
                "internal error on %s %s: %s\n%s",
                scope["method"],
                escape(scope["path"]),
                escape(f"{type(e).__name__}: {e}"),
                "".join(traceback.format_tb(e.__traceback__)).rstrip(),
            )

    async def _gate(self, scope, receive, send):
        headers = dict(scope["headers"])
        declared = headers.get(b"content-length")

        def too_big() -> JSONResponse:  # (built only for a body that is)
            message = f"the request body is over {self.max_bytes} bytes"
            return error_response(413, message, "request_too_large")

        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            return await too_big()(scope, receive, send)
        if (
            self.authorization is not None
            and scope["path"].startswith(self.PROTECTED)
            and not hmac.compare_digest(headers.get(b"authorization", b""), self.authorization)
        ):
            denied = error_response(401, "a valid API key is required", "authentication_error")
            return await denied(scope, receive, send)
        # The body is read here, whole (it is small), so that one over the limit gets 413
        # however it was sent; the app then reads it from memory.
        chunks, received, message = [], 0, {"more_body": True}
        try:
            async with asyncio.timeout(self.read_timeout):
                while message.get("more_body"):
                    message = await receive()
                    if message["type"] != "http.request":  # the client left: nobody to answer
                        return
                    chunks.append(message.get("body", b""))
                    received += len(chunks[-1])
                    if received > self.max_bytes:
                        return await too_big()(scope, receive, send)
        except TimeoutError:
            late = error_response(
                408,
                f"the request body was not received within {self.read_timeout:g} s",
                "timeout",
            )
            return await late(scope, receive, send)
        body = {"type": "http.request", "body": b"".join(chunks)}
        # (the connection's own send, for a stream's chunks: the app's own middleware between
        # here and the route only notes the response's start, and costs each chunk its
        # layers; middleware added by a deployer, say compression, sees every chunk)
        if not getattr(self.app, "user_middleware", None):
            scope[RAW_SEND] = send
        await self.app(scope, _replay(body, receive), send)


def _replay(first: dict, receive):
    """An ASGI receive that gives ``first`` (a message already read), then hands over to
    ``receive`` (disconnects)."""
    pending = [first]

    async def replayed():
        return pending.pop() if pending else await receive()

    return replayed


def _refuse(transport: asyncio.Transport, status: int, reason: str, message: str, kind: str):
    """Answer on a connection no request cycle owns, and close it."""
    body = json.dumps(error_body(status, message, kind)).encode()
    retry = b"retry-after: 1\r\n" if status == 503 else b""
    transport.write(
        b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
        b"connection: close\r\n%s\r\n%s" % (status, reason.encode(), len(body), retry, body)
    )
    transport.close()


def http_protocol(read_timeout: float, max_connections: int) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol class (httptools where installed, else h11) with a connection
    cap (beyond it: 503 with ``Retry-After``, and the socket closed at once) and a time limit on
    receiving a request's headers, from the connection's start or the previous response's end
    (408, closed). At shutdown, a connection still sending its body is closed at once instead of
    being waited for."""
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as Base
    except ImportError:  # (httptools is optional)
        from uvicorn.protocols.http.h11_impl import H11Protocol as Base

    class Protocol(Base):
        _deadline: asyncio.TimerHandle | None = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            if len(self.connections) > max_connections:
                _refuse(
                    transport,
                    503,
                    "Service Unavailable",
                    f"the server is at its limit of {max_connections} connections",
                    "service_unavailable",
                )
                return
            self._arm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm()

        def connection_lost(self, exc) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
            super().connection_lost(exc)

        def shutdown(self) -> None:
            cycle = self.cycle
            if cycle is not None and cycle.more_body and not cycle.response_started:
                self.transport.close()  # (its receive() gets a disconnect)
            else:
                super().shutdown()

        def _arm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
            self._deadline = self.loop.call_later(read_timeout, self._timed_out, self.cycle)

        def _timed_out(self, armed) -> None:
            # No request's headers came since the deadline was set (a pipelined request that
            # was parsed already and runs now is no stall).
            idle = armed is None or armed.response_complete
            if self.cycle is armed and idle and not self.transport.is_closing():
                _refuse(
                    self.transport,
                    408,
                    "Request Timeout",
                    f"no complete request headers within {read_timeout:g} s",
                    "timeout",
                )

    return Protocol
