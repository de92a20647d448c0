"""Replay an Azure LLM trace against a running nano-engine server and measure serving latency.

Each request is sent at its (scaled) arrival time as a streaming completion of random token ids
of the trace's prompt length, asking for exactly its output length (ignore_eos; the usage
chunk's count is checked). Reports TTFT, inter-token (between streamed chunks: one token each
unless the server fell behind and merged them) and end-to-end latency percentiles and
throughput, as JSON and as a plot.

    nano-engine serve MODEL --port 8000 &
    python benchmarks/bench_serving.py --url http://127.0.0.1:8000 --model MODEL \\
        --trace ../shared/traces/azure_llm_2023_conv.csv --rate-scale 20 --limit 2000
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import multiprocessing
import random
import time
from pathlib import Path

import httpx

from nano_scheduler.sim import load_azure_trace, scale_arrivals
from nano_scheduler.sim.metrics import percentiles

ROOT = Path(__file__).resolve().parents[1]


async def one(
    client: httpx.AsyncClient,
    url: str,
    model: str,
    prompt: list[int],
    max_tokens: int,
    start: float,
) -> dict:
    """One streaming completion; each server-sent event with text is stamped when it arrives
    (events that arrive in one read share the stamp: they did arrive together). An event is a
    step's token, or several when the server fell behind; the final usage event counts them."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    sent = time.perf_counter()
    times, error, pending, tokens = [], None, b"", None
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        if response.status_code != 200:
            error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
        else:
            async for data in response.aiter_raw():
                now = time.perf_counter()
                *events, pending = (pending + data).split(b"\n\n")
                for event in events:
                    if event.startswith(b'data: {"error"'):
                        error = json.loads(event[6:])["error"]["message"]
                    elif b'"usage": {' in event:
                        tokens = json.loads(event[6:])["usage"]["completion_tokens"]
                    elif event.startswith(b"data: {"):
                        times.append(now)
    if error is None and tokens != max_tokens:
        error = f"{tokens} tokens streamed, {max_tokens} asked for"
    return {
        "sent": sent - start,
        "times": [t - sent for t in times],
        "prompt": len(prompt),
        "tokens": tokens,
        "error": error,
    }


async def replay_part(args: argparse.Namespace, part: int, start_at: float) -> list[dict]:
    """Replay every ``args.processes``-th request of the trace (from ``part``), on the trace's
    clock started at wall time ``start_at``."""
    requests = scale_arrivals(load_azure_trace(args.trace, args.limit), args.rate_scale)
    rng = random.Random(args.seed + part)
    limits = httpx.Limits(max_connections=args.max_connections)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else None
    async with httpx.AsyncClient(timeout=None, limits=limits, headers=headers) as client:
        start = time.perf_counter() + (start_at - time.time())
        tasks = []
        for r in requests[part :: args.processes]:
            delay = r.arrival_time - (time.perf_counter() - start)
            if delay > 0:
                await asyncio.sleep(delay)
            prompt = [rng.randrange(args.vocab) for _ in range(min(r.prompt_len, args.max_len))]
            tasks.append(
                asyncio.create_task(
                    one(
                        client, args.url, args.model, prompt, min(r.output_len, args.max_len), start
                    )
                )
            )
        return await asyncio.gather(*tasks)


def client_process(args: argparse.Namespace, part: int, start_at: float) -> tuple[list, float]:
    """One client process: its results and the CPU seconds it used."""
    cpu = time.process_time()
    results = asyncio.run(replay_part(args, part, start_at))
    return results, time.process_time() - cpu


def replay(args: argparse.Namespace) -> tuple[list[dict], float]:
    """All requests from ``args.processes`` client processes (one Python process cannot parse
    tens of thousands of events a second); returns the results and the clients' busiest CPU
    share."""
    start_at = time.time() + 2.0  # the processes start first, then the trace's clock
    context = multiprocessing.get_context("spawn")
    with context.Pool(args.processes) as pool:
        parts = pool.starmap(client_process, [(args, p, start_at) for p in range(args.processes)])
    wall = time.time() - start_at
    return [r for results, _ in parts for r in results], max(cpu for _, cpu in parts) / wall


def summarize(results: list[dict]) -> dict:
    ok = [r for r in results if r["error"] is None and r["times"]]
    ttft = [r["times"][0] for r in ok]
    itl = [b - a for r in ok for a, b in zip(r["times"], r["times"][1:])]
    e2e = [r["times"][-1] for r in ok]
    duration = max(r["sent"] + r["times"][-1] for r in ok) - min(r["sent"] for r in ok)
    output = sum(r["tokens"] for r in ok)
    return {
        "requests": len(results),
        "failed": len(results) - len(ok),
        "duration_s": duration,
        "input_tok_per_s": sum(r["prompt"] for r in ok) / duration,
        "output_tok_per_s": output / duration,
        "ttft_s": percentiles(ttft),
        "itl_s": percentiles(itl),
        "e2e_s": percentiles(e2e),
    }


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in results if r["error"] is None and r["times"]]
    series = {
        "TTFT": [r["times"][0] for r in ok],
        "inter-token latency": [b - a for r in ok for a, b in zip(r["times"], r["times"][1:])],
        "end-to-end latency": [r["times"][-1] for r in ok],
    }
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for ax, (name, values) in zip(axes, series.items()):
        data = sorted(values)
        ax.plot(data, [(i + 1) / len(data) for i in range(len(data))])
        ax.set(title=f"{name} CDF", xlabel="seconds", ylabel="fraction")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", required=True, help="the served model name")
    parser.add_argument("--api-key")
    parser.add_argument(
        "--trace", type=Path, default=ROOT.parent / "shared" / "traces" / "azure_llm_2023_conv.csv"
    )
    parser.add_argument("--limit", type=int, help="only the first N requests")
    parser.add_argument("--rate-scale", type=float, default=1.0, help="arrive N times faster")
    parser.add_argument(
        "--max-len",
        type=int,
        default=1 << 30,
        help="cap prompt and output lengths (small test models)",
    )
    parser.add_argument("--vocab", type=int, default=10_000, help="prompt ids below this")
    parser.add_argument("--max-connections", type=int, default=1024, help="per client process")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--processes", type=int, default=4, help="client processes")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--plot", type=Path)
    args = parser.parse_args()
    results, cpu_share = replay(args)
    summary = summarize(results)
    # A saturated client would report its own delays as the server's.
    summary["client_cpu_share"] = cpu_share
    print(
        f"{summary['requests']} requests ({summary['failed']} failed) in "
        f"{summary['duration_s']:.1f} s: {summary['input_tok_per_s']:,.0f} input tok/s, "
        f"{summary['output_tok_per_s']:,.0f} output tok/s"
    )
    print(f"{'':14}{'mean':>9}{'p50':>9}{'p90':>9}{'p99':>9}   (ms)")
    for key, name in (("ttft_s", "TTFT"), ("itl_s", "inter-token"), ("e2e_s", "end to end")):
        row = summary[key]
        print(
            f"{name:14}"
            + "".join(
                f"{row[k] * 1e3:9.1f}" if not math.isnan(row[k]) else f"{'-':>9}"
                for k in ("mean", "p50", "p90", "p99")
            )
        )
    print(f"busiest client process: CPU busy {summary['client_cpu_share']:.0%} of the run")
    failures = [r["error"] for r in results if r["error"]]
    if failures:
        print(f"first failure: {failures[0]}")
    if args.json:
        args.json.write_text(
            json.dumps(
                {"summary": summary, "args": {k: str(v) for k, v in vars(args).items()}}, indent=2
            )
        )
    if args.plot:
        plot(results, args.plot)


if __name__ == "__main__":
    main()
