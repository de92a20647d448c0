"""Replay an Azure LLM trace against a running nano-engine server and measure serving latency.

Each request is sent at its (scaled) arrival time as a streaming completion of random token ids
of the trace's prompt length, asking for exactly its output length (ignore_eos; the usage
chunk's count is checked), from several client processes (``nano_engine.replay``). Reports
throughput and TTFT, TPOT, inter-token (between streamed events: one token each unless the
server fell behind and merged them), end-to-end latency percentiles, with the same keys and
per-request records as nano-sim's JSON, so the two compare field by field.

    nano-engine serve MODEL --port 8000 &
    python benchmarks/bench_serving.py --url http://127.0.0.1:8000 --model MODEL \\
        --rate-scale 20 --limit 2000          # (the trace in benchmarks/traces by default)
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

from nano_engine.replay import Target, replay
from nano_scheduler.sim import load_azure_trace, scale_arrivals
from nano_scheduler.sim.metrics import format_summary, nan_to_none, summarize

ROOT = Path(__file__).resolve().parents[1]
TRACE = ROOT / "benchmarks" / "traces" / "azure_llm_2023_conv.csv"


def plot(records, gaps, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = {
        "TTFT": [r.ttft for r in records],
        "inter-token latency": gaps,
        "end-to-end latency": [r.e2e for r in records],
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
    parser.add_argument("--trace", type=Path, default=TRACE, help="an Azure-format trace CSV")
    parser.add_argument("--limit", type=int, help="only the first N requests")
    parser.add_argument("--rate-scale", type=float, default=1.0, help="arrive N times faster")
    parser.add_argument(
        "--max-len",
        type=int,
        default=1 << 30,
        help="cap prompt and output lengths (small test models)",
    )
    parser.add_argument("--vocab", type=int, default=10_000, help="prompt ids below this")
    parser.add_argument(
        "--max-connections",
        type=int,
        help="per client process (default: one for each of its requests)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--processes", type=int, default=4, help="client processes")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--plot", type=Path)
    args = parser.parse_args()
    if args.max_connections is not None and args.max_connections < 1:
        parser.error(f"--max-connections must be >= 1, got {args.max_connections}")
    requests = scale_arrivals(load_azure_trace(args.trace, args.limit), args.rate_scale)
    requests = [
        replace(
            r,
            prompt_len=min(r.prompt_len, args.max_len),
            output_len=min(r.output_len, args.max_len),
        )
        for r in requests
    ]
    target = Target(args.url, args.model, args.api_key, args.vocab, args.seed, args.max_connections)
    run = replay(target, requests, args.processes)
    records, gaps = run.nano_sim_records()
    summary = {**summarize(records, gaps), "failed": len(run.failures)}
    # A saturated client would report its own delays as the server's.
    summary["client_cpu_share"] = run.cpu_share
    print(format_summary(summary))
    print(f"busiest client process: CPU busy {run.cpu_share:.0%} of the run")
    if run.failures:
        print(f"{len(run.failures)} failed; the first: {run.failures[0].error}")
    if args.json:
        data = {
            "summary": summary,
            "requests": [r.to_dict() for r in records],
            "args": {k: str(v) for k, v in vars(args).items()},
        }
        args.json.write_text(json.dumps(nan_to_none(data), indent=2))
    if args.plot:
        plot(records, gaps, args.plot)


if __name__ == "__main__":
    main()
