"""An OpenAI-compatible HTTP server over the streaming engine (FastAPI + uvicorn).

POST /v1/completions and /v1/chat/completions (server-sent events with ``stream``), GET
/v1/models, /health and /metrics, POST /tokenize and /detokenize. Errors use OpenAI's body
``{"error": {"message", "type", "param", "code"}}``. A client that disconnects aborts its
requests; SIGTERM stops accepting, lets in-flight requests finish within a grace period, then
aborts the rest and exits 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import signal
import sys
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from nano_engine.engine import LLMEngine
from nano_engine.llm import merge_outputs
from nano_engine.metrics import ServerMetrics
from nano_engine.outputs import CompletionOutput, RequestOutput
from nano_engine.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from nano_engine.streams import EngineDeadError, RequestStream

log = logging.getLogger("nano_engine.server")


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        kind: str = "invalid_request_error",
        param: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.param = status, message, kind, param


def error_response(
    status: int,
    message: str,
    kind: str = "invalid_request_error",
    param: str | None = None,
    headers: dict | None = None,
) -> JSONResponse:
    body = {"error": {"message": message, "type": kind, "param": param, "code": status}}
    return JSONResponse(body, status_code=status, headers=headers)


class Gate:
    """ASGI middleware in front of the routes: 413 for a request body over ``max_bytes``
    (declared or streamed), then 401 for the API routes without the right bearer key. Plain
    ASGI: starlette's ``BaseHTTPMiddleware`` would add a task and a queue to every streamed
    chunk."""

    PROTECTED = ("/v1", "/tokenize", "/detokenize")

    def __init__(self, app, max_bytes: int, api_key: str | None = None) -> None:
        self.app, self.max_bytes = app, max_bytes
        self.authorization = f"Bearer {api_key}".encode() if api_key else None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        declared = headers.get(b"content-length")
        too_big = error_response(
            413, f"the request body is over {self.max_bytes} bytes", "request_too_large"
        )
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            return await too_big(scope, receive, send)
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
        while message.get("more_body"):
            message = await receive()
            if message["type"] != "http.request":  # the client left: let the app see it
                return await self.app(scope, _replay(message, receive), send)
            chunks.append(message.get("body", b""))
            received += len(chunks[-1])
            if received > self.max_bytes:
                return await too_big(scope, receive, send)
        body = {"type": "http.request", "body": b"".join(chunks)}
        await self.app(scope, _replay(body, receive), send)


def _replay(first: dict, receive):
    """An ASGI receive that gives ``first`` (a message already read), then hands over to
    ``receive`` (disconnects)."""
    pending = [first]

    async def replayed():
        return pending.pop() if pending else await receive()

    return replayed


class Server:
    """The routes over one engine. ``max_queue``: sequences queued or running (a request with
    n = 4 counts 4) beyond which new requests get 503."""

    def __init__(self, engine: LLMEngine, model_name: str, max_queue: int = 1024) -> None:
        self.engine, self.model_name = engine, model_name
        self.max_queue = max_queue
        self.metrics = ServerMetrics(engine)
        self.created = int(time.time())
        self.app = FastAPI(title="nano-engine", version="1")
        self._routes()

    # ---- plumbing ----------------------------------------------------------------------------

    def _routes(self) -> None:
        app = self.app

        @app.exception_handler(APIError)
        async def api_error(_: Request, e: APIError):
            return error_response(e.status, e.message, e.kind, e.param)

        @app.exception_handler(StarletteHTTPException)
        async def http_error(_: Request, e: StarletteHTTPException):  # 404, 405: no such route
            kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
            return error_response(e.status_code, str(e.detail), kind, headers=e.headers)

        @app.exception_handler(RequestValidationError)
        async def invalid(_: Request, e: RequestValidationError):
            first = e.errors()[0] if e.errors() else {}
            where = ".".join(str(x) for x in first.get("loc", ())[1:]) or None
            return error_response(
                400,
                f"invalid request: {first.get('msg', e)}" + (f" ({where})" if where else ""),
                param=where,
            )

        app.get("/health")(self.health)
        app.get("/metrics")(self.prometheus)
        app.get("/v1/models")(self.models)
        app.post("/v1/completions")(self.completions)
        app.post("/v1/chat/completions")(self.chat_completions)
        app.post("/tokenize")(self.tokenize)
        app.post("/detokenize")(self.detokenize)

    async def health(self) -> Response:
        if self.engine.alive:
            return Response(status_code=200)
        return error_response(
            503, f"the engine is not running: {self.engine.error}", "service_unavailable"
        )

    async def prometheus(self) -> Response:
        return Response(self.metrics.render(), media_type="text/plain; version=0.0.4")

    async def models(self) -> dict:
        return {
            "object": "list",
            "data": [
                {
                    "id": self.model_name,
                    "object": "model",
                    "created": self.created,
                    "owned_by": "nano-engine",
                    "max_model_len": self.engine.max_model_len,
                }
            ],
        }

    def _check_model(self, name: str) -> None:
        if name != self.model_name:
            raise APIError(
                404,
                f"the model {name!r} does not exist; this server serves {self.model_name!r}",
                "not_found_error",
                param="model",
            )

    def _submit(self, prompts: list, params, prefix: str, stream: bool) -> list[RequestStream]:
        """Validate and queue one engine request per prompt (all or none)."""
        if self.engine.num_sequences + len(prompts) * params.n > self.max_queue:
            raise APIError(
                503,
                f"the server is at its queue limit ({self.max_queue} sequences)",
                "service_unavailable",
            )
        try:
            requests = [
                self.engine.make_request(p, params, f"{prefix}-{i}", stream_deltas=stream)
                for i, p in enumerate(prompts)
            ]
            self.engine.submit(requests)
        except EngineDeadError as e:
            raise APIError(503, str(e), "service_unavailable") from e
        except (ValueError, TypeError) as e:
            raise APIError(400, str(e)) from e
        return [r.stream for r in requests]

    def _abort(self, streams: list[RequestStream]) -> None:
        for stream in streams:
            if not stream.finished:
                self.engine.abort(stream.request_id)

    async def _outputs(
        self, streams: list[RequestStream], raw: Request
    ) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Deltas of several streams as they come, as (prompt index, output); a client that
        goes away aborts what is left. One event wakes this reader for all its streams; a
        reader that falls behind gets the waiting deltas of a stream merged into one."""
        wake = asyncio.Event()
        for stream in streams:
            stream.attach(wake)
        gone = asyncio.create_task(_disconnected(raw, wake))
        try:
            while True:
                for i, stream in enumerate(streams):
                    # Deltas that queued up while this reader was behind go out as one.
                    merged = None
                    while not stream.finished and (out := stream.get_nowait()) is not None:
                        merged = out if merged is None else merge_outputs(merged, out)
                    if merged is not None:
                        yield i, merged
                if all(stream.finished for stream in streams):
                    return
                if gone.done():
                    raise ConnectionAbortedError from (
                        None if gone.cancelled() else gone.exception()
                    )
                await wake.wait()
                wake.clear()
        finally:
            gone.cancel()
            self._abort(streams)

    async def _collect(self, streams, raw) -> list[RequestOutput]:
        results: list[RequestOutput | None] = [None] * len(streams)
        try:
            async for i, delta in self._outputs(streams, raw):
                results[i] = merge_outputs(results[i], delta)
        except EngineDeadError as e:
            raise APIError(503, str(e), "service_unavailable") from e
        except ConnectionAbortedError:
            raise APIError(499, "the client closed the connection") from None
        for out in results:
            self.metrics.observe(out)
        return results

    # ---- completions -------------------------------------------------------------------------

    async def completions(self, body: CompletionRequest, raw: Request):
        self._check_model(body.model)
        params = self._params(body, body.max_tokens, body.logprobs)
        prompts = body.prompts()
        if not prompts:
            raise APIError(400, "the prompt is empty", param="prompt")
        rid = _request_id(raw, "cmpl")
        streams = self._submit(prompts, params, rid, body.stream)
        head = {
            "id": rid,
            "object": "text_completion",
            "created": int(time.time()),
            "model": self.model_name,
        }
        n = params.n
        if body.stream:
            return self._sse(self._completion_chunks(streams, raw, head, n, body))
        outputs = await self._collect(streams, raw)
        choices = [
            self._completion_choice(i * n + o.index, o, body.logprobs is not None)
            for i, out in enumerate(outputs)
            for o in out.outputs
        ]
        return {**head, "choices": choices, "usage": _usage(outputs)}

    async def _completion_chunks(self, streams, raw, head, n, body):
        totals: list[RequestOutput | None] = [None] * len(streams)
        async for i, delta in self._outputs(streams, raw):
            totals[i] = merge_outputs(totals[i], delta)
            choices = [
                self._completion_choice(i * n + o.index, o, body.logprobs is not None)
                for o in delta.outputs
            ]
            yield {**head, "choices": choices}
            if delta.finished:
                self.metrics.observe(totals[i])
        if body.include_usage:
            yield {**head, "choices": [], "usage": _usage(totals)}

    def _completion_choice(self, index: int, o: CompletionOutput, logprobs: bool) -> dict:
        choice = {
            "index": index,
            "text": o.text,
            "logprobs": None,
            "finish_reason": o.finish_reason,
            "stop_reason": o.stop_reason,
        }
        if logprobs and o.logprobs is not None:
            tokens = [self._token(lp.token_id) for lp in o.logprobs]
            choice["logprobs"] = {
                "tokens": tokens,
                "token_logprobs": [lp.logprob for lp in o.logprobs],
                "top_logprobs": [{self._token(t): v for t, v in lp.top} for lp in o.logprobs],
                "text_offset": [sum(len(t) for t in tokens[:k]) for k in range(len(tokens))],
            }
        return choice

    # ---- chat --------------------------------------------------------------------------------

    async def chat_completions(self, body: ChatCompletionRequest, raw: Request):
        self._check_model(body.model)
        params = self._params(body, body.max_new_tokens, body.num_logprobs)
        ids = self._chat_ids(body.messages, body.add_generation_prompt, "chat completions")
        rid = _request_id(raw, "chatcmpl")
        streams = self._submit([ids], params, rid, body.stream)
        head = {
            "id": rid,
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self.model_name,
        }
        if body.stream:
            return self._sse(
                self._chat_chunks(streams, raw, {**head, "object": "chat.completion.chunk"}, body)
            )
        outputs = await self._collect(streams, raw)
        choices = [
            {
                "index": o.index,
                "message": {"role": "assistant", "content": o.text},
                "logprobs": self._chat_logprobs(o, body),
                "finish_reason": o.finish_reason,
                "stop_reason": o.stop_reason,
            }
            for o in outputs[0].outputs
        ]
        return {**head, "choices": choices, "usage": _usage(outputs)}

    async def _chat_chunks(self, streams, raw, head, body):
        total, started = None, set()
        async for _, delta in self._outputs(streams, raw):
            total = merge_outputs(total, delta)
            choices = []
            for o in delta.outputs:
                message = {"content": o.text}
                if o.index not in started:
                    started.add(o.index)
                    message["role"] = "assistant"
                choices.append(
                    {
                        "index": o.index,
                        "delta": message,
                        "logprobs": self._chat_logprobs(o, body),
                        "finish_reason": o.finish_reason,
                    }
                )
            yield {**head, "choices": choices}
            if delta.finished:
                self.metrics.observe(total)
        if body.include_usage:
            yield {**head, "choices": [], "usage": _usage([total])}

    def _chat_logprobs(self, o: CompletionOutput, body: ChatCompletionRequest) -> dict | None:
        if not body.logprobs or o.logprobs is None:
            return None

        def entry(token_id: int, logprob: float) -> dict:
            token = self._token(token_id)
            return {"token": token, "logprob": logprob, "bytes": list(token.encode())}

        return {
            "content": [
                {**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]}
                for lp in o.logprobs
            ]
        }

    # ---- tokens ------------------------------------------------------------------------------

    async def tokenize(self, body: TokenizeRequest) -> dict:
        if body.model is not None:
            self._check_model(body.model)
        tokenizer = self._tokenizer("tokenize")
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give exactly one of prompt and messages")
        if body.messages is not None:
            ids = self._chat_ids(body.messages, True, "tokenize")
        else:
            ids = tokenizer(body.prompt, add_special_tokens=body.add_special_tokens).input_ids
        return {"tokens": ids, "count": len(ids), "max_model_len": self.engine.max_model_len}

    async def detokenize(self, body: DetokenizeRequest) -> dict:
        if body.model is not None:
            self._check_model(body.model)
        vocab = self.engine.model_config.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(
                400, f"token ids {bad[:5]} are outside the vocabulary [0, {vocab})", param="tokens"
            )
        return {"prompt": self._tokenizer("detokenize").decode(body.tokens)}

    # ---- helpers -----------------------------------------------------------------------------

    def _params(self, body, max_tokens, logprobs):
        try:
            return body.sampling_params(max_tokens, logprobs)
        except ValueError as e:
            raise APIError(400, str(e)) from e

    def _chat_ids(self, messages, add_generation_prompt: bool, what: str) -> list[int]:
        """The token ids of messages through the chat template (400 where it rejects them)."""
        tokenizer = self._tokenizer(what)
        try:
            text = tokenizer.apply_chat_template(
                [m.template_dict() for m in messages],
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
            )
        except Exception as e:  # a template that rejects these messages: the client's input
            raise APIError(400, f"the chat template failed: {e}", param="messages") from e
        return tokenizer(text, add_special_tokens=False).input_ids

    def _token(self, token_id: int) -> str:
        tokenizer = self.engine.tokenizer
        return tokenizer.decode([token_id]) if tokenizer is not None else f"token_id:{token_id}"

    def _tokenizer(self, what: str):
        if self.engine.tokenizer is None:
            raise APIError(
                400,
                f"{what} needs a tokenizer; this server runs without one "
                "(skip_tokenizer_init): send token ids",
            )
        return self.engine.tokenizer

    def _sse(self, chunks: AsyncIterator[dict]) -> StreamingResponse:
        """Server-sent events, ending with ``data: [DONE]``; a failure mid-stream is sent as an
        error event (the status line has gone already)."""

        async def events():
            try:
                async for chunk in chunks:
                    yield f"data: {json.dumps(chunk)}\n\n"
            except APIError as e:
                yield _event_error(e.status, e.message, e.kind)
            except (EngineDeadError, ConnectionAbortedError) as e:
                yield _event_error(503, str(e), "service_unavailable")
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")


async def _disconnected(raw: Request, wake: asyncio.Event) -> None:
    """Return once the client has gone (the server sends ``http.disconnect``; no polling).
    A failure to listen counts as gone."""
    try:
        while (await raw.receive())["type"] != "http.disconnect":
            pass
    finally:
        wake.set()


def _request_id(raw: Request, kind: str) -> str:
    """The client's ``X-Request-Id`` header, as vLLM takes it (a step log can then be matched
    with the client's records), else a fresh one."""
    given = raw.headers.get("x-request-id")
    if given is not None and not 0 < len(given) <= 256:
        raise APIError(400, "the X-Request-Id header must be 1 to 256 characters")
    return given or f"{kind}-{uuid.uuid4().hex}"


def _event_error(status: int, message: str, kind: str) -> str:
    error = {"message": message, "type": kind, "param": None, "code": status}
    return f"data: {json.dumps({'error': error})}\n\n"


def _usage(outputs: list[RequestOutput]) -> dict:
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def build_app(
    engine: LLMEngine,
    model_name: str,
    api_key: str | None = None,
    max_body_bytes: int = 1 << 20,
    max_queue: int = 1024,
):
    """The ASGI app: the routes behind the body-size limit and the key check."""
    return Gate(Server(engine, model_name, max_queue).app, max_body_bytes, api_key)


def serve(
    engine: LLMEngine,
    model_name: str,
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | None = None,
    max_body_bytes: int = 1 << 20,
    max_queue: int = 1024,
    grace_period: float = 30.0,
) -> int:
    """Run until SIGINT / SIGTERM: stop accepting, let in-flight requests finish within the
    grace period (uvicorn cancels the rest, which aborts their engine requests), shut down."""
    import uvicorn

    # The engine's step loop shares the GIL with this event loop; every time it waits for the
    # GPU it must win the GIL back from a busy event loop, which by default takes up to 5 ms.
    sys.setswitchinterval(0.0005)

    class GracefulServer(uvicorn.Server):
        """Shuts down on SIGTERM / SIGINT and returns (uvicorn would re-raise the signal after
        its graceful shutdown, so the process would not exit 0)."""

        @contextlib.contextmanager
        def capture_signals(self):
            handled = (signal.SIGINT, signal.SIGTERM)
            previous = {sig: signal.signal(sig, self.handle_exit) for sig in handled}
            try:
                yield
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)

    app = build_app(engine, model_name, api_key, max_body_bytes, max_queue)
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level="warning",
        timeout_graceful_shutdown=grace_period,
        access_log=False,
    )
    server = GracefulServer(config)
    log.warning("serving %s on http://%s:%d", model_name, host, port)
    try:
        server.run()
    finally:
        engine.shutdown()
    return 0
