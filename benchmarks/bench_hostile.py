"""What heavy clients cost the others, against a running nano-engine server.

latency: a small request's latency (and /health's) alone, then while three clients send ~1 MiB
prompts (tokenized, then refused as too long) and one sends n x logprobs requests.
memory: the server's resident memory before and after concurrent n x logprobs requests.

python benchmarks/bench_hostile.py --url http://127.0.0.1:8000 --model MODEL --pid PID
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx


def small_latencies(url: str, model: str, seconds: float) -> tuple[list[float], list[float]]:
    health, small = [], []
    deadline = time.monotonic() + seconds
    with httpx.Client(timeout=120) as http:
        while time.monotonic() < deadline:
            start = time.perf_counter()
            http.get(f"{url}/health")
            health.append(time.perf_counter() - start)
            start = time.perf_counter()
            r = http.post(
                f"{url}/v1/completions", json={"model": model, "prompt": "small", "max_tokens": 1}
            )
            r.raise_for_status()
            small.append(time.perf_counter() - start)
            time.sleep(0.05)
    return health, small


def summary(values: list[float]) -> dict:
    ordered = sorted(values)
    return {
        "count": len(values),
        "p50_ms": 1e3 * statistics.median(ordered),
        "p90_ms": 1e3 * ordered[int(0.9 * (len(ordered) - 1))],
        "max_ms": 1e3 * ordered[-1],
    }


def latency(url: str, model: str, seconds: float) -> dict:
    alone = small_latencies(url, model, seconds / 2)
    big = {"model": model, "prompt": "lorem ipsum dolor sit amet " * 38000}  # ~1 MiB
    wide = {
        "model": model,
        "prompt": "wide",
        "n": 64,
        "logprobs": 20,
        "max_tokens": 100,
        "ignore_eos": True,
    }
    stop = threading.Event()

    def heavy(body: dict) -> None:
        with httpx.Client(timeout=300) as http:
            while not stop.is_set():
                http.post(f"{url}/v1/completions", json=body)

    threads = [threading.Thread(target=heavy, args=(b,)) for b in (big, big, big, wide)]
    for t in threads:
        t.start()
    time.sleep(1)
    loaded = small_latencies(url, model, seconds)
    stop.set()
    for t in threads:
        t.join()
    return {
        "alone": {"health": summary(alone[0]), "small": summary(alone[1])},
        "loaded": {"health": summary(loaded[0]), "small": summary(loaded[1])},
    }


def rss_mib(pid: int) -> tuple[float, float]:
    """Resident and peak resident memory of a process, MiB."""
    status = Path(f"/proc/{pid}/status").read_text()
    fields = dict(line.split(":", 1) for line in status.splitlines())
    return tuple(int(fields[k].split()[0]) / 1024 for k in ("VmRSS", "VmHWM"))


def memory(
    url: str, model: str, pid: int, requests: int, n: int, max_tokens: int, logprobs: int | None
) -> dict:
    body = {
        "model": model,
        "prompt": "memory",
        "n": n,
        "logprobs": logprobs,
        "max_tokens": max_tokens,
        "ignore_eos": True,
    }
    before = rss_mib(pid)
    peak = [before[0]]
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak.append(rss_mib(pid)[0])
            time.sleep(0.05)

    sampler = threading.Thread(target=sample)
    sampler.start()
    start = time.perf_counter()
    with ThreadPoolExecutor(requests) as pool:
        codes = list(
            pool.map(
                lambda _: httpx.post(f"{url}/v1/completions", json=body, timeout=600).status_code,
                range(requests),
            )
        )
    done.set()
    sampler.join()
    return {
        "requests": requests,
        "n": n,
        "logprobs": logprobs,
        "max_tokens": max_tokens,
        "status": sorted(set(codes)),
        "seconds": time.perf_counter() - start,
        "rss_before_mib": before[0],
        "rss_peak_mib": max(peak),
        "rss_after_mib": rss_mib(pid)[0],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--url", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--pid", type=int, help="the server's process (for memory)")
    parser.add_argument("--seconds", type=float, default=10)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--n", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=200)
    parser.add_argument("--logprobs", type=int, default=20, help="-1: none")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--memory-only", action="store_true", help="skip the latency phase")
    args = parser.parse_args()
    result = {} if args.memory_only else {"latency": latency(args.url, args.model, args.seconds)}
    if args.pid:
        result["memory"] = memory(
            args.url,
            args.model,
            args.pid,
            args.requests,
            args.n,
            args.max_tokens,
            None if args.logprobs < 0 else args.logprobs,
        )
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
