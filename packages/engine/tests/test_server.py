"""The OpenAI-compatible server, started for real on a loopback port with a tiny model, and
driven by the official openai client (and raw HTTP for malformed requests)."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
from server_helpers import ServerProcess, vllm_metric

from nano_engine import LLM, SamplingParams, __version__

KEY = "test-key"
OPTIONS = (
    "--max-model-len",
    "256",
    "--kvcache-block-size",
    "8",
    "--api-key",
    KEY,
    "--max-body-bytes",
    "65536",
    "--max-queue",
    "256",
)


@pytest.fixture(scope="module")
def server(checkpoints):
    srv = ServerProcess(checkpoints("qwen3"), *OPTIONS)
    yield srv
    assert srv.stop() == 0


@pytest.fixture(scope="module")
def llm(checkpoints):
    with LLM(checkpoints("qwen3"), max_model_len=256, kvcache_block_size=8) as llm:
        yield llm


@pytest.fixture()
def client(server, checkpoints):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)


def model_name(checkpoints) -> str:
    return checkpoints("qwen3")


def idle(server: ServerProcess, metrics: dict[str, float]) -> bool:
    """Nothing running or waiting, no KV block held."""
    return all(
        metrics[vllm_metric(name, server.model)] == 0
        for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")
    )


def test_completions_equal_llm_generate(client, llm, checkpoints):
    prompt = "The quick brown fox"
    expected = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[
        0
    ].outputs[0]
    r = client.completions.create(
        model=model_name(checkpoints), prompt=prompt, max_tokens=12, temperature=0
    )
    assert r.choices[0].text == expected.text
    assert r.choices[0].finish_reason == expected.finish_reason
    n = len(llm.tokenizer(prompt).input_ids)
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (n, len(expected.token_ids))

    chunks = list(
        client.completions.create(
            model=model_name(checkpoints),
            prompt=prompt,
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected.text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(
        expected.token_ids
    )
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == expected.finish_reason


def test_chat_equals_llm_chat(client, llm, checkpoints):
    messages = [{"role": "user", "content": "Hello there"}]
    expected = llm.chat(messages, SamplingParams(temperature=0, max_tokens=10), use_tqdm=False)[
        0
    ].outputs[0]
    r = client.chat.completions.create(
        model=model_name(checkpoints), messages=messages, max_completion_tokens=10, temperature=0
    )
    assert r.choices[0].message.content == expected.text
    assert r.choices[0].message.role == "assistant"
    stream = client.chat.completions.create(
        model=model_name(checkpoints), messages=messages, max_tokens=10, temperature=0, stream=True
    )
    deltas = [c.choices[0].delta for c in stream]
    assert deltas[0].role == "assistant"
    assert "".join(d.content or "" for d in deltas) == expected.text


def test_n_logprobs_stop_and_seed(client, llm, checkpoints):
    name = model_name(checkpoints)
    seeded = {
        "model": name,
        "prompt": ["One", "Two"],
        "n": 3,
        "max_tokens": 6,
        "temperature": 1.0,
        "seed": 5,
        "extra_body": {"ignore_eos": True},
    }
    r = client.completions.create(**seeded)
    assert sorted(c.index for c in r.choices) == list(range(6))
    again = client.completions.create(**seeded)
    assert [c.text for c in again.choices] == [c.text for c in r.choices]
    assert r.usage.completion_tokens == 36

    lp = (
        client.completions.create(
            model=name, prompt="Logprobs", max_tokens=4, temperature=0, logprobs=3
        )
        .choices[0]
        .logprobs
    )
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert all(
        len(top) <= 3 and max(top.values()) >= value - 1e-6
        for top, value in zip(lp.top_logprobs, lp.token_logprobs)
    )
    chat = client.chat.completions.create(
        model=name,
        messages=[{"role": "user", "content": "x"}],
        max_tokens=3,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == 3 and all(len(c.top_logprobs) == 2 for c in content)

    full = client.completions.create(
        model=name,
        prompt="Stop test",
        max_tokens=30,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    text = full.choices[0].text
    stop = text[5:8]
    cut = client.completions.create(
        model=name,
        prompt="Stop test",
        max_tokens=30,
        temperature=0,
        stop=[stop],
        extra_body={"ignore_eos": True},
    ).choices[0]
    assert cut.text == text[: text.index(stop)] and cut.finish_reason == "stop"


def test_models_health_tokenize(server, checkpoints, llm):
    headers = {"Authorization": f"Bearer {KEY}"}
    models = httpx.get(f"{server.url}/v1/models", headers=headers).json()
    assert models["data"][0]["id"] == model_name(checkpoints)
    assert httpx.get(f"{server.url}/health").status_code == 200
    ids = httpx.post(
        f"{server.url}/tokenize", headers=headers, json={"prompt": "Hello world"}
    ).json()
    assert ids["tokens"] == llm.tokenizer("Hello world").input_ids
    text = httpx.post(
        f"{server.url}/detokenize", headers=headers, json={"tokens": ids["tokens"]}
    ).json()
    assert text["prompt"] == "Hello world"


def test_version_and_the_start_up_line_without_access_log(server, checkpoints):
    assert httpx.get(f"{server.url}/version").json() == {"version": __version__}
    # (ServerProcess returned once /health answered, so the line came before that.)
    out = server.output()
    assert f"serving {model_name(checkpoints)} on {server.url}" in out
    assert " INFO " in next(line for line in out.splitlines() if "serving " in line)
    assert "GET /version" not in out  # the access log is off by default


def test_access_log_has_a_line_per_request(checkpoints):
    srv = ServerProcess(checkpoints("qwen3"), "--max-model-len", "256", "--access-log")
    try:
        assert httpx.get(f"{srv.url}/version").status_code == 200
        assert httpx.get(f"{srv.url}/no-such-route").status_code == 404
        deadline = time.monotonic() + 10
        while "/no-such-route" not in srv.output() and time.monotonic() < deadline:
            time.sleep(0.05)
        out = srv.output()
        assert '"GET /version HTTP/1.1" 200' in out
        assert '"GET /no-such-route HTTP/1.1" 404' in out
    finally:
        assert srv.stop() == 0


def test_the_front_serves_token_ids_without_torch():
    """The server's own process (HTTP, validation, the engine's process started and spoken to)
    needs no torch to serve a model without a tokenizer: started where torch cannot be
    imported, it serves token ids through the official client, streamed and not, and exits 0.
    (With a tokenizer, transformers imports torch.)"""
    tiny = Path(__file__).resolve().parents[3] / "benchmarks" / "configs" / "tiny-qwen3.json"
    options = ("--load-format", "dummy", "--skip-tokenizer-init", "--max-model-len", "256")
    srv = ServerProcess(str(tiny), *options, "--served-model-name", "tiny", without_torch=True)
    try:
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0)
        done = client.completions.create(
            model="tiny", prompt=[1, 2, 3], max_tokens=5, temperature=0,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        assert done.usage.completion_tokens == 5 and done.choices[0].finish_reason == "length"
        stream = client.completions.create(
            model="tiny", prompt=[1, 2, 3], max_tokens=5, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        )  # fmt: skip
        assert [c.usage.completion_tokens for c in stream if c.usage] == [5]
    finally:
        out = srv.output()
        code = srv.stop()
    assert code == 0, out


def test_a_taken_port_is_a_one_line_error(checkpoints):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        command = ["serve", checkpoints("qwen3"), "--port", str(port)]
        run = subprocess.run(
            [sys.executable, "-m", "nano_engine.cli", *command],
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert run.returncode == 1
    assert run.stdout == ""
    assert run.stderr == (
        f"nano-engine: error: cannot serve on 127.0.0.1:{port}: the address is already in use\n"
    )


def post(server, path, body=None, content=None, key=KEY):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    if content is not None:
        headers["Content-Type"] = "application/json"
    return httpx.post(
        f"{server.url}{path}", json=body, content=content, headers=headers, timeout=30
    )


def test_bad_input_gets_its_status_and_error_body(server, checkpoints):
    name = model_name(checkpoints)
    good = {"model": name, "prompt": "ok", "max_tokens": 3}
    chat = {"model": name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    body = json.dumps({**good, "prompt": "x" * 70000}).encode()
    chunked = (body[i : i + 4096] for i in range(0, len(body), 4096))  # sent chunked
    cases = [
        (
            post(server, "/v1/completions", {**good, "prompt": [7] * 400}),
            400,
            r"prompt \(400 tokens\).*maximum model length of 256",
        ),
        (post(server, "/v1/completions", {**good, "top_p": 0}), 400, "top_p"),
        (post(server, "/v1/completions", {**good, "temperature": -1}), 400, "temperature"),
        (post(server, "/v1/completions", {**good, "model": "other"}), 404, "does not exist"),
        (post(server, "/v1/nothing", good), 404, "Not Found"),
        (post(server, "/health", good), 405, "Method Not Allowed"),
        (post(server, "/v1/completions", {**good, "seed": 2**64}), 400, "seed"),
        (post(server, "/v1/completions", {**good, "n": 129}), 400, r"\(n\)"),
        (post(server, "/v1/completions", {**good, "logit_bias": {"5": 500}}), 400, "logit_bias"),
        (
            post(server, "/v1/completions", {**good, "min_tokens": 1, "stop_token_ids": [10**5]}),
            400,
            "stop_token_ids .* outside the vocabulary",
        ),
        (
            post(server, "/v1/chat/completions", {**chat, "top_logprobs": 2}),
            400,
            "top_logprobs needs logprobs",
        ),
        (
            post(server, "/tokenize", {"messages": [{"role": "robot", "content": "x"}]}),
            400,
            "chat template failed: unknown role robot",
        ),
        (
            post(server, "/v1/chat/completions", {**chat, "messages": [{"role": "robot"}]}),
            400,
            "chat template failed: unknown role robot",
        ),
        (
            post(server, "/v1/completions", content=b'{"model": "x", "prompt": '),
            400,
            r"^the body is not valid JSON: .+ \(at \d+\)$",
        ),
        (post(server, "/v1/completions", {"model": name}), 400, "prompt"),
        (post(server, "/v1/chat/completions", {"model": name, "messages": []}), 400, "messages"),
        (post(server, "/v1/completions", {**good, "prompt": [1, 10**6]}), 400, "vocabulary"),
        (post(server, "/v1/completions", {**good, "prompt": 5}), 400, "prompt must be a string"),
        (post(server, "/v1/completions", {**good, "prompt": {"a": 1}}), 400, "list of token ids"),
        (post(server, "/v1/completions", {**good, "prompt": [1, "a"]}), 400, "valid integer"),
        (post(server, "/v1/completions", {**good, "prompt": ["a", 1]}), 400, "valid string"),
        (post(server, "/v1/completions", {**good, "prompt": [[1], 2]}), 400, "valid tuple"),
        (post(server, "/v1/completions", good, key=None), 401, "API key"),
        (post(server, "/v1/completions", good, key="wrong"), 401, "API key"),
        (post(server, "/v1/completions", {**good, "prompt": "x" * 70000}), 413, "over 65536"),
        (post(server, "/v1/completions", content=chunked), 413, "over 65536"),  # no length
    ]
    for response, status, message in cases:
        assert response.status_code == status, response.text
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["code"] == status
        import re

        assert re.search(message, error["message"]), error["message"]
        assert "Value error" not in error["message"]  # (pydantic's prefix)
        if "JSON" in message:
            assert error["param"] is None  # (not the offset of the character)
        if "valid integer" in message:  # (the prompt's form is no part of the path)
            assert error["param"] == "prompt.1"
        ok = post(server, "/v1/completions", good)
        assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"]
    assert post(server, "/health", good).headers["allow"] == "GET"
    # the largest seed, and the n - 1 seeds after it (wrapped to 64 bits)
    ok = post(server, "/v1/completions", {**good, "seed": 2**64 - 1, "n": 2, "temperature": 1})
    assert ok.status_code == 200 and len(ok.json()["choices"]) == 2
    # content as a list of text parts: the same prompt as their text joined by newlines
    parts = [{"type": "text", "text": "hi"}, {"type": "text", "text": "there"}]
    tokens = [
        post(server, "/tokenize", {"messages": [{"role": "user", "content": c}]}).json()["tokens"]
        for c in (parts, "hi\nthere")
    ]
    assert tokens[0] == tokens[1]


def test_queue_limit_gives_503(checkpoints):
    srv = ServerProcess(checkpoints("qwen3"), "--max-model-len", "256", "--max-queue", "2")
    try:
        body = {
            "model": checkpoints("qwen3"),
            "prompt": "busy",
            "max_tokens": 200,
            "ignore_eos": True,
            "stream": True,
        }
        # the limit counts sequences: one request with n = 3 can never fit a limit of 2 (400,
        # even on an idle server: retrying cannot help)
        wide = httpx.post(
            f"{srv.url}/v1/completions", json={**body, "stream": False, "n": 3}, timeout=60
        )
        assert wide.status_code == 400, wide.text
        assert "ever queues (2" in wide.json()["error"]["message"]
        with httpx.Client(timeout=60) as http:
            streams = [
                http.stream("POST", f"{srv.url}/v1/completions", json=body) for _ in range(2)
            ]
            for s in streams:
                s.__enter__()
            rejected = http.post(f"{srv.url}/v1/completions", json={**body, "stream": False})
            assert (
                rejected.status_code == 503 and "queue limit" in rejected.json()["error"]["message"]
            )
            assert rejected.headers["retry-after"] == "1"
            for s in streams:
                s.__exit__(None, None, None)
        assert idle(srv, srv.wait_idle())
        ok = httpx.post(
            f"{srv.url}/v1/completions", json={**body, "stream": False, "max_tokens": 3}, timeout=60
        )
        assert ok.status_code == 200
    finally:
        assert srv.stop() == 0


def test_load_and_disconnects_leave_no_blocks(server, checkpoints):
    name = model_name(checkpoints)
    before = server.metrics()

    async def run():
        client = openai.AsyncOpenAI(
            base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=120
        )
        limit = asyncio.Semaphore(200)

        async def one(i: int):
            async with limit:
                stream = await client.completions.create(
                    model=name,
                    prompt=f"request {i}",
                    max_tokens=8,
                    temperature=0,
                    stream=True,
                    extra_body={"ignore_eos": True},
                )
                pieces, finish = [], None
                async for chunk in stream:
                    pieces.append(chunk.choices[0].text)
                    finish = chunk.choices[0].finish_reason or finish
                return i, "".join(pieces), finish, chunk.id

        async def quitter(i: int):
            stream = await client.completions.create(
                model=name,
                prompt=f"leaving {i}",
                max_tokens=200,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            async for _ in stream:
                break  # one chunk, then hang up
            await stream.close()

        results = await asyncio.gather(*(one(i) for i in range(1000)))
        await asyncio.gather(*(quitter(i) for i in range(100)))
        await client.close()
        return results

    start = time.monotonic()
    results = asyncio.run(run())
    assert sorted(i for i, *_ in results) == list(range(1000))
    assert len({rid for *_, rid in results}) == 1000
    assert all(finish == "length" for _, _, finish, _ in results)
    after = server.wait_idle()
    assert idle(server, after)
    key = vllm_metric("request_success_total", name, finished_reason="length")
    assert after[key] - before.get(key, 0) == 1000
    generated = vllm_metric("generation_tokens_total", name)
    assert after[generated] - before.get(generated, 0) == 8000
    aborted = vllm_metric("request_success_total", name, finished_reason="abort")
    assert after[aborted] - before.get(aborted, 0) == 100
    assert time.monotonic() - start < 300


def test_a_waiting_non_streaming_client_that_hangs_up_is_aborted(server, checkpoints):
    before = server.metrics()
    body = json.dumps(
        {
            "model": model_name(checkpoints),
            "prompt": "hang up",
            "max_tokens": 240,
            "ignore_eos": True,
        }
    ).encode()
    head = (
        "POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
        f"Authorization: Bearer {KEY}\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(head.encode() + body)
        deadline = time.monotonic() + 30
        while server.metric("num_requests_running") != 1:
            assert time.monotonic() < deadline, "the request never started"
            time.sleep(0.01)
    after = server.wait_idle()
    assert idle(server, after)
    # Aborted, not finished: a finished request would count its 240 tokens.
    generated = vllm_metric("generation_tokens_total", server.model)
    assert after.get(generated, 0) == before.get(generated, 0)
    aborted = vllm_metric("request_success_total", server.model, finished_reason="abort")
    assert after[aborted] - before.get(aborted, 0) == 1


def test_serving_benchmark_replays_the_trace(server, checkpoints, tmp_path):
    root = Path(__file__).resolve().parents[3]
    trace = root / "packages/scheduler/tests/data/azure_llm_2023_conv_head100.csv"
    result = subprocess.run(
        [
            sys.executable,
            str(root / "benchmarks/bench_serving.py"),
            f"--url={server.url}",
            f"--model={model_name(checkpoints)}",
            f"--api-key={KEY}",
            f"--trace={trace}",
            "--limit=30",
            "--rate-scale=1000",
            "--max-len=24",
            "--vocab=100",
            "--processes=2",
            f"--json={tmp_path / 'serving.json'}",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    summary = json.loads((tmp_path / "serving.json").read_text())["summary"]
    # Each request's streamed token count is checked against its max_tokens by the script.
    assert (summary["requests"], summary["failed"]) == (30, 0)
    assert 0 < summary["ttft_s"]["p50"] <= summary["e2e_s"]["p50"]
    assert idle(server, server.wait_idle())


def test_metrics_count_what_was_sent(server, checkpoints, llm):
    name = model_name(checkpoints)
    prompts = ["alpha", "beta gamma", "delta epsilon zeta"]
    server.wait_idle()
    before = server.metrics()
    for p in prompts:
        r = post(
            server,
            "/v1/completions",
            {"model": name, "prompt": p, "max_tokens": 5, "ignore_eos": True},
        )
        assert r.status_code == 200
    after = server.metrics()

    def grew(metric: str, **labels: str) -> float:
        key = vllm_metric(metric, name, **labels)
        return after[key] - before.get(key, 0)

    assert grew("prompt_tokens_total") == sum(len(llm.tokenizer(p).input_ids) for p in prompts)
    assert grew("generation_tokens_total") == 15
    assert grew("request_success_total", finished_reason="length") == 3
    assert grew("time_to_first_token_seconds_count") == 3
    assert grew("e2e_request_latency_seconds_count") == 3
    assert grew("inter_token_latency_seconds_count") == 3 * 4  # (the gaps)


def test_sigterm_finishes_in_flight_requests_and_exits_0(checkpoints):
    srv = ServerProcess(checkpoints("qwen3"), "--max-model-len", "256", "--grace-period", "60")
    body = {
        "model": checkpoints("qwen3"),
        "prompt": "slow",
        "max_tokens": 150,
        "ignore_eos": True,
        "stream": True,
    }
    events = []
    # Connections that stall (headers or body unfinished) or idle do not hold up the exit.
    head = b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
    stalled = [socket.create_connection(("127.0.0.1", srv.port)) for _ in range(3)]
    stalled[0].sendall(head)
    stalled[1].sendall(head + b"Content-Length: 100\r\n\r\n{")
    with (
        httpx.Client(timeout=120) as http,
        http.stream("POST", f"{srv.url}/v1/completions", json=body) as response,
    ):
        lines = response.iter_lines()
        events.append(next(line for line in lines if line.startswith("data:")))
        srv.proc.send_signal(signal.SIGTERM)
        events += [line for line in lines if line.startswith("data:")]
    done = time.monotonic()
    assert events[-1] == "data: [DONE]"
    finish = [json.loads(e[6:])["choices"][0]["finish_reason"] for e in events[:-1]]
    assert finish[-1] == "length"
    assert srv.proc.wait(60) == 0
    assert time.monotonic() - done < 10  # not the grace period (60 s) nor the read timeout (30 s)
    for s in stalled:
        s.close()
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{srv.url}/health", timeout=2)


def test_health_and_requests_get_503_once_the_engine_is_down(checkpoints):
    from fastapi.testclient import TestClient

    from nano_engine import EngineConfig, LLMEngine
    from nano_engine.server import Server

    engine = LLMEngine(EngineConfig.from_kwargs(checkpoints("qwen3"), max_model_len=256))
    client = TestClient(Server(engine, "tiny").app)
    assert client.get("/health").status_code == 200
    engine.shutdown()
    response = client.get("/health")
    assert response.status_code == 503 and "not running" in response.json()["error"]["message"]
    response = client.post("/v1/completions", json={"model": "tiny", "prompt": "x"})
    assert response.status_code == 503 and response.json()["error"]["code"] == 503


def test_echo_writes_the_prompt_back(server, client):
    kwargs = dict(model=server.model, max_tokens=5, temperature=0)
    plain = client.completions.create(prompt="Hello there", **kwargs).choices[0].text
    echoed = client.completions.create(prompt="Hello there", echo=True, **kwargs).choices[0]
    assert echoed.text == "Hello there" + plain
    ids = client.completions.create(prompt=[5, 6, 7], echo=True, **kwargs).choices[0].text
    tokens = client.completions.create(prompt=[5, 6, 7], **kwargs).choices[0].text
    prompt = httpx.post(
        f"{server.url}/detokenize",
        json={"tokens": [5, 6, 7]},
        headers={"Authorization": f"Bearer {KEY}"},
    ).json()["prompt"]
    assert ids == prompt + tokens
    chunks = client.completions.create(prompt="Hello there", echo=True, stream=True, n=2, **kwargs)
    texts = ["", ""]
    for chunk in chunks:
        for c in chunk.choices:
            texts[c.index] += c.text
    assert texts == [echoed.text, echoed.text]


def test_a_streaming_prompt_is_held_in_one_list_only(checkpoints):
    """While a request streams, its token ids are in one Python list (the engine's request, for
    its outputs): not the parsed JSON body, the validated body (a tuple) or the scheduler's
    sequence (an int64 array), which Python's cyclic collector would walk item by item on each
    full collection, for every stream."""
    import gc

    from fastapi.testclient import TestClient

    from nano_engine import EngineConfig, LLMEngine
    from nano_engine.server import Server

    engine = LLMEngine(EngineConfig.from_kwargs(checkpoints("qwen3"), max_model_len=512))
    prompt = [300 + (7 * i) % 97 for i in range(301)]
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 150, "stream": True}
    body["ignore_eos"] = True
    try:
        client = TestClient(Server(engine, "tiny").app)
        with client.stream("POST", "/v1/completions", json=body) as response:
            lines = response.iter_lines()
            assert next(line for line in lines if line.startswith("data:"))
            held = [o for o in gc.get_objects() if type(o) is list and o == prompt]
            assert engine.num_requests == 1  # (still streaming)
            rest = [line for line in lines if line.startswith("data:")]
        assert len(held) == 2  # the engine's, and this test's own
        assert rest[-1] == "data: [DONE]"
    finally:
        engine.shutdown()
