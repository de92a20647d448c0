"""How well nano-sim predicts the engine: profile once, replay a trace against the real server,
simulate the same workload from the profile, compare.

1. ``nano-engine profile MODEL ... --out OUT/profile.json`` (or ``--profile`` to reuse one).
2. For each scenario: ``nano-engine serve MODEL ... --step-log``, the trace replayed by
   streaming clients at the scenario's rate (``nano_engine.replay``), the server stopped; then
   nano-sim on the same trace, rate and engine settings, from the profile alone.
3. A table ``metric | engine | nano-sim | error`` per scenario: output throughput, and TTFT,
   TPOT, ITL and end-to-end latency at p50 and p99, with the targets (5% on throughput, 10% on
   p50s, 20% on p99s); JSON and Markdown in OUT.

Scenarios: ``load`` (the engine keeps up, bursts queue), ``saturated`` (arrivals far above its
capacity) and ``what-if`` (other scheduler settings on both sides: a profile must predict
configurations it was not measured with). Rates default to multiples of the capacity nano-sim
predicts from the profile: 0.6x for the load, 3x for the saturated run, and 0.6x of the
what-if settings' own capacity for the what-if (fewer sequences a step serve less: at the
load's rate the what-if of d3 in benchmarks/RESULTS.md ran at its capacity, where a queue
makes any small error in the capacity a large one in latency, and the engine's own runs lay
108% apart). By default the saturated run takes at least 8x max_num_seqs of the trace's
requests (``--saturated-limit``): far above capacity the first max_num_seqs are admitted at
once, and with few more the median request's TTFT sits on the edge between them and the queue.
Each rate is a multiple of the capacity for the scenario's own requests.

    python benchmarks/sim_fidelity.py benchmarks/configs/qwen3-0.6b.json --limit 1000 \\
        --out results/fidelity -- --load-format dummy --skip-tokenizer-init --max-model-len 16384

Everything after ``--`` goes to both ``nano-engine profile`` and ``nano-engine serve``; the
server also gets room for every request of a run (``--max-connections``, ``--max-queue``), as
nano-sim turns none away.
``--repeat N`` serves each scenario N times, each in a fresh server: the error is then against
the engine's mean, and the table shows how far the engine's own runs lie apart (on a machine
whose host speed drifts, that spread is the floor under any prediction's error).
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import math
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from nano_engine.replay import ServedEngine, Target, replay, serve_options
from nano_scheduler.sim import load_azure_trace, scale_arrivals
from nano_scheduler.sim.cli import main as nano_sim
from nano_scheduler.sim.metrics import RequestRecord, nan_to_none, percentiles, summarize
from nano_scheduler.sim.profile import Profile, RequestTiming, read_step_log
from nano_scheduler.sim.profiled import ProfiledCostModel

ROOT = Path(__file__).resolve().parents[1]
TRACE = ROOT / "benchmarks" / "traces" / "azure_llm_2023_conv.csv"
# (summary key, percentile, allowed relative error)
METRICS = [
    ("output_tok_per_s", None, 0.05),
    ("ttft_s", "p50", 0.10),
    ("ttft_s", "p99", 0.20),
    ("tpot_s", "p50", 0.10),
    ("tpot_s", "p99", 0.20),
    ("itl_s", "p50", 0.10),
    ("itl_s", "p99", 0.20),
    ("e2e_s", "p50", 0.10),
    ("e2e_s", "p99", 0.20),
]
NAMES = {
    "output_tok_per_s": "output tok/s",
    "ttft_s": "TTFT",
    "tpot_s": "TPOT",
    "itl_s": "ITL",
    "ingress_s": "in (sent -> the engine has it)",
    "front_s": "of it, at the front (sent -> validated there)",
    "egress_s": "out (first token published -> received)",
}
# Each request's way in and out, apart from the engine's own time (a diagnosis, not a target;
# nano-sim has no front apart from the engine: its "front_s" is missing)
RELAY = ("ingress_s", "front_s", "egress_s")
LATE = 0.01  # seconds a client may send a request late before its stalls are warned of
# The saturated scenario's requests by default: at least this many times max_num_seqs, so that
# most of them queue (``saturated_limit``)
SATURATED_QUEUE = 8


def value(summary: dict, key: str, pct: str | None) -> float:
    """A summary's number (NaN where it has none: nano-sim's JSON writes NaN as null)."""
    x = summary[key] if pct is None else summary[key][pct]
    return math.nan if x is None else x


def capped_trace(args, path: Path, limit: int) -> tuple[Path, int]:
    """The trace's first ``limit`` requests (0: all) with lengths capped at ``--max-len``, in
    the trace's own format (both sides read this file), and how many there are."""
    with open(args.trace, newline="") as f:
        rows = list(csv.DictReader(f))
    kept = [r for r in rows if int(r["ContextTokens"]) > 0 and int(r["GeneratedTokens"]) > 0]
    kept = kept[:limit] if limit else kept
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["TIMESTAMP", "ContextTokens", "GeneratedTokens"])
        for r in kept:
            prompt = min(int(r["ContextTokens"]), args.max_len)
            output = min(int(r["GeneratedTokens"]), args.max_len)
            writer.writerow([r["TIMESTAMP"], prompt, output])
    return path, len(kept)


def simulate(profile: Path, trace: Path, rate_scale: float, out: Path, overrides) -> dict:
    args = ["--trace", str(trace), "--rate-scale", str(rate_scale), "--profile", str(profile)]
    args += [*overrides, "--json", str(out)]
    if nano_sim(args) != 0:
        raise RuntimeError(f"nano-sim failed: nano-sim {' '.join(args)}")
    return json.loads(out.read_text())["summary"]


def capacity(
    profile: Path, trace: Path, workdir: Path, overrides: list[str] = (), name: str = "capacity"
) -> float:
    """The rate scale at which nano-sim's engine (with ``overrides``) serves what arrives no
    more: the output throughput of the trace arriving 1000x faster, over the trace's offered
    throughput."""
    requests = load_azure_trace(trace)
    offered = sum(r.output_len for r in requests) / max(1e-9, requests[-1].arrival_time)
    saturated = simulate(profile, trace, 1000.0, workdir / f"{name}.json", list(overrides))
    return value(saturated, "output_tok_per_s", None) / offered


def saturated_limit(limit: int, given: int | None, engine_args: list[str], profile: Path) -> int:
    """How many of the trace's requests the saturated scenario takes (0: all): the one given,
    else the larger of ``limit`` and ``SATURATED_QUEUE`` x max_num_seqs (the engine options',
    else the profile's). Far above capacity the first max_num_seqs requests are admitted at
    once and the rest queue; with too few requests the median one sits on that edge and its
    TTFT is a knife edge (nano-sim, Qwen3-0.6B's profile at 46x, the host 10% faster /
    slower: TTFT p50 467 / 777 ms of 700 requests, 7.3 / 8.3 s of 2,000:
    benchmarks/RESULTS.md)."""
    if given is not None:
        return given
    if limit == 0:
        return 0
    seqs = batch_limits(engine_args).get("max_num_seqs")
    seqs = seqs if seqs is not None else Profile.load(profile).engine.max_num_seqs
    return max(limit, SATURATED_QUEUE * seqs)


def choose_rates(
    scenarios: list[str],
    given: dict[str, float | None],
    what_if: list[str],
    capacity_of: Callable[[list[str], Path], float],
    traces: dict[str, Path],
) -> dict[str, float]:
    """Each scenario's rate scale: the one given, else a multiple of the capacity nano-sim
    predicts for its settings and its trace (``capacity_of(overrides, traces[name])``, asked
    once per pair): 0.6x for ``load``, 3x for ``saturated``, 0.6x of the what-if settings' own
    for ``what-if``. ValueError for a rate <= 0, or a capacity that is not a positive number."""
    rates, limits = {}, {}
    for name in scenarios:
        if given.get(name) is not None:
            if not given[name] > 0:
                raise ValueError(f"the {name} scenario's rate must be > 0, got {given[name]}")
            rates[name] = given[name]
            continue
        overrides = what_if if name == "what-if" else []
        key = (tuple(overrides), traces[name])
        if key not in limits:
            limits[key] = capacity_of(overrides, traces[name])
            if not (isinstance(limits[key], float | int) and 0 < limits[key] < math.inf):
                settings = " ".join(overrides) or "the profiled settings"
                raise ValueError(
                    f"nano-sim predicts no capacity with {settings} ({limits[key]}): give the "
                    f"{name} scenario's rate (--{name}-rate)"
                )
        rates[name] = (3.0 if name == "saturated" else 0.6) * limits[key]
    return rates


def serve_scenario(args, workdir: Path, name: str, trace: Path, rate: float, overrides) -> dict:
    """One run of the engine on the scenario: the server with its step log, the trace
    replayed; the clients' summary (and every request) in ``workdir/engine.json``."""
    workdir.mkdir(parents=True, exist_ok=True)
    requests = scale_arrivals(load_azure_trace(trace), rate)
    options = serve_options([*args.engine_args, *overrides], len(requests))
    log, output = workdir / "steps.jsonl", workdir / "server.log"
    with ServedEngine(args.model, options, log, output, "sim") as url:
        target = Target(url, "sim", vocab=args.vocab, request_ids=name)
        run = replay(target, requests, args.processes)
    records, gaps = run.nano_sim_records()
    timings = {t.id: t for t in read_step_log(log).requests}
    mine = [timings.get(f"{name}-{r.request}-0") for r in records]
    records = [with_engine_times(r, t, run.start) for r, t in zip(records, mine)]
    engine = {**summarize(records, gaps), "failed": len(run.failures)}
    # (of the way in, the part up to the front's validation: an engine in a process of its own)
    front = [t.received - run.start - r.arrival for r, t in zip(records, mine)
             if t is not None and t.received is not None]  # fmt: skip
    engine["front_s"] = percentiles(front)
    engine["client_cpu_share"] = run.cpu_share
    late = sorted(run.lateness(requests))
    engine["client_lateness_s"] = {"p50": late[len(late) // 2], "max": late[-1]}
    if late[-1] > LATE:
        print(f"warning: a client sent a request {late[-1] * 1e3:.0f} ms late", flush=True)
    data = {"summary": engine, "requests": [r.to_dict() for r in records]}
    (workdir / "engine.json").write_text(json.dumps(nan_to_none(data), indent=1))
    if run.failures:
        raise RuntimeError(
            f"{len(run.failures)} requests failed; the first: {run.failures[0].error}"
        )
    return engine


def with_engine_times(
    record: RequestRecord, timing: RequestTiming | None, origin: float
) -> RequestRecord:
    """A client's record with the server's step log's times of the same request (one clock,
    the host's monotonic one): when the engine had it, when its first token was published."""
    if timing is None:
        return record
    published = None if timing.first_token is None else timing.first_token - origin
    return dataclasses.replace(record, accepted=timing.arrival - origin, first_published=published)


def run_scenario(args, name: str, trace: Path, rate: float, overrides: list[str], profile: Path):
    """The engine ``--repeat`` times (``OUT/name``, then ``OUT/name-2``...), each in a server
    of its own, and nano-sim once; the error is against the engine's mean, and ``spread``
    says how far the engine's own runs lie apart ((max - min) / mean): the noise floor a
    prediction is judged against."""
    dirs = [args.out / (name if k == 0 else f"{name}-{k + 1}") for k in range(args.repeat)]
    runs = [serve_scenario(args, d, name, trace, rate, overrides) for d in dirs]
    sim = simulate(profile, trace, rate, dirs[0] / "nano-sim.json", overrides)
    relay = []  # (not targets: where the latencies' errors come from)
    for key in RELAY:
        for pct in ("p50", "p90"):
            measured = [value(engine, key, pct) for engine in runs]
            e = sum(measured) / len(measured)
            s = value(sim, key, pct) if key in sim else math.nan
            error = s / e - 1 if e and not math.isnan(e) and not math.isnan(s) else math.nan
            relay.append(
                {"metric": f"{NAMES[key]} {pct}", "engine": e, "nano-sim": s, "error": error}
            )
    return {
        "scenario": name,
        "rate_scale": rate,
        "overrides": overrides,
        "rows": compare(runs, sim),
        "relay": relay,
        **speeds(profile, [d / "steps.jsonl" for d in dirs], overrides),
        "clients": [
            {"cpu_share": r["client_cpu_share"], "late_max_s": r["client_lateness_s"]["max"]}
            for r in runs
        ],
    }


def compare(runs: list[dict], sim: dict) -> list[dict]:
    """Each metric: the engine's mean over its runs, nano-sim's, the error, the target."""
    rows = []
    for key, pct, allowed in METRICS:
        measured = [value(engine, key, pct) for engine in runs]
        e, s = sum(measured) / len(measured), value(sim, key, pct)
        error = s / e - 1 if e and not math.isnan(e) and not math.isnan(s) else math.nan
        rows.append(
            {
                "metric": NAMES.get(key, key.removesuffix("_s")) + (f" {pct}" if pct else ""),
                "engine": e,
                "engine_runs": measured,
                "spread": (max(measured) - min(measured)) / e if e else math.nan,
                "nano-sim": s,
                "error": error,
                "allowed": allowed,
                "met": abs(error) <= allowed,
            }
        )
    return rows


LIMITS = {"--max-num-seqs": "max_num_seqs", "--max-num-batched-tokens": "max_num_batched_tokens"}


def batch_limits(overrides: list[str]) -> dict[str, int]:
    """The batch limits among engine options (``--max-num-seqs 64``, ``--max-num-seqs=64``),
    as ``ProfiledCostModel`` takes them."""
    limits, words = {}, iter(overrides)
    for word in words:
        name, equals, given = word.partition("=")
        if name in LIMITS:
            limits[LIMITS[name]] = int(given if equals else next(words))
    return limits


def speeds(profile: Path, step_logs: list[Path], overrides: list[str]) -> dict:
    """Each run's host and device time over what the profile predicts for its steps (with the
    run's batch limits: a what-if's graphs and piecewise sizes):
    ``host_ratio``: the server loop thread's; far from 1, the machine's host speed changed
    since it was profiled (a CPU that slows down, another machine), and no prediction from
    that profile can match the run. ``device_ratio``: [decode graphs, steps outside them
    that the device bounded]; far from 1, the GPU ran its steps at another speed than the
    profile measured (its clock: a GPU at its power limit slows under sustained compute)."""
    model = ProfiledCostModel(Profile.load(profile), frontend="server", **batch_limits(overrides))
    logs = [read_step_log(path).steps for path in step_logs]
    return {
        "host_ratio": [model.host_ratio(steps) for steps in logs],
        "device_ratio": [list(model.device_ratio(steps)) for steps in logs],
    }


def device_note(results: list[dict]) -> str:
    """One line: each run's device ratios, and a warning where one lies outside 0.9-1.1."""
    ratios = [(r["scenario"], x) for r in results for x in r.get("device_ratio", [])]
    if not ratios:
        return ""
    text = ", ".join(f"{name} {g:.2f} / {e:.2f}" for name, (g, e) in ratios)
    note = (
        "The device's time against the profile's prediction for the run's steps (decode"
        f" graphs / steps outside them): {text}."
    )
    off = [x for _, pair in ratios for x in pair if not math.isnan(x) and not 0.9 <= x <= 1.1]
    if off:
        note += (
            f" **Warning**: the device ran at another speed than profiled ({_span(off)} its time)."
        )
    return note


def host_note(results: list[dict]) -> str:
    """One line: each run's host ratio, and a warning where one lies outside 0.85-1.15."""
    ratios = [(r["scenario"], x) for r in results for x in r.get("host_ratio", [])]
    if not ratios:
        return ""
    text = ", ".join(f"{name} {x:.2f}" for name, x in ratios)
    note = f"The loop thread's host time against the profile's prediction for its steps: {text}."
    off = [x for _, x in ratios if not math.isnan(x) and not 0.85 <= x <= 1.15]
    if off:
        note += (
            " **Warning**: the host ran at another speed than when profiled"
            f" ({_span(off)} its time); these errors measure the machine's"
            " drift as much as nano-sim."
        )
    return note


def _span(values: list[float]) -> str:
    """0.81x, or 0.81-1.27x."""
    lo, hi = f"{min(values):.2f}", f"{max(values):.2f}"
    return f"{lo}x" if lo == hi else f"{lo}-{hi}x"


def client_note(results: list[dict]) -> str:
    """One line: how busy the clients were in each run (the busiest process's CPU share, and
    the most any of them sent a request late), and a warning where one was late by more
    than ``LATE`` (its event loop stalled: the times it stamps carry its stalls, which no
    simulation of the server has)."""
    runs = [(r["scenario"], c) for r in results for c in r.get("clients", [])]
    if not runs:
        return ""
    text = ", ".join(
        f"{name} {c['cpu_share']:.0%} ({c['late_max_s'] * 1e3:.0f} ms late)" for name, c in runs
    )
    note = f"The clients: the busiest one's CPU share, and the most any sent late: {text}."
    if any(c["late_max_s"] > LATE for _, c in runs):
        note += (
            f" **Warning**: a client was late by more than {LATE * 1e3:.0f} ms; its stalls are"
            " in the engine's latencies (more client processes: --processes)."
        )
    return note


def fmt(metric: str, v: float) -> str:
    if math.isnan(v):
        return "-"
    return f"{v:,.0f}" if metric.startswith("output") else f"{v * 1e3:,.1f} ms"


def table(results: list[dict]) -> str:
    repeated = any(len(row.get("engine_runs", ())) > 1 for res in results for row in res["rows"])
    spread = " engine's runs apart |" if repeated else ""
    lines = [
        f"| scenario | metric | engine |{spread} nano-sim | error | target |",
        "| --- | --- | --- |" + (" --- |" if repeated else "") + " --- | --- | --- |",
    ]
    for res in results:
        for row in res["rows"]:
            mark = "" if row["met"] else " **missed**"
            apart = f" {row['spread']:.1%} |" if repeated else ""
            lines.append(
                f"| {res['scenario']} ({res['rate_scale']:.2f}x) | {row['metric']} | "
                f"{fmt(row['metric'], row['engine'])} |{apart} "
                f"{fmt(row['metric'], row['nano-sim'])} | "
                f"{row['error']:+.1%} | {row['allowed']:.0%}{mark} |"
            )
    relay = [(res, row) for res in results for row in res.get("relay", ())]
    if relay:
        lines += [
            "",
            "| scenario | way | engine | nano-sim | error |",
            "| --- | --- | --- | --- | --- |",
        ]
        for res, row in relay:
            lines.append(
                f"| {res['scenario']} | {row['metric']} | {fmt('', row['engine'])} | "
                f"{fmt('', row['nano-sim'])} | "
                + ("-" if math.isnan(row["error"]) else f"{row['error']:+.1%}")
                + " |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    engine_args = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "model", help="checkpoint directory, or a config.json (with --load-format dummy after --)"
    )
    p.add_argument("--out", type=Path, required=True, help="directory for the results")
    p.add_argument("--trace", type=Path, default=TRACE, help="an Azure-format trace CSV")
    p.add_argument("--limit", type=int, default=1000, help="the trace's first N requests (0: all)")
    p.add_argument(
        "--saturated-limit",
        type=int,
        help=f"the saturated scenario's first N requests (default: the larger of --limit and "
        f"{SATURATED_QUEUE}x max_num_seqs, so that most of them queue; 0: all)",
    )
    p.add_argument("--max-len", type=int, default=1 << 30, help="cap prompt and output lengths")
    p.add_argument("--profile", type=Path, help="reuse this profile instead of profiling")
    p.add_argument("--quick", action="store_true", help="profile with a small grid (CPU, tests)")
    p.add_argument("--load-rate", type=float, help="rate scale of the load scenario")
    p.add_argument("--saturated-rate", type=float, help="rate scale of the saturated one")
    p.add_argument(
        "--what-if-rate",
        type=float,
        help="rate scale of the what-if scenario (default: 0.6x its settings' capacity)",
    )
    p.add_argument(
        "--what-if",
        default="--max-num-batched-tokens 4096 --max-num-seqs 64",
        help="engine options of the what-if scenario, on both sides",
    )
    p.add_argument("--scenarios", default="load,saturated,what-if")
    p.add_argument("--vocab", type=int, default=10_000, help="prompt ids below this")
    p.add_argument(
        "--processes",
        type=int,
        default=max(1, min(8, len(os.sched_getaffinity(0)) - 2)),
        help="client processes (default %(default)s: 8 at most, two CPUs left to the server; far"
        " above capacity 4 of them sent requests up to 145 ms late on a 16-CPU H200 host, 8 of"
        " them 9 ms)",
    )
    p.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="serve each scenario this many times (the engine's run-to-run spread)",
    )
    args = p.parse_args(argv)
    if args.repeat < 1:
        p.error(f"--repeat: must be >= 1, got {args.repeat}")
    for name in ("limit", "saturated_limit"):
        if (getattr(args, name) or 0) < 0:
            p.error(f"--{name.replace('_', '-')}: must be >= 0 (0: all), got {getattr(args, name)}")
    scenarios = args.scenarios.split(",")
    unknown = set(scenarios) - {"load", "saturated", "what-if"}
    if unknown:
        p.error(f"unknown scenarios {sorted(unknown)}")
    args.engine_args = engine_args
    args.out.mkdir(parents=True, exist_ok=True)
    profile = args.profile
    if profile is None:
        profile = args.out / "profile.json"
        command = [
            sys.executable,
            "-m",
            "nano_engine.cli",
            "profile",
            args.model,
            "--out",
            str(profile),
        ]
        command += ["--quick"] if args.quick else []
        print("==", " ".join(command[2:] + engine_args), flush=True)
        subprocess.run([*command, *engine_args], check=True)
    trace, count = capped_trace(args, args.out / "trace.csv", args.limit)
    traces = dict.fromkeys(scenarios, trace)
    counts = dict.fromkeys(scenarios, count)
    if "saturated" in scenarios:
        limit = saturated_limit(args.limit, args.saturated_limit, engine_args, profile)
        if limit != args.limit:
            path = args.out / "trace-saturated.csv"
            traces["saturated"], counts["saturated"] = capped_trace(args, path, limit)
    what_if = args.what_if.split()
    given = {"load": args.load_rate, "saturated": args.saturated_rate, "what-if": args.what_if_rate}

    def capacity_of(overrides: list[str], requests: Path) -> float:
        tag = "capacity" + ("-what-if" if overrides else "") + f"-{requests.stem}"
        x = capacity(profile, requests, args.out, overrides, tag)
        settings = " ".join(overrides) or "as profiled"
        print(
            f"== nano-sim's capacity ({settings}, {requests.name}): {x:.2f}x the trace's rate",
            flush=True,
        )
        return x

    try:
        rates = choose_rates(scenarios, given, what_if, capacity_of, traces)
    except ValueError as e:
        p.error(str(e))
    results = []
    for name in scenarios:
        overrides = what_if if name == "what-if" else []
        print(
            f"== {name}: {rates[name]:.2f}x the trace's rate, {counts[name]} requests "
            f"{' '.join(overrides)}",
            flush=True,
        )
        results.append(run_scenario(args, name, traces[name], rates[name], overrides, profile))
        notes = "\n\n".join(note(results[-1:]) for note in (device_note, host_note, client_note))
        print(table(results[-1:]) + "\n\n" + notes, flush=True)
    notes = (note(results) for note in (device_note, host_note, client_note))
    text = table(results) + "\n\n" + "\n\n".join(notes)
    (args.out / "fidelity.md").write_text(text + "\n")
    (args.out / "fidelity.json").write_text(json.dumps(nan_to_none(results), indent=2))
    print("\n" + text)
    missed = sum(not row["met"] for res in results for row in res["rows"])
    print(f"\n{missed} of {sum(len(r['rows']) for r in results)} metrics outside their targets")
    return 0


if __name__ == "__main__":
    sys.exit(main())
