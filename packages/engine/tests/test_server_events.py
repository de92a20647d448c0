"""The server's hand-written JSON (a stream's chunks), its prompt forms and its inter-token
histogram, each against what the general code (json.dumps, a plain pydantic union,
prometheus_client's Histogram) makes of the same input."""

from __future__ import annotations

import json

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest
from pydantic import BaseModel, ValidationError

from nano_engine.bodies import (
    Choices,
    encode_message,
    event,
    events_of,
    plain_choice,
    scalar,
)
from nano_engine.metrics import _LATENCY_BUCKETS, _Gaps
from nano_engine.outputs import CompletionOutput
from nano_engine.protocol import CompletionRequest

TEXTS = ["", " hello", 'a "quoted" \\ back', "line\nbreak\ttab", "é 漢字 🙂", "\x00\x1f\x7f"]


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize(
    ("finish", "stop"), [(None, None), ("stop", "</s>"), ("stop", 151645), ("length", None)]
)
def test_a_plain_choice_is_the_bytes_json_dumps_writes(text, finish, stop):
    o = CompletionOutput(3, text, [1, 2], finish, None, stop)
    # (the general path: the choice's dict; no token is read without logprobs)
    expected = json.dumps(Choices(None).completion(7, o, False), ensure_ascii=False)
    assert plain_choice(7, o) == expected


def test_a_stream_s_events_are_its_chunks_as_json_dumps_writes_them():
    head = {"id": "cmpl-1", "object": "text_completion", "created": 5, "model": 'm "x"'}
    choices = [{"index": 0, "text": "é"}, {"index": 1, "text": ""}]
    chunk = events_of(head)(", ".join(json.dumps(c, ensure_ascii=False) for c in choices))
    assert chunk == event({**head, "choices": choices})
    assert chunk == f"data: {json.dumps({**head, 'choices': choices}, ensure_ascii=False)}\n\n"


@pytest.mark.parametrize(
    "message",
    [
        {"content": 'hi "there"\n'},
        {"content": ""},
        {"role": "assistant", "content": ""},
        {"reasoning_content": "hmm"},
        {"tool_calls": [{"index": 0, "function": {"name": "f", "arguments": "{}"}}]},
        {"content": None},
    ],
)
def test_a_chat_delta_is_what_json_dumps_writes(message):
    assert encode_message(message) == json.dumps(message, ensure_ascii=False)


@pytest.mark.parametrize("value", [None, "stop", "é\n", 0, 151645])
def test_a_scalar_is_what_json_dumps_writes(value):
    assert scalar(value) == json.dumps(value, ensure_ascii=False)


class _Union(BaseModel):  # the prompt as a plain union: the forms the server accepted before
    prompt: str | list[str] | tuple[int, ...] | list[tuple[int, ...]]


@pytest.mark.parametrize(
    "prompt",
    ["text", "", ["a", "b"], [1, 2, 3], list(range(2000)), [[1, 2], [3]], [], [True, 2]],
)
def test_each_prompt_form_validates_as_the_plain_union_did(prompt):
    got = CompletionRequest.model_validate({"model": "m", "prompt": prompt}).prompt
    assert got == _Union(prompt=prompt).prompt
    assert type(got) is type(_Union(prompt=prompt).prompt)


@pytest.mark.parametrize(
    ("prompt", "where", "words"),
    [
        (5, ("prompt",), "the prompt must be a string, a list of strings, a list of token ids"),
        (None, ("prompt",), "the prompt must be"),
        ({"a": 1}, ("prompt",), "the prompt must be"),
        ([1, "a"], ("prompt", "tuple[int, ...]", 1), "valid integer"),
        ([1.5], ("prompt", "tuple[int, ...]", 0), "fractional part"),
        (["a", 1], ("prompt", "list[str]", 1), "valid string"),
        (["1", 2], ("prompt", "list[str]", 1), "valid string"),  # (the union read ids)
        ([[1], "a"], ("prompt", "list[tuple[int, ...]]", 1), "valid tuple"),
    ],
)
def test_a_prompt_of_no_form_is_refused_naming_where(prompt, where, words):
    with pytest.raises(ValidationError) as e:
        CompletionRequest.model_validate({"model": "m", "prompt": prompt})
    first = e.value.errors()[0]
    assert first["loc"] == where and words in first["msg"]


def test_the_gaps_histogram_is_prometheus_client_s_exposition():
    names = ("vllm:inter_token_latency_seconds", _Gaps.DOC)
    plain = CollectorRegistry()
    histogram = Histogram(
        *names, ["model_name", "engine"], buckets=_LATENCY_BUCKETS, registry=plain
    )
    ours = CollectorRegistry()
    gaps = _Gaps("m")
    ours.register(gaps)
    for engine in (0, 1):  # (every engine's series from the start, at 0)
        histogram.labels("m", str(engine))
        gaps.add(engine)
    # (bounds exactly, between, below the first, beyond the last)
    for engine, gap, count in [(0, 0.001, 3), (0, 0.0005, 2), (1, 0.02, 5), (0, 100.0, 1)]:
        for _ in range(count):
            histogram.labels("m", str(engine)).observe(gap)
        gaps.add(engine, gap, count)
    gaps.add(1, 0.05, 0)  # (no gap: nothing)
    expected = [
        line for line in generate_latest(plain).decode().splitlines() if "_created" not in line
    ]
    assert generate_latest(ours).decode().splitlines() == expected
