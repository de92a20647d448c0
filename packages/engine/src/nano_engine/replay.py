"""Replay a workload against an OpenAI-compatible server, as clients would, and time it.

Each request is sent at its arrival time as a streaming completion of its prompt's token ids
(nano_scheduler.sim's prompts, folded into the model's vocabulary), asking for exactly its
output length (``ignore_eos``; the usage chunk's count is checked). Each server-sent event with
text is stamped when it arrives (events that arrive in one read share the stamp: they did
arrive together). The requests are spread over several client processes (one Python process
cannot parse tens of thousands of events a second); times are ``time.monotonic()``, one clock
for every process of the machine, so they compare with the engine's step log.

The records are nano-sim's (``RequestRecord``), so a replay and a simulation of the same
workload compare field by field.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import multiprocessing
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from nano_scheduler.sim.metrics import RequestRecord
from nano_scheduler.sim.workload import Request


@dataclass
class ClientRecord:
    """One request as its client saw it (monotonic seconds)."""

    index: int  # in the workload
    sent: float
    prompt_tokens: int
    max_tokens: int
    times: list[float] = field(default_factory=list)  # each event with tokens, as received
    tokens: int | None = None  # the usage chunk's completion tokens
    error: str | None = None

    def to_record(self, origin: float) -> RequestRecord:
        """nano-sim's record, in seconds from ``origin``."""
        return RequestRecord(
            self.index,
            self.sent - origin,
            None,
            self.times[0] - origin,
            self.times[-1] - origin,
            self.prompt_tokens,
            self.tokens,
        )


ROOM = 64  # connections and queue places a server gets beyond a run's requests


def serve_options(options: list[str], requests: int) -> list[str]:
    """A server's options for a run of ``requests`` requests: ``options``, and room for
    every one of them, open and queued, where they do not set ``--max-connections`` or
    ``--max-queue`` (far above capacity every request holds its stream open while it
    queues; the server's defaults would turn the rest away)."""
    given = {o.partition("=")[0] for o in options}
    extra = []
    for flag in ("--max-connections", "--max-queue"):
        if flag not in given:
            extra += [flag, str(requests + ROOM)]
    return [*options, *extra]


class ServedEngine:
    """``nano-engine serve MODEL [options]`` in a subprocess on a free port, its step log
    written to ``step_log``, its output to ``output``; ``with`` it: the server's URL once it
    is healthy; SIGTERM at the end (the step log is written out)."""

    def __init__(
        self, model: str, options: list[str], step_log: Path, output: Path, name: str = "served"
    ) -> None:
        from nano_engine.parallel import free_port

        self.port, self.output = free_port(), Path(output)
        self.url = f"http://127.0.0.1:{self.port}"
        self.command = [sys.executable, "-m", "nano_engine.cli", "-v", "serve", model, *options]
        self.command += ["--port", str(self.port), "--served-model-name", name]
        self.command += ["--step-log", str(step_log)]

    def __enter__(self) -> str:
        import httpx

        self.log = self.output.open("w")
        self.proc = subprocess.Popen(self.command, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 900  # (a large model loads and compiles first)
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.log.close()
                tail = self.output.read_text()[-2000:]
                raise RuntimeError(f"the server exited ({self.proc.returncode}): {tail}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return self.url
            time.sleep(0.3)
        self.__exit__()
        raise RuntimeError(f"the server did not become healthy in 15 minutes: see {self.output}")

    def __exit__(self, *exc) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


@dataclass(frozen=True)
class Target:
    url: str
    model: str
    api_key: str | None = None
    vocab: int = 10_000
    seed: int = 0
    # a client process's connections at most (None: one for each of its requests, as a
    # stream holds its connection while it waits, however far above capacity)
    max_connections: int | None = None
    request_ids: str | None = None  # send X-Request-Id "{request_ids}-{index}"


@dataclass
class Replay:
    records: list[ClientRecord]  # in workload order
    start: float  # when the workload's clock started (monotonic)
    cpu_share: float  # of the busiest client process: near 1, its delays are its own

    def nano_sim_records(self) -> tuple[list[RequestRecord], list[float]]:
        """nano-sim's records of the requests that succeeded (seconds from the start), and
        the gaps between each one's consecutive events."""
        ok = [r for r in self.records if r.error is None and r.times]
        gaps = [b - a for r in ok for a, b in zip(r.times, r.times[1:])]
        return [r.to_record(self.start) for r in ok], gaps

    @property
    def failures(self) -> list[ClientRecord]:
        return [r for r in self.records if r.error is not None or not r.times]

    def lateness(self, requests: list[Request]) -> list[float]:
        """How late each request was sent, in workload order (a busy client is late)."""
        return [r.sent - self.start - requests[r.index].arrival_time for r in self.records]


def client_pool(processes: int = 4):
    """Client processes for ``replay``, started and ready (their imports done): several
    replays may share them, as they take seconds to start on a busy machine."""
    if processes < 1:
        raise ValueError(f"processes must be >= 1, got {processes}")
    context = multiprocessing.get_context("spawn")
    ready = context.Barrier(processes + 1)
    pool = context.Pool(processes, initializer=_ready, initargs=(ready,))
    ready.wait(timeout=120)
    return pool


def _ready(barrier) -> None:
    import httpx  # noqa: F401  (the first request must not wait for it)

    barrier.wait()


def replay(
    target: Target,
    requests: list[Request],
    processes: int = 4,
    delay: float = 0.5,
    pool=None,
) -> Replay:
    """Send every request at ``start + arrival_time`` (start: ``delay`` seconds from now, once
    the client processes are up) from ``processes`` processes (of ``pool``, else new ones)."""
    if not requests:
        raise ValueError("the workload is empty")
    if pool is None:
        with client_pool(processes) as own:
            return replay(target, requests, processes, delay, own)
    if processes < 1:
        raise ValueError(f"processes must be >= 1, got {processes}")
    start = time.monotonic() + delay
    jobs = [(target, requests, part, processes, start) for part in range(processes)]
    parts = pool.starmap(_client_process, jobs)
    wall = time.monotonic() - start
    records = sorted((r for rs, _ in parts for r in rs), key=lambda r: r.index)
    return Replay(records, start, max(cpu for _, cpu in parts) / wall)


def _client_process(target, requests, part, processes, start) -> tuple[list[ClientRecord], float]:
    cpu = time.process_time()
    records = asyncio.run(_replay_part(target, requests, part, processes, start))
    return records, time.process_time() - cpu


async def _replay_part(target, requests, part, processes, start) -> list[ClientRecord]:
    import httpx

    mine = range(part, len(requests), processes)
    cap = target.max_connections
    limits = httpx.Limits(max_connections=len(mine) + 8 if cap is None else cap)
    headers = {"Authorization": f"Bearer {target.api_key}"} if target.api_key else None
    async with httpx.AsyncClient(timeout=None, limits=limits, headers=headers) as client:
        # A client's first request costs it tens of milliseconds more than the next (httpx's
        # lazy imports, its connection: 30-50 ms on a 2-core machine), which the first
        # request of each process would carry as if the server took that long (the engine's
        # 4 slowest TTFTs in a replay on an H200): one request to /health before the start
        # pays it (any answer does).
        with contextlib.suppress(httpx.HTTPError):
            await client.get(f"{target.url}/health", timeout=10)
        tasks = []
        for index in mine:
            r = requests[index]
            delay = start + r.arrival_time - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            prompt = [t % target.vocab for t in r.token_ids(index, target.seed)]
            tasks.append(asyncio.create_task(_one(client, target, index, prompt, r.output_len)))
        return await asyncio.gather(*tasks)


async def _one(client, target: Target, index: int, prompt: list[int], max_tokens: int):
    body = {
        "model": target.model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    headers = {"X-Request-Id": f"{target.request_ids}-{index}"} if target.request_ids else None
    record = ClientRecord(index, time.monotonic(), len(prompt), max_tokens)
    pending = b""
    url = f"{target.url}/v1/completions"
    try:
        async with client.stream("POST", url, json=body, headers=headers) as response:
            if response.status_code != 200:
                text = (await response.aread())[:200]
                record.error = f"HTTP {response.status_code}: {text!r}"
                return record
            async for data in response.aiter_raw():
                now = time.monotonic()
                *events, pending = (pending + data).split(b"\n\n")
                for event in events:
                    if event.startswith(b'data: {"error"'):
                        record.error = json.loads(event[6:])["error"]["message"]
                    elif b'"usage": {' in event:
                        record.tokens = json.loads(event[6:])["usage"]["completion_tokens"]
                    elif event.startswith(b"data: {"):
                        record.times.append(now)
    except Exception as e:  # (a refused or dropped connection: this request failed)
        record.error = f"{type(e).__name__}: {e}"
    if record.error is None and record.tokens != max_tokens:
        record.error = f"{record.tokens} tokens streamed, {max_tokens} asked for"
    return record
