"""The bodies of OpenAI's responses as the server writes them: choices with their logprobs
(``Choices``, which turns token ids into text), whole JSON bodies and server-sent events.
What most responses carry is written by hand (a plain choice, a text delta, a stream's
repeated head), the bytes json.dumps would write at a fraction of its time."""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable
from json.encoder import encode_basestring

from fastapi.responses import Response

from nano_engine.outputs import CompletionOutput, Logprob, RequestOutput


class Choices:
    """Choices and logprobs entries; ``token``: a token id's text (the server's cached
    decode)."""

    def __init__(self, token: Callable[[int], str] | None) -> None:
        self.token = token

    def completion(
        self,
        index: int,
        o: CompletionOutput,
        logprobs: bool,
        prefix: str = "",
        prompt: RequestOutput | None = None,
        echo: bool = False,
    ) -> dict:
        """A completion choice; ``prefix``: the echoed prompt text; ``prompt``: the output
        that carries the prompt's logprobs (the first), written as vLLM's
        ``prompt_logprobs`` and, with ``echo``, before the output's in ``logprobs``."""
        choice = {
            "index": index,
            "text": prefix + o.text,
            "logprobs": None,
            "finish_reason": o.finish_reason,
            "stop_reason": o.stop_reason,
        }
        entries = list(o.logprobs) if logprobs and o.logprobs is not None else None
        head = prompt.prompt_logprobs if prompt is not None else None
        if head is not None:
            choice["prompt_logprobs"] = [self.prompt_entry(lp) for lp in head]
            if echo and entries is not None:
                first = self.token(prompt.prompt_token_ids[0])
                entries = [(first, None, {}), *head[1:], *entries]
        if entries is not None:
            rows = [
                e if isinstance(e, tuple) else (self.token(e.token_id), e.logprob, self.top(e))
                for e in entries
            ]
            tokens = [r[0] for r in rows]
            choice["logprobs"] = {
                "tokens": tokens,
                "token_logprobs": [r[1] for r in rows],
                "top_logprobs": [None if r[1] is None else r[2] for r in rows],
                "text_offset": text_offsets(tokens),
            }
        return choice

    def top(self, lp: Logprob) -> dict:
        """The top logprobs of a position: token text -> logprob."""
        return {self.token(t): v for t, v in zip(lp.top_ids, lp.top_logprobs)}

    def prompt_entry(self, lp: Logprob | None) -> dict | None:
        """vLLM's prompt_logprobs entry: token id -> logprob, rank, decoded token."""
        if lp is None:
            return None
        entry = {
            str(t): {"logprob": v, "rank": rank, "decoded_token": self.token(t)}
            for rank, (t, v) in enumerate(zip(lp.top_ids, lp.top_logprobs), 1)
        }
        entry[str(lp.token_id)] = {
            "logprob": lp.logprob,
            "rank": lp.rank,
            "decoded_token": self.token(lp.token_id),
        }
        return entry

    def chat_logprobs(self, o: CompletionOutput, wanted: bool) -> dict | None:
        """A chat choice's logprobs (OpenAI's content entries, with bytes), where ``wanted``."""
        if not wanted or o.logprobs is None:
            return None

        def entry(token_id: int, logprob: float) -> dict:
            token = self.token(token_id)
            return {"token": token, "logprob": logprob, "bytes": list(token.encode())}

        return {
            "content": [
                {
                    **entry(lp.token_id, lp.logprob),
                    "top_logprobs": [entry(t, v) for t, v in zip(lp.top_ids, lp.top_logprobs)],
                }
                for lp in o.logprobs
            ]
        }


def text_offsets(tokens: list[str]) -> list[int]:
    """Where each token's text starts in the completion (linear: a running sum)."""
    return list(itertools.accumulate((len(t) for t in tokens[:-1]), initial=0)) if tokens else []


def entries(outputs: list[RequestOutput], logprobs: int | None) -> int:
    """Tokens x (logprobs + 1) in outputs: the work of rendering them."""
    return ((logprobs or 0) + 1) * sum(len(c.token_ids) for o in outputs for c in o.outputs)


# (one encoder: json.dumps with an option builds a new one at every call, most of the time of
# a small chunk's)
encode = json.JSONEncoder(ensure_ascii=False).encode


def event(chunk: dict) -> str:
    return f"data: {encode(chunk)}\n\n"


def events_of(head: dict) -> Callable[[str], str]:
    """The events of one stream: ``head`` (its id, object, created, model) serialized once,
    each event then its choices (serialized, comma-separated) after it."""
    prefix = f'data: {encode(head)[:-1]}, "choices": ['
    return lambda choices: f"{prefix}{choices}]}}\n\n"


def plain_choice(index: int, o: CompletionOutput) -> str:
    """A completion choice without logprobs, written directly (the bytes json.dumps would
    write for ``Choices.completion``'s dict, in a tenth of the time)."""
    return (
        f'{{"index": {index}, "text": {encode_basestring(o.text)}, "logprobs": null, '
        f'"finish_reason": {scalar(o.finish_reason)}, "stop_reason": {scalar(o.stop_reason)}}}'
    )


def scalar(value: str | int | None) -> str:
    """A string, number or null in JSON (the encoder builds a whole pass for anything but a
    string)."""
    if value is None:
        return "null"
    return encode_basestring(value) if isinstance(value, str) else encode(value)


def encode_message(message: dict) -> str:
    """A chat delta; most are text alone."""
    if len(message) == 1 and type(message.get("content")) is str:
        return f'{{"content": {encode_basestring(message["content"])}}}'
    return encode(message)


def json_response(head: dict, choices, usage: dict) -> Response:
    """A response body of ``head``, the ``choices`` (an iterable of dicts: each is serialized
    and dropped before the next is built, so that n x logprobs objects never live at once) and
    ``usage``."""
    parts = [encode(head)[:-1], ', "choices": [']
    for i, choice in enumerate(choices):
        parts.append((", " if i else "") + encode(choice))
    parts.append(f'], "usage": {encode(usage)}}}')
    return Response("".join(parts).encode(), media_type="application/json")


def usage(outputs: list[RequestOutput]) -> dict:
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }
