"""Structured outputs through the server (a real server process, the official openai client):
OpenAI's response_format (json_schema, json_object, the client's ``parse`` with a pydantic
model), vLLM's structured_outputs and its guided_* aliases, streamed and not; bad constraints
get a 400 naming the field, and the server goes on."""

from __future__ import annotations

import json
import re
from typing import Literal

import httpx
import openai
import pytest
from pydantic import BaseModel, Field
from server_helpers import ServerProcess

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("xgrammar")

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 5},
        "rooms": {"type": "integer", "minimum": 1, "maximum": 9},
        "pets": {"type": "boolean"},
    },
    "required": ["city", "rooms", "pets"],
    "additionalProperties": False,
}
MESSAGES = [{"role": "user", "content": "Describe a flat."}]


class Flat(BaseModel):
    city: str = Field(max_length=5)
    rooms: int = Field(ge=1, le=9)
    kind: Literal["studio", "loft"]


@pytest.fixture(scope="module")
def server(checkpoints):
    srv = ServerProcess(checkpoints("qwen3"), "--max-model-len", "512")
    yield srv
    assert srv.stop() == 0


@pytest.fixture()
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)


def test_parse_with_a_pydantic_model(server, client):
    completion = client.chat.completions.parse(
        model=server.model,
        messages=MESSAGES,
        response_format=Flat,
        max_tokens=300,
        temperature=1.0,
        seed=1,
        n=2,
    )
    for choice in completion.choices:
        assert choice.finish_reason == "stop"
        assert isinstance(choice.message.parsed, Flat)


def test_json_schema_and_json_object(server, client):
    schema = {"name": "flat", "schema": SCHEMA, "strict": True}
    for response_format, check in (
        ({"type": "json_schema", "json_schema": schema}, lambda v: jsonschema.validate(v, SCHEMA)),
        ({"type": "json_object"}, lambda v: isinstance(v, dict) or pytest.fail(repr(v))),
    ):
        for stream in (False, True):
            reply = client.chat.completions.create(
                model=server.model,
                messages=MESSAGES,
                response_format=response_format,
                max_tokens=400,
                temperature=1.0,
                seed=2,
                stream=stream,
            )
            if stream:
                chunks = list(reply)
                text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
                reason = chunks[-1].choices[0].finish_reason
            else:
                text, reason = reply.choices[0].message.content, reply.choices[0].finish_reason
            assert reason == "stop", text
            check(json.loads(text))


@pytest.mark.parametrize(
    ("extra", "check"),
    [
        ({"structured_outputs": {"regex": r"[0-9]{3}-[a-z]{2}"}}, r"[0-9]{3}-[a-z]{2}"),
        ({"structured_outputs": {"choice": ["left", "right"]}}, r"left|right"),
        ({"structured_outputs": {"grammar": 'root ::= "a" [b-d]{2}'}}, r"a[b-d]{2}"),
        ({"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}}, None),
        ({"guided_regex": r"[xy]{4}"}, r"[xy]{4}"),
        ({"guided_choice": ["one", "two"]}, r"one|two"),
        ({"guided_grammar": 'root ::= "z" [0-9]'}, r"z[0-9]"),
        ({"guided_json": json.dumps(SCHEMA), "guided_decoding_backend": "xgrammar"}, None),
    ],
)
def test_vllm_extras_and_their_aliases_on_completions(server, client, extra, check):
    for stream in (False, True):
        reply = client.completions.create(
            model=server.model,
            prompt="Hello",
            max_tokens=300,
            temperature=1.0,
            n=2,
            stream=stream,
            extra_body=extra,
        )
        texts = ["", ""]
        reasons = [None, None]
        for choice in (c for chunk in reply for c in chunk.choices) if stream else reply.choices:
            texts[choice.index] += choice.text
            reasons[choice.index] = choice.finish_reason or reasons[choice.index]
        assert reasons == ["stop", "stop"], texts
        for text in texts:
            if check is None:
                jsonschema.validate(json.loads(text), SCHEMA)
            else:
                assert re.fullmatch(check, text), text


@pytest.mark.parametrize(
    ("body", "status", "param", "message"),
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "frobnicate"}},
                }
            },
            400,
            "response_format",
            "cannot compile the json: Unsupported type",
        ),
        ({"guided_regex": "(?<=a)b"}, 400, "guided_regex", "Lookbehind"),
        ({"structured_outputs": {"grammar": "root ::= nope"}}, 400, "structured_outputs", "nope"),
        (
            {"structured_outputs": {"regex": "a", "choice": ["b"]}},
            400,
            "structured_outputs",
            "exactly one of",
        ),
        ({"guided_json": {}, "guided_regex": "a"}, 400, "guided_regex", "one constraint"),
        (
            {"response_format": {"type": "json_object"}, "guided_choice": ["a"]},
            400,
            "guided_choice",
            "one constraint",
        ),
        ({"response_format": {"type": "json_schema"}}, 400, "response_format.json_schema", ""),
        ({"response_format": {"type": "yaml"}}, 400, "response_format.type", ""),
        ({"guided_json": "{not json"}, 400, "guided_json", "not valid JSON"),
        ({"structured_outputs": {"structural_tag": "x"}}, 400, None, "structural_tag"),
        ({"guided_decoding_backend": "outlines"}, 400, "guided_decoding_backend", ""),
    ],
)
def test_bad_constraints_get_a_400_naming_the_field(server, body, status, param, message):
    response = httpx.post(
        f"{server.url}/v1/completions",
        json={"model": server.model, "prompt": "x", "max_tokens": 4, **body},
        timeout=60,
    )
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert message in error["message"], error
    if param is not None:
        assert error["param"] == param, error
    ok = httpx.post(
        f"{server.url}/v1/completions",
        json={"model": server.model, "prompt": "x", "max_tokens": 4, "guided_choice": ["ok"]},
        timeout=60,
    )
    assert ok.json()["choices"][0]["text"] == "ok"


def test_logit_bias_allowed_token_ids_and_bad_words(server, client):
    tokens = httpx.post(f"{server.url}/tokenize", json={"prompt": " fox"}).json()["tokens"]
    fox = tokens[-1]
    text = httpx.post(f"{server.url}/detokenize", json={"tokens": [fox] * 3}).json()["prompt"]
    biased = client.completions.create(
        model=server.model, prompt="Hello", max_tokens=3, temperature=0, logit_bias={str(fox): 100}
    )
    assert biased.choices[0].text == text
    only = client.completions.create(
        model=server.model,
        prompt="Hello",
        max_tokens=3,
        temperature=1.0,
        extra_body={"allowed_token_ids": [fox]},
    )
    assert only.choices[0].text == text
    banned = client.completions.create(
        model=server.model,
        prompt="Hello",
        max_tokens=3,
        temperature=0,
        logit_bias={str(fox): 100},
        extra_body={"bad_words": ["fox"]},
    )
    assert "fox" not in banned.choices[0].text
    response = httpx.post(
        f"{server.url}/v1/completions",
        json={"model": server.model, "prompt": "x", "logit_bias": {"fox": 1}},
    )
    assert response.status_code == 400 and response.json()["error"]["param"] == "logit_bias"
