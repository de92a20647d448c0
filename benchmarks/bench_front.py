"""The server's front: its event loop's CPU time per request and per streamed chunk.

``nano-engine serve``'s event loop validates every request, hands it to the engine and writes
every chunk of every stream; far above capacity, with hundreds of streams, it is what the
server runs out of first (benchmarks/RESULTS.md: the saturated server's front at 100% of a
core). Here the routes run as ``serve`` builds them (the Gate and the FastAPI app) over an
engine in this process whose device work is removed (``bench_host``'s no-op runner, a fixed
time a step), driven straight through ASGI by concurrent streaming completion requests of
token-id prompts: no sockets and no HTTP parsing (uvicorn's part, the same whatever the routes
do). Measured: the event loop thread's own CPU time (``time.thread_time``), so the engine's
thread beside it does not count.

Two runs: requests of one output token (the cost of a request: validation, submission, its
one chunk and the last event), then long streams; a chunk's cost is the second run's time
less its requests' cost, per chunk written (a stream that fell behind gets its waiting tokens
merged into one chunk).

    python benchmarks/bench_front.py [--streams 256] [--tokens 200] [--prompt 1000] [--json F]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from pathlib import Path

from bench_host import no_device

from nano_engine.config import EngineConfig
from nano_engine.engine import LLMEngine
from nano_engine.interpreter import tune_for_serving
from nano_engine.server import build_app

ROOT = Path(__file__).resolve().parents[1]
MODEL = str(ROOT / "benchmarks/configs/tiny-qwen3.json")


def engine(streams: int, tokens: int, prompt: int, step_s: float) -> LLMEngine:
    """An engine of ``streams`` sequences a step whose steps take ``step_s`` (no device)."""
    blocks = streams * (-(-(prompt + tokens) // 16) + 1) + 64
    config = EngineConfig.from_kwargs(
        MODEL,
        load_format="dummy",
        skip_tokenizer_init=True,
        device="cpu",
        max_num_seqs=streams,
        max_num_batched_tokens=max(8192, prompt),
        num_kvcache_blocks=blocks,
        max_model_len=prompt + tokens + 16,
    )
    llm = LLMEngine(config)
    no_device(llm, [])
    execute = llm.runner.execute

    def timed(*args, **kwargs):
        time.sleep(step_s)  # (the device's time: the GIL is free meanwhile, as on a GPU)
        return execute(*args, **kwargs)

    llm.runner.execute = timed
    return llm


async def request(app, body: bytes) -> tuple[int, int]:
    """One POST /v1/completions through ``app``; returns (status, body chunks written)."""
    done = asyncio.Event()
    sent = [0, 0]
    first = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive():
        if first:
            return first.pop()
        await done.wait()
        return {"type": "http.disconnect"}

    async def send(message):
        if message["type"] == "http.response.start":
            sent[0] = message["status"]
        elif message.get("body"):
            sent[1] += 1
        if not message.get("more_body", False) and message["type"] == "http.response.body":
            done.set()

    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},  # (uvicorn's)
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/v1/completions",
        "raw_path": b"/v1/completions",
        "query_string": b"",
        "root_path": "",
        "headers": [
            (b"host", b"127.0.0.1:8000"),
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
        ],
        "client": ("127.0.0.1", 50000),
        "server": ("127.0.0.1", 8000),
    }
    await app(scope, receive, send)
    return sent[0], sent[1]


async def drive(app, streams: int, tokens: int, prompt: int, seed: int) -> tuple[float, int]:
    """``streams`` concurrent streaming requests; returns the loop thread's CPU seconds and the
    chunks written."""
    rng = random.Random(seed)
    bodies = [
        json.dumps(
            {
                "model": MODEL,
                "prompt": [rng.randrange(1, 10_000) for _ in range(prompt)],
                "max_tokens": tokens,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
        ).encode()
        for _ in range(streams)
    ]
    start = time.thread_time()
    results = await asyncio.gather(*(request(app, b) for b in bodies))
    cpu = time.thread_time() - start
    bad = [status for status, _ in results if status != 200]
    if bad:
        raise RuntimeError(f"{len(bad)} requests failed (status {bad[0]})")
    return cpu, sum(chunks for _, chunks in results)


def run(streams: int, tokens: int, prompt: int, step_s: float, rounds: int) -> dict:
    llm = engine(streams, tokens, prompt, step_s)
    try:
        app, _ = build_app(llm, MODEL)
        per_request, per_chunk = [], []
        for r in range(rounds):
            short, _ = asyncio.run(drive(app, streams, 1, prompt, r))
            long, chunks = asyncio.run(drive(app, streams, tokens, prompt, r))
            per_request.append(short / streams)
            # (the short run paid for each stream's first chunk, its usage and [DONE])
            per_chunk.append((long - short) / (chunks - 3 * streams))
    finally:
        llm.shutdown()
    return {
        "request_us": statistics.median(per_request) * 1e6,
        "chunk_us": statistics.median(per_chunk) * 1e6,
        "rounds": rounds,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=256, help="concurrent streams")
    parser.add_argument("--tokens", type=int, default=200, help="output tokens a stream")
    parser.add_argument("--prompt", type=int, default=1000, help="prompt tokens a request")
    parser.add_argument("--step-ms", type=float, default=20.0, help="a step's device time")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    tune_for_serving()  # (as serve does)
    result = run(args.streams, args.tokens, args.prompt, args.step_ms / 1e3, args.rounds)
    print(
        f"front event loop, {args.streams} streams of {args.prompt}-token prompts: "
        f"{result['request_us']:,.0f} us of CPU a request, {result['chunk_us']:,.1f} us a chunk"
    )
    if args.json:
        args.json.write_text(json.dumps({**result, "args": vars(args) | {"json": None}}))


if __name__ == "__main__":
    main()
