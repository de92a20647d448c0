"""Reasoning parsers: a model's thinking split from its answer, whole and as it streams (every
way of cutting the text into deltas gives the whole split); in the engine, a structured
output's constraint applies from the end of the reasoning; through the server,
``reasoning_content`` apart from ``content``, ``chat_template_kwargs`` and ``--chat-template``.
The tiny model is made to end its thinking: the output row of ``</think>`` is scaled up, so
that greedy decoding writes it within a few tokens."""

from __future__ import annotations

import json
import re

import httpx
import openai
import pytest
import torch
from server_helpers import ServerProcess

from nano_engine import LLM, SamplingParams, StructuredOutputsParams
from nano_engine.reasoning import PARSERS, get_reasoning_parser

pytest.importorskip("xgrammar")

QWEN3 = PARSERS["qwen3"]
TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
    "{% else %}<think>\n{% endif %}{% endif %}"
)
REGEX = r"[a-d]{3}-[0-9]{2}"


@pytest.mark.parametrize(
    ("text", "opened", "reasoning", "content"),
    [
        ("<think>plan</think>answer", False, "plan", "answer"),
        ("<think>\nplan\n</think>\n\nanswer", False, "\nplan\n", "\n\nanswer"),
        ("plan</think>answer", True, "plan", "answer"),
        ("<think>cut off mid-thought", False, "cut off mid-thought", None),
        ("cut off mid-thought", True, "cut off mid-thought", None),
        ("just an answer", False, None, "just an answer"),
        ("<think></think>", False, "", None),
        ("<thin", False, None, "<thin"),
        ("a </think> in an answer", False, None, "a </think> in an answer"),
    ],
)
def test_split(text, opened, reasoning, content):
    assert QWEN3.split(text, opened) == (reasoning, content)


@pytest.mark.parametrize(
    ("text", "opened"),
    [
        ("<think>\nplan it</think>\n\nthe answer", False),
        ("plan </thi it</think>answer </think>", True),
        ("<thinking is not a tag", False),
        ("<think>never ends </th", False),
    ],
)
def test_every_way_of_streaming_gives_the_split(text, opened):
    whole = QWEN3.split(text, opened)
    cuts_list = [(i, j) for i in range(len(text) + 1) for j in range(i, len(text) + 1)]
    for i, j in cuts_list:
        stream = QWEN3.stream(opened)
        parts = [stream.feed(text[:i]), stream.feed(text[i:j]), stream.feed(text[j:], final=True)]
        reasoning = "".join(r for r, _ in parts)
        content = "".join(c for _, c in parts)
        assert ((reasoning if stream.thought else None), content or None) == whole, (i, j)


def test_unknown_parsers_are_refused(checkpoints):
    with pytest.raises(ValueError, match="unknown reasoning parser 'o1'"):
        get_reasoning_parser("o1")
    with pytest.raises(ValueError, match="reasoning_parser must be one of"):
        LLM(checkpoints("qwen3"), reasoning_parser="o1")


@pytest.fixture(scope="module")
def thinker(tmp_path_factory, checkpoints):
    """A tiny checkpoint whose tokenizer has <think> and </think> and the template above, and
    whose model writes </think> early."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = tmp_path_factory.mktemp("thinker")
    tokenizer = AutoTokenizer.from_pretrained(checkpoints("qwen3"))
    tokenizer.add_tokens(["<think>", "</think>"])
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(checkpoints("qwen3"))
    end = tokenizer.convert_tokens_to_ids("</think>")
    with torch.no_grad():
        model.lm_head.weight[end] *= 200
    model.save_pretrained(path)
    return str(path)


def test_the_constraint_applies_after_the_reasoning(thinker):
    so = StructuredOutputsParams(regex=REGEX)
    params = SamplingParams(temperature=0, max_tokens=60, structured_outputs=so)
    chat = [{"role": "user", "content": "Think, then answer."}]
    with LLM(thinker, reasoning_parser="qwen3") as llm:
        thinking = llm.chat(chat, params, use_tqdm=False)[0].outputs[0]
        direct = llm.chat(
            chat, params, use_tqdm=False, chat_template_kwargs={"enable_thinking": False}
        )[0].outputs[0]
        plain = llm.generate(["Think, then answer."], params, use_tqdm=False)[0].outputs[0]
        with pytest.raises(ValueError, match="may not set"):
            llm.chat(chat, params, chat_template_kwargs={"tokenize": True})
    reasoning, content = QWEN3.split(thinking.text, opened=True)
    assert reasoning is not None and content is not None, thinking.text
    assert not re.fullmatch(REGEX, reasoning)  # (the reasoning was not constrained)
    assert re.fullmatch(REGEX, content) and thinking.finish_reason == "stop", thinking.text
    # the template closed the thinking, and completions do not reason: constrained at once
    assert re.fullmatch(REGEX, direct.text) and direct.finish_reason == "stop"
    assert re.fullmatch(REGEX, plain.text) and plain.finish_reason == "stop"


def test_the_server_splits_reasoning_streamed_and_not(thinker, tmp_path):
    template = tmp_path / "template.jinja"
    template.write_text(TEMPLATE.replace("<|im_start|>assistant\n", "<|im_start|>ASSISTANT\n"))
    srv = ServerProcess(thinker, "--reasoning-parser", "qwen3", "--chat-template", str(template))
    try:
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="none", max_retries=0)
        messages = [{"role": "user", "content": "Think, then answer."}]
        kwargs = dict(
            model=srv.model,
            messages=messages,
            max_tokens=60,
            temperature=0,
            extra_body={"guided_regex": REGEX},
        )
        whole = client.chat.completions.create(**kwargs).choices[0]
        reasoning = whole.message.model_extra["reasoning_content"]
        assert reasoning is not None and re.fullmatch(REGEX, whole.message.content), whole
        chunks = list(client.chat.completions.create(**kwargs, stream=True))
        deltas = [c.choices[0].delta for c in chunks if c.choices]
        streamed = "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas)
        assert streamed == reasoning
        assert "".join(d.content or "" for d in deltas) == whole.message.content
        direct = client.chat.completions.create(
            **{
                **kwargs,
                "extra_body": {
                    **kwargs["extra_body"],
                    "chat_template_kwargs": {"enable_thinking": False},
                },
            }
        ).choices[0]
        assert direct.message.model_extra["reasoning_content"] is None
        assert re.fullmatch(REGEX, direct.message.content)
        tokens = httpx.post(f"{srv.url}/tokenize", json={"messages": messages}).json()
        prompt = httpx.post(f"{srv.url}/detokenize", json={"tokens": tokens["tokens"]}).json()
        assert "ASSISTANT" in prompt["prompt"]  # (--chat-template's, not the tokenizer's)
        bad = httpx.post(
            f"{srv.url}/v1/chat/completions",
            json={
                "model": srv.model,
                "messages": messages,
                "chat_template_kwargs": {"add_generation_prompt": False},
            },
        )
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "chat_template_kwargs"
        assert json.loads(bad.text)["error"]["message"].startswith("chat_template_kwargs")
    finally:
        assert srv.stop() == 0
