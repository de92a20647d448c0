"""The server under hostile and careless clients (a real server on a loopback port; the
official openai client, or raw sockets for what it cannot send): nothing one client sends
stalls the others, every field is honoured or refused, every failure is told, and nothing is
left running, waiting or held afterwards."""

from __future__ import annotations

import contextlib
import json
import re
import signal
import socket
import statistics
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_helpers import ServerProcess, vllm_metric

from nano_engine.protocol import UNSUPPORTED, ChatCompletionRequest, CompletionRequest

READ_TIMEOUT = 1.0
MAX_CONNECTIONS = 40
OPTIONS = (
    "--max-model-len",
    "256",
    "--kvcache-block-size",
    "8",
    "--max-body-bytes",
    str(3 << 20),
    "--max-request-entries",
    "200000",
    "--read-timeout",
    str(READ_TIMEOUT),
    "--keep-alive-timeout",
    "1",
    "--max-connections",
    str(MAX_CONNECTIONS),
)


@pytest.fixture(scope="module")
def server(checkpoints):
    srv = ServerProcess(checkpoints("qwen3"), *OPTIONS, open_files=256)
    yield srv
    assert srv.stop() == 0


@pytest.fixture()
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)


def post(server, path: str, body=None, content: bytes | None = None) -> httpx.Response:
    headers = {"Content-Type": "application/json"} if content is not None else {}
    return httpx.post(
        f"{server.url}{path}", json=body, content=content, headers=headers, timeout=60
    )


def assert_error(response: httpx.Response, status: int, message: str, param: str | None = None):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == status
    assert re.search(message, error["message"]), error["message"]
    if param is not None:
        assert error["param"] == param, error


def idle(server) -> bool:
    m = server.wait_idle()
    return all(
        m[vllm_metric(name, server.model)] == 0
        for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")
    )


def test_heavy_requests_do_not_stall_the_others(server):
    """Defect 1: 1 MiB prompts (tokenized, then refused as too long) and n x logprobs
    responses are built off the event loop; /health and a small request stay fast."""
    big = {"model": server.model, "prompt": "lorem ipsum dolor sit amet " * 40000}  # ~1 MiB
    wide = {
        "model": server.model,
        "prompt": "wide",
        "n": 64,
        "logprobs": 20,
        "max_tokens": 100,
        "ignore_eos": True,
    }
    stop = threading.Event()
    heavy_done = []

    def heavy(body: dict) -> None:
        while not stop.is_set():
            r = post(server, "/v1/completions", body)
            heavy_done.append(r.status_code)

    threads = [threading.Thread(target=heavy, args=(big,)) for _ in range(3)]
    threads.append(threading.Thread(target=heavy, args=(wide,)))
    for t in threads:
        t.start()
    health, small = [], []
    try:
        time.sleep(0.5)
        deadline = time.monotonic() + 3
        with httpx.Client(timeout=30) as http:
            while time.monotonic() < deadline:
                start = time.perf_counter()
                assert http.get(f"{server.url}/health").status_code == 200
                health.append(time.perf_counter() - start)
                start = time.perf_counter()
                r = http.post(
                    f"{server.url}/v1/completions",
                    json={"model": server.model, "prompt": "small", "max_tokens": 1},
                )
                assert r.status_code == 200
                small.append(time.perf_counter() - start)
                time.sleep(0.05)
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert 400 in heavy_done and 200 in heavy_done  # both kinds ran meanwhile
    assert max(health) < 0.5, sorted(health)[-5:]
    assert statistics.median(small) < 0.5, sorted(small)


def test_text_offsets_take_linear_time():
    from nano_engine.bodies import text_offsets

    tokens = ["ab", "c", "", "def"] * 25_000
    start = time.perf_counter()
    offsets = text_offsets(tokens)
    assert time.perf_counter() - start < 0.5  # (quadratic: minutes)
    assert offsets[:6] == [0, 2, 3, 3, 6, 8] and len(offsets) == len(tokens)


def test_text_offsets_are_those_of_the_tokens(server, client):
    lp = client.completions.create(
        model=server.model,
        prompt="offsets",
        max_tokens=50,
        logprobs=1,
        extra_body={"ignore_eos": True},
    ).choices[0]
    tokens, offsets = lp.logprobs.tokens, lp.logprobs.text_offset
    assert offsets == [sum(len(t) for t in tokens[:k]) for k in range(len(tokens))]


def raw(server, data: bytes) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port))
    sock.sendall(data)
    return sock


def read_all(sock: socket.socket, timeout: float) -> bytes:
    sock.settimeout(timeout)
    chunks = []
    try:
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    except (TimeoutError, ConnectionResetError):
        pass
    return b"".join(chunks)


def test_stalled_and_idle_connections_are_closed(server):
    """Defect 2: partial headers, a body shorter than its Content-Length and a silent socket
    are answered with 408 and closed after the read timeout."""
    head = "POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
    stalled = [
        raw(server, head.encode()),  # headers never end
        raw(server, (head + "Content-Length: 100\r\n\r\n{").encode()),  # body never ends
        raw(server, b""),  # nothing at all
    ]
    start = time.monotonic()
    answers = [read_all(s, 10) for s in stalled]
    elapsed = time.monotonic() - start
    for s in stalled:
        s.close()
    assert all(a.startswith(b"HTTP/1.1 408") for a in answers), answers
    assert elapsed < READ_TIMEOUT + 3
    assert b'"type":"timeout"' in answers[1].replace(b" ", b"")


def test_connections_over_the_cap_get_503_and_are_closed(server):
    server.wait_idle()  # (a busy loop could accept so slowly that the first ones time out)
    socks = [raw(server, b"") for _ in range(MAX_CONNECTIONS)]
    try:
        time.sleep(0.2)  # (accepted: the five past the cap come after them)
        socks += [raw(server, b"") for _ in range(5)]
        time.sleep(0.3)
        refused = []
        for s in socks:
            s.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                refused.append(s.recv(65536))
        # (those within the cap may have met the read timeout already: 408)
        busy = [r for r in refused if r.startswith(b"HTTP/1.1 503")]
        assert len(busy) >= 5 and all(b"retry-after: 1" in r for r in busy), refused
    finally:
        for s in socks:
            s.close()
    time.sleep(0.3)
    assert post(server, "/v1/completions", {"model": server.model, "prompt": "x"}).is_success


def test_the_open_file_limit_is_raised(server):
    """Started with a soft limit of 256 open files, the server raised it to the hard one."""
    limits = Path(f"/proc/{server.proc.pid}/limits").read_text()
    soft, hard = re.search(r"Max open files\s+(\S+)\s+(\S+)", limits).groups()
    assert soft == hard and soft != "256", limits


SURROGATE = "a\ud800b"


@pytest.mark.parametrize(
    "path,body,param",
    [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": SURROGATE}]}, "content"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user\n2026-01-01 FORGED line\ud800", "content": "x"}]},
            "role",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": [{"type": "text", "text": SURROGATE}]}]},
            "text",
        ),
        ("/v1/completions", {"prompt": SURROGATE}, "prompt"),
        ("/v1/completions", {"prompt": ["ok", SURROGATE]}, "prompt.1"),
        ("/v1/completions", {"prompt": "x", "stop": [SURROGATE]}, "stop.0"),
        ("/tokenize", {"prompt": SURROGATE}, "prompt"),
    ],
)
def test_text_that_is_not_unicode_is_a_400(server, path, body, param):
    """Defect 3: a lone surrogate anywhere is a 400 naming the field, not a 500."""
    body = {"model": server.model, **body}
    content = json.dumps(body).encode()  # (json escapes the surrogate: \\ud800)
    response = post(server, path, content=content)
    assert_error(response, 400, "not valid Unicode")
    assert response.json()["error"]["param"].endswith(param)
    server.log.seek(0)
    assert not any(line.startswith("2026-01-01 FORGED") for line in server.log.read().splitlines())


def test_a_body_that_is_not_utf8_is_a_400(server):
    body = b'{"model": "m", "prompt": "\xff\xfe"}'
    assert_error(post(server, "/v1/completions", content=body), 400, "")


def test_a_request_that_could_hold_too_much_memory_is_a_400(server, client):
    """Defect 4: n x max_tokens x (logprobs + 1) is bounded (200,000 on this server)."""
    body = {"model": server.model, "prompt": "m", "n": 128, "max_tokens": 200, "logprobs": 20}
    assert_error(
        post(server, "/v1/completions", body), 400, r"--max-request-entries", param="max_tokens"
    )
    chat = {
        "model": server.model,
        "messages": [{"role": "user", "content": "m"}],
        "n": 128,
        "logprobs": True,
        "top_logprobs": 20,
    }  # max_tokens unset: up to the model's length
    assert_error(post(server, "/v1/chat/completions", chat), 400, "lower n, max_tokens")
    ok = client.completions.create(model=server.model, prompt="m", n=2, max_tokens=5, logprobs=20)
    assert len(ok.choices) == 2 and all(
        0 < len(c.logprobs.top_logprobs[0]) <= 20 for c in ok.choices
    )


def test_extreme_sampling_values(server, client):
    """Defect 6: a temperature below 1e-5 is greedy; non-finite values are a 400 naming the
    field; large finite ones are allowed."""
    greedy = client.completions.create(
        model=server.model, prompt="Tiny", max_tokens=8, temperature=0
    ).choices[0]
    tiny = client.completions.create(
        model=server.model, prompt="Tiny", max_tokens=8, temperature=1e-45
    ).choices[0]
    assert tiny.text == greedy.text
    hot = client.completions.create(
        model=server.model, prompt="Hot", max_tokens=4, temperature=1e30
    )
    assert hot.choices[0].finish_reason
    for field in ("temperature", "top_p", "repetition_penalty", "presence_penalty", "min_p"):
        for literal in ("Infinity", "-Infinity", "NaN"):
            content = f'{{"model": "{server.model}", "prompt": "x", "{field}": {literal}}}'
            assert_error(post(server, "/v1/completions", content=content.encode()), 400, field)


REFUSED = {
    "suffix": "tail",
    "use_beam_search": True,
    "return_tokens_as_token_ids": True,
    "guided_whitespace_pattern": r"\s*",
    "priority": 3,
    "add_special_tokens": False,
    "no_such_field": 1,
}
REFUSED_CHAT = {
    "functions": [{"name": "f"}],
    "tool_choice": "required",  # (without tools)
    "chat_template_kwargs": {"tokenize": True},  # (not a template variable)
    "continue_final_message": True,
    "best_of": 3,
}


@pytest.mark.parametrize("field", list(REFUSED) + list(REFUSED_CHAT))
def test_unsupported_and_unknown_fields_are_refused_by_name(server, client, field):
    """Defect 9: a 400 that names the field (the openai client's extra_body sends them)."""
    with pytest.raises(openai.BadRequestError) as info:
        if field in REFUSED:
            client.completions.create(
                model=server.model, prompt="x", max_tokens=2, extra_body={field: REFUSED[field]}
            )
        else:
            client.chat.completions.create(
                model=server.model,
                messages=[{"role": "user", "content": "x"}],
                max_tokens=2,
                extra_body={field: REFUSED_CHAT[field]},
            )
    error = info.value.body
    assert error["param"] == field and field in error["message"], error


def test_neutral_values_of_unsupported_fields_are_accepted(server, client):
    r = client.chat.completions.create(
        model=server.model,
        messages=[
            {"role": "user", "content": "x"},
            {"role": "assistant", "content": "y", "tool_calls": None, "refusal": None},
            {"role": "user", "content": "z"},
        ],
        max_tokens=2,
        tool_choice="none",
        extra_body={"use_beam_search": False, "priority": 0, "response_format": {"type": "text"}},
    )
    assert r.choices[0].finish_reason


def test_every_request_field_is_in_the_readme_table():
    """Defect 9: one table in the server's docs says what is honoured and what is refused."""
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    table = set(re.findall(r"^\| `(\w+)`", readme, re.M))
    fields = set(CompletionRequest.model_fields) | set(ChatCompletionRequest.model_fields)
    missing = (fields | set(UNSUPPORTED)) - table
    assert not missing, sorted(missing)


def test_vllm_metric_names_types_and_labels(server):
    for _ in range(2):  # (two blocks of 8 tokens: found in the prefix cache the second time)
        assert post(server, "/v1/completions", {"model": server.model, "prompt": [5] * 17})
    text = httpx.get(f"{server.url}/metrics").text
    types = {f.name: f.type for f in text_string_to_metric_families(text)}
    expected = {
        "vllm:num_requests_running": "gauge",
        "vllm:num_requests_waiting": "gauge",
        "vllm:kv_cache_usage_perc": "gauge",
        "vllm:prompt_tokens": "counter",
        "vllm:generation_tokens": "counter",
        "vllm:time_to_first_token_seconds": "histogram",
        "vllm:inter_token_latency_seconds": "histogram",
        "vllm:e2e_request_latency_seconds": "histogram",
        "vllm:request_success": "counter",
        "vllm:num_preemptions": "counter",
        "vllm:prefix_cache_queries": "counter",
        "vllm:prefix_cache_hits": "counter",
    }
    assert {name: types.get(name) for name in expected} == expected
    for family in text_string_to_metric_families(text):
        if family.name.startswith("vllm:"):
            assert all(s.labels["model_name"] == server.model for s in family.samples)
    reasons = {
        s.labels["finished_reason"]
        for f in text_string_to_metric_families(text)
        if f.name == "vllm:request_success"
        for s in f.samples
    }
    assert {"stop", "length", "abort"} <= reasons
    m = server.metrics()
    hits = m[vllm_metric("prefix_cache_hits_total", server.model)]
    assert 0 < hits <= m[vllm_metric("prefix_cache_queries_total", server.model)]


def test_after_everything_a_good_request_succeeds_and_nothing_is_held(server, client):
    r = client.completions.create(model=server.model, prompt="after", max_tokens=3)
    assert r.choices[0].finish_reason == "length"
    assert idle(server)


def test_the_grace_period_ends_with_503_and_an_error_event(checkpoints):
    """Defect 7: when the grace period runs out, a waiting client gets a 503 with an error
    body and a stream a last error event and [DONE]; stalled connections do not hold up the
    shutdown (defect 2)."""
    srv = ServerProcess(
        checkpoints("qwen3"),
        "--max-model-len",
        "512",
        "--grace-period",
        "1",
        "--read-timeout",
        "60",
    )
    body = {
        "model": srv.model,
        "prompt": "long",
        "n": 4,  # (several seconds of decoding on a CPU)
        "max_tokens": 500,
        "ignore_eos": True,
    }
    head = "POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
    stalled = [raw(srv, head.encode()), raw(srv, (head + "Content-Length: 100\r\n\r\n{").encode())]
    results = {}

    def wait() -> None:
        results["plain"] = httpx.post(f"{srv.url}/v1/completions", json=body, timeout=60)

    waiter = threading.Thread(target=wait)
    waiter.start()
    with (
        httpx.Client(timeout=60) as http,
        http.stream("POST", f"{srv.url}/v1/completions", json={**body, "stream": True}) as r,
    ):
        lines = r.iter_lines()
        events = [next(line for line in lines if line.startswith("data:"))]
        deadline = time.monotonic() + 30  # (both requests in the engine: 2 x n sequences)
        while srv.metric("num_requests_running") + srv.metric("num_requests_waiting") < 8:
            assert time.monotonic() < deadline, "the plain request never reached the engine"
            time.sleep(0.05)
        start = time.monotonic()
        srv.proc.send_signal(signal.SIGTERM)
        events += [line for line in lines if line.startswith("data:")]
    waiter.join()
    assert srv.proc.wait(30) == 0
    assert time.monotonic() - start < 8  # the grace period (1 s), not the read timeout (60 s)
    for s in stalled:
        s.close()
    assert events[-1] == "data: [DONE]"
    last = json.loads(events[-2][6:])
    assert last["error"]["code"] == 503 and "grace period" in last["error"]["message"]
    assert_error(results["plain"], 503, "grace period")
    srv.log.close()


def test_an_unexpected_failure_is_a_500_logged_on_one_escaped_line(caplog):
    """Defect 3: client strings in the log cannot forge lines."""
    import asyncio

    from nano_engine.connections import Gate

    async def failing(scope, receive, send):
        raise RuntimeError("role user\n2026-01-01 FORGED line \ud800")

    async def run() -> None:
        messages = [{"type": "http.request", "body": b"{}", "more_body": False}]

        async def receive():
            return messages.pop() if messages else {"type": "http.disconnect"}

        async def send(message):
            pass

        scope = {"type": "http", "method": "POST", "path": "/v1/x\nFORGED", "headers": []}
        await Gate(failing, 1024)(scope, receive, send)

    with caplog.at_level("ERROR", logger="nano_engine.server"):
        asyncio.run(run())
    (record,) = caplog.records
    first = record.getMessage().splitlines()[0]
    assert "FORGED line \\ud800" in first and "/v1/x\\nFORGED" in first
    assert not any(line.startswith(("2026-01-01", "FORGED")) for line in caplog.text.splitlines())
