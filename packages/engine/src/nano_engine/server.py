"""An OpenAI-compatible HTTP server over the streaming engine (FastAPI + uvicorn).

POST /v1/completions and /v1/chat/completions (server-sent events with ``stream``), GET
/v1/models, /health and /metrics, POST /tokenize and /detokenize. Errors use OpenAI's body
``{"error": {"message", "type", "param", "code"}}``. A client that disconnects aborts its
requests; SIGTERM stops accepting, lets in-flight requests finish within a grace period, then
answers the rest with 503 (streams: a last error event) and exits 0.

The event loop only moves bytes: tokenization, the chat template and the building of large
responses run in a small thread pool (``cpu_workers`` at a time) unless they are small enough
to take less time than the hand-over, so that one client's big request never stalls the others.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import logging
import signal
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from nano_engine import bodies
from nano_engine._version import __version__
from nano_engine.chat_reply import ChatReply
from nano_engine.connections import RAW_SEND, Gate, error_body, error_response, http_protocol
from nano_engine.interpreter import tune_for_serving
from nano_engine.llm import merge_outputs, template_kwargs
from nano_engine.metrics import ServerMetrics
from nano_engine.outputs import CompletionOutput, RequestOutput
from nano_engine.protocol import (
    PROMPT_FORMS,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    FieldError,
    TokenizeRequest,
)
from nano_engine.reasoning import get_reasoning_parser
from nano_engine.streams import EngineDeadError, RequestStream
from nano_engine.structured import StructuredOutputsUnavailable
from nano_engine.tool_calls import Named, Required, ToolFormat, get_tool_parser
from nano_scheduler import SamplingParams

if TYPE_CHECKING:
    from nano_engine.data_parallel.fleet import Fleet
    from nano_engine.engine import LLMEngine

log = logging.getLogger("nano_engine.server")

# Work below these sizes runs on the event loop: less than the hand-over to a thread costs.
INLINE_CHARS = 4096  # characters to tokenize (about 4 ms for 4 KiB)
INLINE_ENTRIES = 2048  # tokens x (logprobs + 1) to render into a response


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        kind: str = "invalid_request_error",
        param: str | None = None,
        headers: dict | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.param = status, message, kind, param
        self.headers = headers


class Server:
    """The routes over one engine. ``max_queue``: sequences queued or running (a request with
    n = 4 counts 4) beyond which new requests get 503 (a request that alone needs more gets
    400). ``max_request_entries``: the most n x max_tokens x (logprobs + 1), over a request's
    prompts, that one request may ask for (400 beyond; it bounds the memory it can hold).
    ``cpu_workers``: threads for tokenization and response building."""

    def __init__(
        self,
        engine: LLMEngine | Fleet,
        model_name: str,
        max_queue: int = 1024,
        max_request_entries: int = 1 << 20,
        cpu_workers: int = 2,
        chat_template: str | None = None,
        tool_parser: str | None = None,
    ) -> None:
        """``tool_parser``: the format of tool calls in replies, read when tool_choice is
        "auto" (vLLM's --tool-call-parser with --enable-auto-tool-choice)."""
        self.engine, self.model_name = engine, model_name
        self.chat_template = chat_template  # (None: the tokenizer's)
        if tool_parser is not None:
            get_tool_parser(tool_parser)  # (ValueError for an unknown one)
        self.tool_parser = tool_parser
        parser = engine.config.reasoning_parser
        self.reasoning = get_reasoning_parser(parser) if parser is not None else None
        self.max_queue, self.max_request_entries = max_queue, max_request_entries
        self.metrics = ServerMetrics(engine, model_name)
        self.created = int(time.time())
        self.pool = ThreadPoolExecutor(cpu_workers, thread_name_prefix="nano-server-cpu")
        self._admit = threading.Lock()  # the queue check and the submission, as one
        self._readers: set[asyncio.Event] = set()  # the wake-ups of requests in flight
        self.expired = False  # the shutdown's grace period ran out
        self.choices = bodies.Choices(functools.lru_cache(maxsize=1 << 18)(self._decode_token))
        self.app = FastAPI(title="nano-engine", version="1")
        self._routes()

    # ---- plumbing ----------------------------------------------------------------------------

    def _routes(self) -> None:
        app = self.app

        @app.exception_handler(APIError)
        async def api_error(_: Request, e: APIError):
            return error_response(e.status, e.message, e.kind, e.param, e.headers)

        @app.exception_handler(StarletteHTTPException)
        async def http_error(_: Request, e: StarletteHTTPException):  # 404, 405: no such route
            kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
            return error_response(e.status_code, str(e.detail), kind, headers=e.headers)

        @app.exception_handler(RequestValidationError)
        async def invalid(_: Request, e: RequestValidationError):
            first = e.errors()[0] if e.errors() else {}
            loc = [x for x in first.get("loc", ())[1:] if x not in PROMPT_FORMS]
            where = ".".join(str(x) for x in loc) or None
            cause = first.get("ctx", {}).get("error")
            if isinstance(cause, FieldError):
                param = f"{where}.{cause.param}" if where else cause.param
                return error_response(400, str(cause), param=param)
            if first.get("type") == "json_invalid":  # (its loc is a character offset)
                reason = first.get("ctx", {}).get("error", first.get("msg", ""))
                return error_response(400, f"the body is not valid JSON: {reason} (at {where})")
            # (a validator's ValueError: its own words, without pydantic's "Value error, ")
            message = str(cause) if isinstance(cause, Exception) else first.get("msg", str(e))
            return error_response(
                400, f"invalid request: {message}" + (f" ({where})" if where else ""), param=where
            )

        @app.exception_handler(Exception)
        async def internal(_: Request, e: Exception):  # (logged by the Gate, escaped)
            return error_response(500, f"internal error: {type(e).__name__}", "internal_error")

        app.get("/health")(self.health)
        app.get("/metrics")(self.prometheus)
        app.get("/version")(self.version)
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

    async def version(self) -> dict:
        return {"version": __version__}

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

    def expire(self) -> None:
        """The shutdown's grace period is over: every request in flight ends now with 503 (a
        stream with a last error event)."""
        self.expired = True
        for wake in self._readers:
            wake.set()

    async def _work(self, cost: int, limit: int, fn: Callable, *args):
        """``fn(*args)``: on the loop when ``cost`` is within ``limit``, else in the pool."""
        if cost <= limit:
            return fn(*args)
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    def _check_model(self, name: str) -> None:
        if name != self.model_name:
            raise APIError(
                404,
                f"the model {name!r} does not exist; this server serves {self.model_name!r}",
                "not_found_error",
                param="model",
            )

    def _check_size(self, num_prompts: int, params: SamplingParams) -> None:
        """400 for a request that could never be served (more sequences than the queue holds,
        more output than one request may hold); 503 while the queue is full."""
        sequences = num_prompts * params.n
        if sequences > self.max_queue:
            raise APIError(
                400,
                f"this request needs {sequences} sequences (prompts x n), more than the "
                f"server ever queues ({self.max_queue}, --max-queue)",
                param="n",
            )
        tokens = params.max_tokens or self.engine.max_model_len
        entries = sequences * tokens * ((params.logprobs or 0) + 1)
        if entries > self.max_request_entries:
            raise APIError(
                400,
                f"this request may produce {entries} tokens and logprobs (prompts x n x "
                f"max_tokens x (logprobs + 1)), over the server's limit of "
                f"{self.max_request_entries} (--max-request-entries): lower n, max_tokens or "
                "logprobs",
                param="max_tokens",
            )
        self._check_queue(sequences)

    def _check_queue(self, sequences: int) -> None:
        if self.engine.num_sequences + sequences > self.max_queue:
            raise APIError(
                503,
                f"the server is at its queue limit ({self.max_queue} sequences): retry later",
                "service_unavailable",
                headers={"Retry-After": "1"},
            )

    def _submit(
        self,
        prompts: list,
        params,
        prefix: str,
        stream: bool,
        structured: str | None = None,
        reasoning: bool = False,
    ) -> list[RequestStream]:
        """Validate, tokenize and queue one engine request per prompt (all or none);
        ``structured``: the field that carries the output's constraint (compiled here);
        ``reasoning``: a chat, whose constraint applies after the model's reasoning."""
        try:
            requests = [
                self.engine.make_request(
                    p, params, f"{prefix}-{i}", stream_deltas=stream, reasoning=reasoning
                )
                for i, p in enumerate(prompts)
            ]
            with self._admit:
                self._check_queue(len(prompts) * params.n)
                self.engine.submit(requests)
        except EngineDeadError as e:
            raise APIError(503, str(e), "service_unavailable") from e
        except StructuredOutputsUnavailable as e:
            raise APIError(501, str(e), "not_implemented") from e
        except (ValueError, TypeError) as e:
            raise APIError(400, str(e), param=_param_of(str(e), structured)) from e
        return [r.stream for r in requests]

    async def _outputs(
        self, streams: list[RequestStream], raw: Request, n: int
    ) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Deltas of several streams as they come, as (prompt index, output); a client that
        goes away aborts what is left, and so does the end of the shutdown's grace period. One
        event wakes this reader for all its streams; a reader that falls behind gets the
        waiting deltas of a stream merged into one."""
        wake = asyncio.Event()
        for stream in streams:
            stream.attach(wake)
        self._readers.add(wake)
        done = [0] * len(streams)  # sequences finished, per stream
        gone = asyncio.create_task(_disconnected(raw, wake))
        try:
            while True:
                for i, stream in enumerate(streams):
                    # Deltas that queued up while this reader was behind go out as one.
                    merged = None
                    for out in () if stream.finished else stream.drain():
                        if isinstance(out, BaseException):
                            raise out
                        merged = out if merged is None else merge_outputs(merged, out)
                    if merged is not None:
                        done[i] += sum(o.finish_reason is not None for o in merged.outputs)
                        yield i, merged
                if all(stream.finished for stream in streams):
                    return
                if self.expired:
                    raise APIError(
                        503,
                        "the server shut down before this request finished (its grace period "
                        "ran out)",
                        "service_unavailable",
                    )
                if gone.done():
                    raise ConnectionAbortedError from (
                        None if gone.cancelled() else gone.exception()
                    )
                await wake.wait()
                wake.clear()
        finally:
            self._readers.discard(wake)
            gone.cancel()
            for i, stream in enumerate(streams):
                if not stream.finished:
                    self.engine.abort(stream.request_id)
                    self.metrics.aborted(n - done[i], stream.engine_index)

    async def _collect(self, streams, raw, n: int) -> list[RequestOutput]:
        results: list[RequestOutput | None] = [None] * len(streams)
        try:
            async for i, delta in self._outputs(streams, raw, n):
                results[i] = merge_outputs(results[i], delta)
        except EngineDeadError as e:
            raise APIError(503, str(e), "service_unavailable") from e
        except ConnectionAbortedError:
            raise APIError(499, "the client closed the connection") from None
        for out, stream in zip(results, streams):
            self.metrics.observe(out, stream.engine_index)
        return results

    # ---- completions -------------------------------------------------------------------------

    async def completions(self, body: CompletionRequest, raw: Request):
        _forget_json(raw)
        self._check_model(body.model)
        params = self._params(body, body.max_tokens, body.logprobs)
        prompts = body.prompts()
        if not prompts:
            raise APIError(400, "the prompt is empty", param="prompt")
        self._check_size(len(prompts), params)
        rid = _request_id(raw, body, "cmpl")
        chars = sum(len(p) for p in prompts if isinstance(p, str))
        streams = await self._work(
            _cost(chars, params),
            INLINE_CHARS,
            self._submit,
            prompts,
            params,
            rid,
            body.stream,
            body.structured_field,
        )
        head = {
            "id": rid,
            "object": "text_completion",
            "created": int(time.time()),
            "model": self.model_name,
        }
        n, logprobs = params.n, body.logprobs is not None
        if body.echo:
            self._tokenizer("echo")  # (token-id prompts are written back as text)
        if body.stream:
            return EventStream(self._completion_chunks(streams, raw, head, n, body))
        outputs = await self._collect(streams, raw, n)

        def render() -> Response:
            choices = (
                self.choices.completion(
                    i * n + o.index, o, logprobs, self._echo(body, out), out, body.echo
                )
                for i, out in enumerate(outputs)
                for o in out.outputs
            )
            return bodies.json_response(head, choices, bodies.usage(outputs))

        return await self._work(bodies.entries(outputs, params.logprobs), INLINE_ENTRIES, render)

    async def _completion_chunks(self, streams, raw, head, n, body):
        totals: list[RequestOutput | None] = [None] * len(streams)
        logprobs = body.logprobs is not None
        echoed: set[int] = set()  # (choices whose prompt went out, with their first delta)

        event = bodies.events_of(head)

        def render(i: int, delta: RequestOutput) -> str:
            plain = not (logprobs or body.echo or delta.prompt_logprobs is not None)
            choices = []
            for o in delta.outputs:
                index = i * n + o.index
                first = index not in echoed
                echoed.add(index)
                if plain:  # (most chunks: no logprobs, nothing echoed)
                    choices.append(bodies.plain_choice(index, o))
                    continue
                prefix = self._echo(body, delta) if first else ""
                prompt = delta if first else None
                choice = self.choices.completion(index, o, logprobs, prefix, prompt, body.echo)
                choices.append(bodies.encode(choice))
            return event(", ".join(choices))

        async for i, delta in self._outputs(streams, raw, n):
            totals[i] = merge_outputs(totals[i], delta)
            yield await self._work(
                bodies.entries([delta], body.logprobs), INLINE_ENTRIES, render, i, delta
            )
            if delta.finished:
                self.metrics.observe(totals[i], streams[i].engine_index)
        if body.include_usage:
            yield bodies.event({**head, "choices": [], "usage": bodies.usage(totals)})

    def _echo(self, body: CompletionRequest, out: RequestOutput) -> str:
        """The prompt, written back before the completion when ``echo`` asks for it."""
        if not body.echo:
            return ""
        if out.prompt is not None:
            return out.prompt
        return self.engine.tokenizer.decode(out.prompt_token_ids)

    # ---- chat --------------------------------------------------------------------------------

    async def chat_completions(self, body: ChatCompletionRequest, raw: Request):
        _forget_json(raw)
        self._check_model(body.model)
        params = self._params(body, body.max_new_tokens, body.num_logprobs)
        self._check_size(1, params)
        self._tokenizer("chat completions")
        rid = _request_id(raw, body, "chatcmpl")

        tools = self._tool_format(body)
        opened = False  # (the prompt leaves the model thinking)

        def submit() -> list[RequestStream]:
            nonlocal opened
            text = self._chat_prompt(
                body.messages, body.add_generation_prompt, body.chat_template_kwargs, body.tools
            )
            opened = self.reasoning is not None and self.reasoning.opened_in(text)
            ids = self.engine.tokenizer(text, add_special_tokens=False).input_ids
            return self._submit(
                [ids], params, rid, body.stream, body.structured_field, reasoning=True
            )

        streams = await self._work(_cost(_chars(body.messages), params), INLINE_CHARS, submit)
        head = {
            "id": rid,
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self.model_name,
        }
        reply = ChatReply(self.reasoning, opened, tools)
        if body.stream:
            return EventStream(
                self._chat_chunks(
                    streams, raw, {**head, "object": "chat.completion.chunk"}, body, params, reply
                )
            )
        outputs = await self._collect(streams, raw, params.n)

        def choice(o: CompletionOutput) -> dict:
            message, called = reply.message(o.text)
            return {
                "index": o.index,
                "message": message,
                "logprobs": self.choices.chat_logprobs(o, body.logprobs),
                "finish_reason": reply.finish_reason(o.finish_reason, called),
                "stop_reason": o.stop_reason,
            }

        def render() -> Response:
            top = head
            if outputs[0].prompt_logprobs is not None:  # (vLLM's, beside the choices)
                entries = [self.choices.prompt_entry(lp) for lp in outputs[0].prompt_logprobs]
                top = {**head, "prompt_logprobs": entries}
            return bodies.json_response(
                top, (choice(o) for o in outputs[0].outputs), bodies.usage(outputs)
            )

        return await self._work(bodies.entries(outputs, params.logprobs), INLINE_ENTRIES, render)

    async def _chat_chunks(self, streams, raw, head, body, params, reply: ChatReply):
        total, splits = None, {}
        event = bodies.events_of(head)

        def render(delta: RequestOutput) -> str:
            choices = []
            for o in delta.outputs:
                split = splits.setdefault(o.index, reply.stream())
                message, called = split.feed(o.text, final=o.finish_reason is not None)
                logprobs = self.choices.chat_logprobs(o, body.logprobs)
                finish = reply.finish_reason(o.finish_reason, called)
                choices.append(
                    f'{{"index": {o.index}, "delta": {bodies.encode_message(message)}, '
                    f'"logprobs": {"null" if logprobs is None else bodies.encode(logprobs)}, '
                    f'"finish_reason": {bodies.scalar(finish)}}}'
                )
            return event(", ".join(choices))

        async for _, delta in self._outputs(streams, raw, params.n):
            total = merge_outputs(total, delta)
            yield await self._work(
                bodies.entries([delta], params.logprobs), INLINE_ENTRIES, render, delta
            )
            if delta.finished:
                self.metrics.observe(total, streams[0].engine_index)
        if body.include_usage:
            yield bodies.event({**head, "choices": [], "usage": bodies.usage([total])})

    # ---- tokens ------------------------------------------------------------------------------

    async def tokenize(self, body: TokenizeRequest) -> dict:
        if body.model is not None:
            self._check_model(body.model)
        tokenizer = self._tokenizer("tokenize")
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give exactly one of prompt and messages")
        if body.messages is not None:
            chars = _chars(body.messages)
            work = functools.partial(
                self._chat_ids,
                body.messages,
                body.add_generation_prompt,
                body.chat_template_kwargs,
                body.tools,
            )
        else:
            chars = len(body.prompt)

            def work() -> list[int]:
                return tokenizer(body.prompt, add_special_tokens=body.add_special_tokens).input_ids

        ids = await self._work(chars, INLINE_CHARS, work)
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
        tokenizer = self._tokenizer("detokenize")
        text = await self._work(len(body.tokens), INLINE_CHARS // 4, tokenizer.decode, body.tokens)
        return {"prompt": text}

    # ---- helpers -----------------------------------------------------------------------------

    def _params(self, body, max_tokens, logprobs) -> SamplingParams:
        try:
            return body.sampling_params(max_tokens, logprobs)
        except ValueError as e:
            raise APIError(400, str(e), param=getattr(e, "param", None)) from e

    def _tool_format(self, body: ChatCompletionRequest) -> ToolFormat | None:
        """Where the reply's tool calls will be (None: it is content)."""
        forced = body.forced_tools
        if forced == "required":
            return Required()
        if forced is not None:
            return Named(forced)
        if not body.tools or body.tool_choice == "none":
            return None
        if self.tool_parser is None:
            if body.tool_choice == "auto":
                raise APIError(
                    400,
                    'tool_choice "auto" needs the server started with --enable-auto-tool-choice '
                    "and --tool-call-parser",
                    param="tool_choice",
                )
            return None  # (the tools reach the template; the reply is content)
        return get_tool_parser(self.tool_parser)

    def _chat_prompt(self, messages, add_generation_prompt: bool, kwargs=None, tools=None) -> str:
        """The messages (and tools) through the chat template (400 where it rejects them)."""
        try:
            extra = template_kwargs(kwargs)
        except ValueError as e:
            raise APIError(400, str(e), param="chat_template_kwargs") from e
        if tools:
            extra["tools"] = [t.model_dump(exclude_none=True) for t in tools]
        try:
            return self.engine.tokenizer.apply_chat_template(
                [m.template_dict() for m in messages],
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                chat_template=self.chat_template,
                **extra,
            )
        except Exception as e:  # a template that rejects these messages: the client's input
            raise APIError(400, f"the chat template failed: {e}", param="messages") from e

    def _chat_ids(
        self, messages, add_generation_prompt: bool, kwargs=None, tools=None
    ) -> list[int]:
        """The token ids of messages (and tools) through the chat template, as a chat's prompt
        (400 where it rejects them)."""
        text = self._chat_prompt(messages, add_generation_prompt, kwargs, tools)
        return self.engine.tokenizer(text, add_special_tokens=False).input_ids

    def _decode_token(self, token_id: int) -> str:
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


class EventStream(Response):
    """Server-sent events: each string ``events`` yields, then ``data: [DONE]``; a failure
    mid-stream, the end of the shutdown's grace period included, is sent as a last error event
    (the status line has gone already). starlette's StreamingResponse would add a task group and
    a second listener for the client's disconnect to every stream (the routes listen for it
    themselves) and a generator between the events and ``send``; with hundreds of streams the
    event loop's time per chunk is what bounds the server (benchmarks/bench_front.py)."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[str]) -> None:
        self.events, self.status_code, self.background = events, 200, None
        self.init_headers()  # (no content-length: it is streamed)

    async def __call__(self, scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
        write = scope.get(RAW_SEND, send)  # (the chunks past the middleware: see Gate)
        last = ""
        try:
            async for event in self.events:
                await write(
                    {"type": "http.response.body", "body": event.encode(), "more_body": True}
                )
        except APIError as e:
            last = bodies.event(error_body(e.status, e.message, e.kind))
        except (EngineDeadError, ConnectionAbortedError) as e:
            last = bodies.event(error_body(503, str(e), "service_unavailable"))
        finally:  # (its requests aborted now, should a send fail or the task be cancelled)
            await self.events.aclose()
        body = f"{last}data: [DONE]\n\n".encode()
        await send({"type": "http.response.body", "body": body, "more_body": False})
        if self.background is not None:  # (FastAPI's background tasks, where a route adds any)
            await self.background()


async def _disconnected(raw: Request, wake: asyncio.Event) -> None:
    """Return once the client has gone (the server sends ``http.disconnect``; no polling).
    A failure to listen counts as gone."""
    try:
        while (await raw.receive())["type"] != "http.disconnect":
            pass
    finally:
        wake.set()


def _forget_json(raw: Request) -> None:
    """Drop the parsed JSON body that starlette keeps on the request (the validated body has
    all of it): a streaming request lives for seconds, and a prompt's token ids held as a list
    are walked item by item on every full run of Python's cyclic collector (20-140 ms pauses
    of the whole server with hundreds of streams of long prompts)."""
    raw.__dict__.pop("_json", None)


def _request_id(raw: Request, body, kind: str) -> str:
    """The client's ``X-Request-Id`` header or ``request_id`` field, as vLLM takes them (a step
    log can then be matched with the client's records), else a fresh one."""
    given = raw.headers.get("x-request-id")
    if given is not None and not 0 < len(given) <= 256:
        raise APIError(400, "the X-Request-Id header must be 1 to 256 characters")
    return given or body.request_id or f"{kind}-{uuid.uuid4().hex}"


# request fields an engine error may begin with (its param)
_NAMED_IN_ERRORS = (
    "stop_token_ids",
    "allowed_token_ids",
    "logit_bias",
    "bad_words",
    "prompt_logprobs",
    "logprobs",
)


def _param_of(message: str, structured: str | None) -> str | None:
    """The request field an engine error names: the field that carried a constraint that did
    not compile, else the field the message begins with."""
    if message.startswith("structured outputs"):
        return structured
    return next((f for f in _NAMED_IN_ERRORS if message.startswith(f + " ")), None)


def _cost(chars: int, params: SamplingParams) -> int:
    """A request's work before it is queued: its text, and a grammar to compile (not on the
    event loop, however small: a schema may take a while)."""
    return chars if params.structured_outputs is None else max(chars, INLINE_CHARS + 1)


def _chars(messages) -> int:
    return sum(
        len(m.content) if isinstance(m.content, str) else sum(len(p.text) for p in m.content or ())
        for m in messages
    )


def build_app(
    engine: LLMEngine | Fleet,
    model_name: str,
    api_key: str | None = None,
    max_body_bytes: int = 1 << 20,
    max_queue: int = 1024,
    max_request_entries: int = 1 << 20,
    read_timeout: float = 30.0,
    cpu_workers: int = 2,
    chat_template: str | None = None,
    tool_parser: str | None = None,
) -> tuple[Gate, Server]:
    """The ASGI app (the routes behind the body limits and the key check), and its routes."""
    server = Server(
        engine, model_name, max_queue, max_request_entries, cpu_workers, chat_template, tool_parser
    )
    return Gate(server.app, max_body_bytes, api_key, read_timeout), server


def raise_open_file_limit() -> int:
    """Raise the soft limit on open files to the hard one (each connection holds one); returns
    the limit now in force."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        with contextlib.suppress(ValueError, OSError):
            target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def bind(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port`` (not yet listening: connections are refused until the
    server starts). Bind it before loading the model, so that a taken port fails at once."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # (restarts despite TIME_WAIT)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        where = f"[{host}]:{port}" if family == socket.AF_INET6 else f"{host}:{port}"
        reason = "the address is already in use" if e.errno == errno.EADDRINUSE else e.strerror
        raise OSError(e.errno, f"cannot serve on {where}: {reason or e}") from None
    return sock


def serve(
    engine: LLMEngine | Fleet,
    model_name: str,
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | None = None,
    max_body_bytes: int = 1 << 20,
    max_queue: int = 1024,
    grace_period: float = 30.0,
    max_request_entries: int = 1 << 20,
    read_timeout: float = 30.0,
    keep_alive_timeout: float = 5.0,
    max_connections: int = 1024,
    cpu_workers: int = 2,
    access_log: bool = False,
    sock: socket.socket | None = None,
    chat_template: str | None = None,
    tool_parser: str | None = None,
) -> int:
    """Run until SIGINT / SIGTERM: stop accepting, close idle and stalled connections, let
    in-flight requests finish within the grace period (then they get 503), shut down.
    ``access_log``: a line per request (off by default: it costs throughput). ``sock``: from
    ``bind(host, port)``, else bound here."""
    import uvicorn

    # (an engine in this process shares the GIL with the event loop)
    tune_for_serving()
    files = raise_open_file_limit()
    if files < max_connections + 64:
        log.warning(
            "the open-file limit (%d) is below --max-connections (%d) + 64", files, max_connections
        )

    app, routes = build_app(
        engine,
        model_name,
        api_key,
        max_body_bytes,
        max_queue,
        max_request_entries,
        read_timeout,
        cpu_workers,
        chat_template,
        tool_parser,
    )

    class GracefulServer(uvicorn.Server):
        """Shuts down on SIGTERM / SIGINT and returns (uvicorn would re-raise the signal after
        its graceful shutdown, so the process would not exit 0); at the end of the grace period
        the requests still running are answered with 503 before uvicorn cancels them."""

        @contextlib.contextmanager
        def capture_signals(self):
            handled = (signal.SIGINT, signal.SIGTERM)
            previous = {sig: signal.signal(sig, self.handle_exit) for sig in handled}
            try:
                yield
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)

        async def startup(self, sockets=None):
            await super().startup(sockets)
            if self.started:
                url = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
                log.info("serving %s on %s", model_name, url)

        async def shutdown(self, sockets=None):
            asyncio.get_running_loop().call_later(grace_period, routes.expire)
            await super().shutdown(sockets)

    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level="warning",
        # (a margin after the grace period for the 503s to go out)
        timeout_graceful_shutdown=grace_period + 5,
        timeout_keep_alive=keep_alive_timeout,
        http=http_protocol(read_timeout, max_connections),
        # (room in the accept queue for a burst beyond the cap: refused with a 503 at once,
        # not left to retry its SYN; the kernel truncates it to net.core.somaxconn)
        backlog=max_connections + 2048,
        access_log=access_log,
    )
    if access_log:  # (uvicorn's logger, at the level of the rest of its logs otherwise)
        logging.getLogger("uvicorn.access").setLevel(logging.INFO)
    server = GracefulServer(config)
    try:
        server.run(sockets=[sock or bind(host, port)])
    finally:
        routes.pool.shutdown(wait=False, cancel_futures=True)
        engine.shutdown()
    return 0
