"""Tool calls: the formats read from model-like replies, malformed ones included (content,
never an error); streamed deltas, however the text is cut, concatenate to the whole reply's
calls; through the server with the official client: tool_choice required and named (the
arguments validate against the tool's schema), auto with a parser (a grammar makes the tiny
model write a Hermes call), tools and tool calls in the history reach the template, and bad
tools get a 400 naming the field."""

from __future__ import annotations

import json
import random

import httpx
import openai
import pytest
from server_helpers import ServerProcess

from nano_engine.tool_calls import (
    Hermes,
    Llama3Json,
    Named,
    Required,
    ToolCallStream,
    arguments_text,
    get_tool_parser,
)

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("xgrammar")
pytest.importorskip("partial_json_parser")

HERMES_REPLY = (
    'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
    '"days": 3, "units": {"temp": "C"}}}\n</tool_call>\n<tool_call>\n{"name": "get_time", '
    '"arguments": {"zone": "Europe/Paris \\"CET\\""}}\n</tool_call>'
)
LLAMA_REPLY = (
    '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Lyon", "days": 1}}; '
    '{"name": "get_time", "parameters": {"zone": "UTC"}}'
)
WEATHER = {"city": "Paris", "days": 3, "units": {"temp": "C"}}


@pytest.mark.parametrize(
    ("fmt", "text", "content", "calls"),
    [
        (
            Hermes(),
            HERMES_REPLY,
            "Let me check.\n",
            [("get_weather", WEATHER), ("get_time", {"zone": 'Europe/Paris "CET"'})],
        ),
        (Hermes(), "no call here", "no call here", []),
        (Hermes(), 'x<tool_call>{"name": "f", "arguments": {"a": </tool_call>', None, []),
        (Hermes(), '<tool_call>{"arguments": {}}</tool_call>', None, []),
        (
            Llama3Json(),
            LLAMA_REPLY,
            None,
            [("get_weather", {"city": "Lyon", "days": 1}), ("get_time", {"zone": "UTC"})],
        ),
        (Llama3Json(), '{"name": "f", "parameters": {}}', None, [("f", {})]),
        (Llama3Json(), "Plain answer.", "Plain answer.", []),
        (Llama3Json(), '{"name": "f", "parameters": {"a": 1}', None, []),
        (Named("f"), '{"a": [1, 2]}', None, [("f", {"a": [1, 2]})]),
        (Named("f"), '{"a": [1, 2', None, []),
        (
            Required(),
            '[{"name": "f", "parameters": {}}, {"name": "g", "parameters": {"x": 1}}]',
            None,
            [("f", {}), ("g", {"x": 1})],
        ),
        (Required(), "[]", None, []),
    ],
)
def test_formats_read_whole_replies(fmt, text, content, calls):
    got_content, got_calls = fmt.parse(text)
    assert got_calls == calls
    # a reply that holds no valid call is content, whole
    assert got_content == (content if calls else (text or None))


@pytest.mark.parametrize(
    ("fmt", "text"),
    [
        (Hermes(), HERMES_REPLY),
        (Llama3Json(), LLAMA_REPLY),
        (Named("f"), '{"q": "a \\"quoted\\" é", "n": -12.5e3, "ok": true, "l": [null, {}]}'),
        (
            Required(),
            '[{"name": "a", "parameters": {"s": "x,y"}}, {"name": "b", "parameters": {}}]',
        ),
        (Hermes(), "Only <tool content, <tool_ no call."),
        (Hermes(), "hi <tool_call>not json</tool_call>"),
        (Llama3Json(), '{"answer": 42}'),
    ],
)
def test_streamed_deltas_concatenate_to_the_whole_reply(fmt, text):
    content, calls = fmt.parse(text)
    rng = random.Random(0)
    cuttings = [[1] * len(text), [len(text)]] + [
        [rng.randint(1, 7) for _ in range(len(text))] for _ in range(60)
    ]
    for sizes in cuttings:
        stream, pos, got_content = ToolCallStream(fmt), 0, ""
        ids, names, args = {}, {}, {}
        for size in sizes:
            piece = text[pos : pos + size]
            pos += len(piece)
            c, deltas = stream.feed(piece, final=pos >= len(text))
            got_content += c
            for d in deltas:
                i = d["index"]
                if "id" in d:
                    assert i not in ids and d["type"] == "function"
                    ids[i], names[i] = d["id"], d["function"]["name"]
                args[i] = args.get(i, "") + d["function"]["arguments"]
            if pos >= len(text):
                break
        assert (got_content or None) == content, sizes
        assert [(names[i], json.loads(args[i])) for i in sorted(names)] == calls, sizes
        assert [args[i] for i in sorted(args)] == [arguments_text(a) for _, a in calls]
        assert len(set(ids.values())) == len(ids)


def test_unknown_parsers_are_refused():
    with pytest.raises(ValueError, match="unknown tool call parser 'mistral'"):
        get_tool_parser("mistral")


TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools:{% for t in tools %} {{ t.function.name }}"
    "{% endfor %}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.content %}{{ m.content }}"
    '{% endif %}{% for c in m.tool_calls or [] %}<tool_call>{"name": "{{ c.function.name }}'
    '", "arguments": {{ c.function.arguments | tojson }}}</tool_call>{% endfor %}'
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
WEATHER_PARAMS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 8},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "units": {"enum": ["C", "F"]},
    },
    "required": ["city", "days", "units"],
    "additionalProperties": False,
}
TIME_PARAMS = {
    "type": "object",
    "properties": {"zone": {"enum": ["UTC", "CET"]}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER_PARAMS}},
    {
        "type": "function",
        "function": {"name": "get_time", "description": "Now.", "parameters": TIME_PARAMS},
    },
]
SCHEMAS = {"get_weather": WEATHER_PARAMS, "get_time": TIME_PARAMS}
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def server(checkpoints, tmp_path_factory):
    template = tmp_path_factory.mktemp("template") / "tools.jinja"
    template.write_text(TEMPLATE)
    srv = ServerProcess(
        checkpoints("qwen3"),
        "--chat-template",
        str(template),
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        "hermes",
    )
    yield srv
    assert srv.stop() == 0


@pytest.fixture()
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)


def _stream_calls(chunks) -> tuple[dict, str | None]:
    calls, reason = {}, None
    for chunk in chunks:
        for choice in chunk.choices:
            reason = choice.finish_reason or reason
            for d in choice.delta.tool_calls or ():
                call = calls.setdefault(d.index, {"name": None, "arguments": ""})
                if d.function.name:
                    call["name"] = d.function.name
                call["arguments"] += d.function.arguments or ""
    return calls, reason


@pytest.mark.parametrize(
    "tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}]
)
def test_required_and_named_calls_validate(server, client, tool_choice):
    kwargs = dict(
        model=server.model,
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice=tool_choice,
        max_tokens=200,
        temperature=0,
        extra_body={"parallel_tool_calls": tool_choice != "required"},
    )
    whole = client.chat.completions.create(**kwargs).choices[0]
    calls = whole.message.tool_calls
    assert calls and whole.message.content is None
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    if tool_choice == "required":
        assert whole.finish_reason == "tool_calls" and len(calls) == 1  # (not parallel)
    else:
        assert whole.finish_reason == "stop" and calls[0].function.name == "get_weather"
    streamed, reason = _stream_calls(client.chat.completions.create(**kwargs, stream=True))
    assert reason == whole.finish_reason
    assert [(c["name"], c["arguments"]) for _, c in sorted(streamed.items())] == [
        (c.function.name, c.function.arguments) for c in calls
    ]


def test_auto_reads_a_hermes_call_and_plain_content(server, client):
    call = r'<tool_call>\{"name": "get_time", "arguments": \{"zone": "(UTC|CET)"\}\}</tool_call>'
    kwargs = dict(model=server.model, messages=MESSAGES, tools=TOOLS, max_tokens=80)
    for stream in (False, True):
        reply = client.chat.completions.create(
            **kwargs, stream=stream, extra_body={"guided_regex": call}
        )
        if stream:
            calls, reason = _stream_calls(reply)
            got = [(c["name"], json.loads(c["arguments"])) for c in calls.values()]
        else:
            choice = reply.choices[0]
            reason = choice.finish_reason
            got = [
                (c.function.name, json.loads(c.function.arguments))
                for c in choice.message.tool_calls
            ]
            assert choice.message.content is None
        assert reason == "tool_calls" and len(got) == 1 and got[0][0] == "get_time"
        jsonschema.validate(got[0][1], TIME_PARAMS)
    plain = client.chat.completions.create(
        **kwargs, tool_choice="auto", extra_body={"guided_regex": "[a-z ]{3,12}"}
    ).choices[0]
    assert plain.message.tool_calls is None and plain.finish_reason == "stop"
    assert plain.message.content
    none = client.chat.completions.create(
        **kwargs, tool_choice="none", extra_body={"guided_regex": call}
    ).choices[0]
    assert none.message.tool_calls is None and none.message.content.startswith("<tool_call>")


def test_tools_and_calls_in_the_history_reach_the_template(server):
    history = [
        *MESSAGES,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_time", "arguments": '{"zone": "UTC"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "12:00"},
    ]
    body = {"messages": history, "tools": TOOLS}
    ids = httpx.post(f"{server.url}/tokenize", json=body).json()["tokens"]
    prompt = httpx.post(f"{server.url}/detokenize", json={"tokens": ids}).json()["prompt"]
    assert '<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>' in prompt
    assert "Tools: get_weather get_time" in prompt  # (/tokenize counts a chat's prompt)
    assert "<|im_start|>tool\n12:00" in prompt
    response = httpx.post(
        f"{server.url}/v1/chat/completions",
        json={"model": server.model, "messages": history, "tools": TOOLS, "max_tokens": 4},
    )
    assert response.status_code == 200, response.text


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        ({"tool_choice": "required"}, "tool_choice", "tool_choice needs tools"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
            "not among tools",
        ),
        (
            {
                "tools": [
                    {"type": "function", "function": {"name": "f", "parameters": {"type": "frob"}}}
                ],
                "tool_choice": "required",
            },
            "tools",
            "cannot compile the json",
        ),
        ({"tools": TOOLS + TOOLS[:1]}, "tools", "twice"),
        ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, None, "pattern"),
        (
            {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
            "response_format",
            "cannot be combined with tool_choice",
        ),
    ],
)
def test_bad_tools_get_a_400_naming_the_field(server, body, param, message):
    response = httpx.post(
        f"{server.url}/v1/chat/completions",
        json={"model": server.model, "messages": MESSAGES, "max_tokens": 4, **body},
        timeout=60,
    )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert message in error["message"], error
    if param is not None:
        assert error["param"] == param, error
    ok = httpx.post(
        f"{server.url}/v1/chat/completions",
        json={"model": server.model, "messages": MESSAGES, "max_tokens": 4, "tools": TOOLS},
    )
    assert ok.status_code == 200


def test_auto_needs_a_parser(checkpoints):
    srv = ServerProcess(checkpoints("qwen3"))
    try:
        response = httpx.post(
            f"{srv.url}/v1/chat/completions",
            json={"model": srv.model, "messages": MESSAGES, "tools": TOOLS, "tool_choice": "auto"},
        )
        assert response.status_code == 400
        assert "--enable-auto-tool-choice" in response.json()["error"]["message"]
    finally:
        assert srv.stop() == 0


def test_llm_chat_gives_the_tools_to_the_template(checkpoints, tmp_path):
    from transformers import AutoTokenizer

    from nano_engine import LLM, SamplingParams

    path = checkpoints("qwen3")
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(tmp_path)
    with LLM(path, tokenizer=str(tmp_path)) as llm:
        out = llm.chat(MESSAGES, SamplingParams(max_tokens=2), use_tqdm=False, tools=TOOLS)[0]
        prompt = llm.engine.tokenizer.decode(out.prompt_token_ids)
    assert "Tools: get_weather get_time" in prompt
