"""nano-sim: simulate serving a workload with the real scheduler on a virtual clock."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path

from nano_scheduler.config import POLICIES, SchedulerConfig
from nano_scheduler.router import ROUTERS
from nano_scheduler.sim.cost_model import GPU, FittedCostModel, ModelShape, RooflineCostModel
from nano_scheduler.sim.fleet import FleetSimulator
from nano_scheduler.sim.metrics import SimResult, format_summary
from nano_scheduler.sim.profile import SAMPLING_KINDS, Profile
from nano_scheduler.sim.profiled import ProfiledCostModel
from nano_scheduler.sim.simulator import Simulator
from nano_scheduler.sim.workload import (
    load_azure_trace,
    nano_vllm_bench,
    scale_arrivals,
    synthetic,
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="nano-sim", description=__doc__)
    w = p.add_argument_group("workload")
    src = w.add_mutually_exclusive_group(required=True)
    src.add_argument(
        "--trace", type=Path, help="Azure LLM trace CSV (TIMESTAMP, ContextTokens, GeneratedTokens)"
    )
    src.add_argument("--synthetic", type=int, metavar="N", help="N synthetic requests")
    src.add_argument(
        "--nano-vllm-bench",
        action="store_true",
        help="nano-vllm's benchmark: 256 requests, 100-1024 in and out, all at t=0",
    )
    w.add_argument("--limit", type=int, help="only the first N requests of the trace")
    w.add_argument("--input-len", type=int, nargs=2, default=(100, 1024), metavar=("LO", "HI"))
    w.add_argument("--output-len", type=int, nargs=2, default=(100, 1024), metavar=("LO", "HI"))
    w.add_argument("--rate", type=float, help="Poisson arrivals per second (default: all at t=0)")
    w.add_argument(
        "--rate-scale",
        type=float,
        default=1.0,
        help="arrive this many times faster (traces and synthetic workloads)",
    )
    w.add_argument("--num-prefixes", type=int, default=0, help="shared-prefix groups")
    w.add_argument("--prefix-len", type=int, default=0, help="tokens shared within a group")
    w.add_argument("--seed", type=int, default=0)

    m = p.add_argument_group("cost model: a profile of the engine, or the model and GPU")
    m.add_argument(
        "--profile",
        type=Path,
        help="a profile from nano-engine profile: step times measured on the engine, and the "
        "engine's settings (the defaults of the engine options below)",
    )
    m.add_argument(
        "--frontend",
        choices=("server", "offline"),
        help="with --profile: requests through the HTTP server (default) or the Python API",
    )
    m.add_argument(
        "--sampling",
        choices=SAMPLING_KINDS,
        help="with --profile: the sampling the requests use (default greedy)",
    )
    m.add_argument(
        "--host-scale",
        type=float,
        help="with --profile: the host's time against when it was profiled, e.g. 1.2 for a "
        "CPU 20%% slower (every host cost of the profile times this, the device's times as "
        "they are, a CPU profile's forwards included; default 1)",
    )
    m.add_argument(
        "--model-config",
        type=Path,
        help="a Hugging Face config.json, or the directory holding it (required without "
        "--profile; with it, checked against the profiled model)",
    )
    m.add_argument("--gpu", help="GPU preset (h200, h100, a100; default h200)")
    m.add_argument("--bandwidth", type=float, help="memory bandwidth in TB/s (overrides --gpu)")
    m.add_argument("--tflops", type=float, help="dense bf16 TFLOP/s (overrides --gpu)")
    m.add_argument("--gpu-memory", type=float, help="GPU memory in GB (overrides --gpu)")
    m.add_argument(
        "--step-overhead-ms", type=float, help="fixed time added to every step (default 0)"
    )
    m.add_argument(
        "--fitted",
        type=Path,
        help="a fitted cost model JSON (coefficients or measured samples) instead of the roofline",
    )

    s = p.add_argument_group("engine (defaults: the profile's, else those shown)")
    s.add_argument("--block-size", type=int, help="tokens per KV block (16)")
    s.add_argument(
        "--num-blocks", type=int, help="KV blocks (without a profile: from the GPU's memory)"
    )
    s.add_argument("--gpu-memory-utilization", type=float, help="(0.9; without a profile)")
    s.add_argument(
        "--kv-cache-dtype",
        choices=("auto", "fp8"),
        help="the KV cache's (auto: the model's dtype; fp8: one byte a value; without a profile)",
    )
    s.add_argument("--max-num-seqs", type=int, help="(256)")
    s.add_argument("--max-num-batched-tokens", type=int, help="(16384)")
    s.add_argument("--max-model-len", type=int, help="(the model's max positions)")
    s.add_argument("--policy", choices=POLICIES, help="(decode_first)")
    s.add_argument(
        "--chunked-prefill", action=argparse.BooleanOptionalAction, help="(on)", default=None
    )
    s.add_argument(
        "--prefix-caching", action=argparse.BooleanOptionalAction, help="(on)", default=None
    )
    s.add_argument("--admission-lookahead", type=int, help="(16)")
    s.add_argument("--watermark", type=float, help="(0.01)")
    s.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="overlap each step's host work with the previous step on the device (on)",
    )

    f = p.add_argument_group("fleet: data-parallel replicas behind the server's router")
    f.add_argument("--replicas", type=int, help="engines of this configuration (1)")
    f.add_argument(
        "--router",
        choices=sorted(ROUTERS),
        help="how requests are spread over the replicas (least_tokens)",
    )
    f.add_argument(
        "--slo-ttft-p99",
        type=float,
        metavar="SECONDS",
        help="find the fewest replicas whose TTFT p99 is within this (with --slo-tpot-p99: both)",
    )
    f.add_argument(
        "--slo-tpot-p99",
        type=float,
        metavar="SECONDS",
        help="find the fewest replicas whose TPOT p99 is within this",
    )
    f.add_argument(
        "--max-replicas", type=int, default=64, help="the most replicas the search tries (64)"
    )

    o = p.add_argument_group("output")
    o.add_argument(
        "--json", type=Path, help="write the summary, per-request records and timeline as JSON"
    )
    o.add_argument("--plot", type=Path, help="write latency CDFs and usage over time (PNG)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        return _run(args)
    except (ValueError, OSError) as e:
        print(f"nano-sim: error: {e}", file=sys.stderr)
        return 2


# Engine options without a profile (with one, the profile's settings are the defaults).
DEFAULTS = {
    "block_size": 16,
    "gpu_memory_utilization": 0.9,
    "max_num_seqs": 256,
    "max_num_batched_tokens": 16384,
    "policy": "decode_first",
    "chunked_prefill": True,
    "prefix_caching": True,
    "admission_lookahead": 16,
    "watermark": 0.01,
    "async_scheduling": True,
}


def _check(args: argparse.Namespace) -> None:
    """Values out of range and options that the chosen workload or cost model would ignore."""
    for name in ("bandwidth", "tflops", "gpu_memory", "rate", "rate_scale", "host_scale"):
        value = getattr(args, name)
        if value is not None and not (value > 0 and math.isfinite(value)):
            raise ValueError(f"--{name.replace('_', '-')} must be > 0 and finite, got {value}")
    if args.step_overhead_ms is not None and args.step_overhead_ms < 0:
        raise ValueError(f"--step-overhead-ms must be >= 0, got {args.step_overhead_ms}")
    for name in ("slo_ttft_p99", "slo_tpot_p99"):
        value = getattr(args, name)
        if value is not None and not value > 0:
            raise ValueError(f"--{name.replace('_', '-')} must be > 0, got {value}")
    searching = args.slo_ttft_p99 is not None or args.slo_tpot_p99 is not None
    if searching and args.replicas is not None:
        raise ValueError("--replicas and an SLO (--slo-*) exclude each other: the SLO searches it")
    for name in (
        "block_size",
        "max_num_seqs",
        "max_num_batched_tokens",
        "num_blocks",
        "replicas",
        "max_replicas",
    ):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    problems = []
    roofline = {
        "--gpu": args.gpu,
        "--bandwidth": args.bandwidth,
        "--tflops": args.tflops,
        "--gpu-memory": args.gpu_memory,
        "--step-overhead-ms": args.step_overhead_ms,
    }
    if args.profile:
        measured = {**roofline, "--fitted": args.fitted}
        measured["--gpu-memory-utilization"] = args.gpu_memory_utilization
        measured["--kv-cache-dtype"] = args.kv_cache_dtype
        problems += [f"{f} would be ignored with --profile" for f, v in measured.items() if v]
    else:
        if args.model_config is None:
            raise ValueError("give --profile (from nano-engine profile), or --model-config")
        for flag, value in (
            ("--frontend", args.frontend),
            ("--sampling", args.sampling),
            ("--host-scale", args.host_scale),
        ):
            if value is not None:
                problems.append(f"{flag} needs --profile")
        if args.fitted:
            problems += [f"{f} would be ignored with --fitted" for f, v in roofline.items() if v]
    given = {  # the workload options, and whether each was set
        "--limit": args.limit is not None,
        "--rate": args.rate is not None,
        "--input-len": tuple(args.input_len) != (100, 1024),
        "--output-len": tuple(args.output_len) != (100, 1024),
        "--num-prefixes": args.num_prefixes != 0,
        "--prefix-len": args.prefix_len != 0,
    }
    source = "--trace" if args.trace else "--nano-vllm-bench" if args.nano_vllm_bench else None
    uses = {"--trace": {"--limit"}, "--nano-vllm-bench": set(), None: set(given) - {"--limit"}}
    problems += [
        f"{flag} would be ignored with {source or '--synthetic'}"
        for flag, on in given.items()
        if on and flag not in uses[source]
    ]
    if problems:
        raise ValueError("; ".join(problems))
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise ValueError("--plot needs matplotlib (pip install matplotlib)") from None


def _workload(args: argparse.Namespace) -> list:
    if args.trace:
        requests = load_azure_trace(args.trace, args.limit)
    elif args.nano_vllm_bench:
        requests = nano_vllm_bench(seed=args.seed)
    else:
        requests = synthetic(
            args.synthetic,
            tuple(args.input_len),
            tuple(args.output_len),
            args.rate,
            args.seed,
            args.num_prefixes,
            args.prefix_len,
        )
    if args.rate_scale != 1.0:
        requests = scale_arrivals(requests, args.rate_scale)
    return requests


def _setting(args: argparse.Namespace, name: str, profiled=None):
    """An engine option: as given, else the profile's, else the default."""
    value = getattr(args, name)
    if value is not None:
        return value
    return profiled if profiled is not None else DEFAULTS[name]


def _run(args: argparse.Namespace) -> int:
    _check(args)
    hf_config = None
    if args.model_config is not None:
        path = (
            args.model_config / "config.json" if args.model_config.is_dir() else args.model_config
        )
        try:
            hf_config = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not valid JSON ({e.msg} at line {e.lineno})") from None
    build = _from_profile if args.profile else _from_model
    make, headline = build(args, hf_config, _workload(args))
    print(headline, flush=True)
    start = time.perf_counter()
    if args.slo_ttft_p99 is not None or args.slo_tpot_p99 is not None:
        result = _search_replicas(args, make)
        if result is None:
            return 1
    else:
        result = make(args.replicas or 1).run()
    print(format_summary(result.summary()))
    print(f"(simulated in {time.perf_counter() - start:.1f} s)")
    if args.json:
        result.to_json(args.json)
    if args.plot:
        result.plot(args.plot)
    return 0


def _search_replicas(args: argparse.Namespace, make) -> SimResult | None:
    """The fewest replicas (up to --max-replicas) that meet the SLO: doubling until one does,
    then bisecting below it. Prints each try; None (and why) when even the most do not."""
    slo = {"ttft_s": args.slo_ttft_p99, "tpot_s": args.slo_tpot_p99}
    slo = {key: limit for key, limit in slo.items() if limit is not None}
    wanted = " and ".join(f"{k[:4].upper()} p99 <= {v * 1e3:g} ms" for k, v in slo.items())
    print(f"searching the fewest replicas with {wanted}")
    print(f"{'replicas':>8}  {'output tok/s':>12}  {'TTFT p99 ms':>11}  {'TPOT p99 ms':>11}  meets")
    tried: dict[int, tuple[bool, SimResult]] = {}

    def meets(replicas: int) -> bool:
        result = make(replicas, fleet=True)  # (one model for every count: the fleet's)
        result = result.run()
        s = result.summary()
        # (requests the scheduler refuses, too long for any replica, count for no count)
        ok = all(s[key]["p99"] <= limit for key, limit in slo.items())
        print(
            f"{replicas:>8}  {s['output_tok_per_s']:>12,.0f}  {s['ttft_s']['p99'] * 1e3:>11.1f}"
            f"  {s['tpot_s']['p99'] * 1e3:>11.1f}  {'yes' if ok else 'no'}",
            flush=True,
        )
        tried[replicas] = (ok, result)
        return ok

    low, high = 0, 1  # (low fails, high is tried next)
    while not meets(high):
        if high >= args.max_replicas:
            print(f"nano-sim: even {high} replicas miss {wanted} (--max-replicas)", file=sys.stderr)
            return None
        low, high = high, min(2 * high, args.max_replicas)
    while high - low > 1:
        middle = (low + high) // 2
        if meets(middle):
            high = middle
        else:
            low = middle
    print(f"fewest replicas with {wanted}: {high}")
    return tried[high][1]


def _fleet(args: argparse.Namespace, requests, **kwargs):
    """A function of the number of replicas: the simulator (one engine alone, or a fleet)."""

    def make(replicas: int, fleet: bool = False):
        if replicas == 1 and args.router is None and not fleet:
            return Simulator(requests, **kwargs)
        return FleetSimulator(
            requests, replicas=replicas, router=args.router or "least_tokens", **kwargs
        )

    return make


def scheduler_config(args, max_model_len: int, eng=None) -> SchedulerConfig:
    """The scheduler's settings from the options, the profile's engine (``eng``) as default.
    The engine raises the token budget to max_num_seqs (a decode each): so does this."""
    max_num_seqs = _setting(args, "max_num_seqs", eng and eng.max_num_seqs)
    budget = _setting(args, "max_num_batched_tokens", eng and eng.max_num_batched_tokens)
    return SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max(budget, max_num_seqs),
        max_model_len=max_model_len,
        enable_chunked_prefill=_setting(
            args, "chunked_prefill", eng and eng.enable_chunked_prefill
        ),
        policy=_setting(args, "policy", eng and eng.policy),
        admission_lookahead=_setting(args, "admission_lookahead", eng and eng.admission_lookahead),
        watermark=_setting(args, "watermark", eng and eng.watermark),
    )


def _from_profile(args, hf_config, requests) -> tuple[Callable, str]:
    profile = Profile.load(args.profile)
    if hf_config is not None:
        profile.check_model(hf_config)
    eng = profile.engine
    if args.block_size is not None and args.block_size != eng.block_size:
        raise ValueError(
            f"the profile was measured with KV blocks of {eng.block_size} tokens, not "
            f"{args.block_size} (the attention kernels' times depend on it): profile the engine "
            f"with --kvcache-block-size {args.block_size}"
        )
    config = scheduler_config(args, args.max_model_len or eng.max_model_len, eng)
    frontend = args.frontend or "server"
    cost = ProfiledCostModel(
        profile,
        frontend,
        args.sampling or "greedy",
        config.max_num_seqs,
        config.max_num_batched_tokens,
        1.0 if args.host_scale is None else args.host_scale,
    )
    num_blocks = args.num_blocks or eng.num_kv_blocks
    make = _fleet(
        args,
        requests,
        cost_model=cost,
        config=config,
        num_blocks=num_blocks,
        block_size=eng.block_size,
        enable_prefix_caching=_setting(args, "prefix_caching", eng.enable_prefix_caching),
        seed=args.seed,
        async_scheduling=_setting(args, "async_scheduling", eng.async_scheduling),
        server=cost.server_costs,
    )
    name = profile.meta.get("model_name", "the model")
    device = profile.device.get("name", profile.device.get("type", "a device"))
    headline = (
        f"simulating {len(requests)} requests with the profile of {name} on {device} "
        f"({frontend}), {num_blocks} KV blocks of {eng.block_size} tokens "
        f"({num_blocks * eng.block_size:,} tokens)"
    )
    return make, headline


def _from_model(args, hf_config, requests) -> tuple[Callable, str]:
    model = ModelShape.from_hf_config(hf_config)
    if args.kv_cache_dtype == "fp8":
        model = dataclasses.replace(model, kv_dtype_bytes=1)
    gpu = GPU.preset(args.gpu or "h200")
    gpu = GPU(
        gpu.name,
        args.bandwidth * 1e12 if args.bandwidth is not None else gpu.mem_bandwidth,
        args.tflops * 1e12 if args.tflops is not None else gpu.flops,
        args.gpu_memory * 1e9 if args.gpu_memory is not None else gpu.memory,
    )
    if args.fitted:
        cost = FittedCostModel.from_json(args.fitted)
    else:
        cost = RooflineCostModel(model, gpu, (args.step_overhead_ms or 0.0) / 1e3)
    block_size = _setting(args, "block_size")
    num_blocks = args.num_blocks
    if num_blocks is None:
        free = gpu.memory * _setting(args, "gpu_memory_utilization") - model.weight_bytes
        num_blocks = int(free // (model.kv_bytes_per_token * block_size))
        if num_blocks < 1:
            raise ValueError(f"the weights ({model.weight_bytes / 1e9:.1f} GB) leave no KV memory")
    max_model_len = args.max_model_len or hf_config.get("max_position_embeddings", 4096)
    make = _fleet(
        args,
        requests,
        cost_model=cost,
        config=scheduler_config(args, max_model_len),
        num_blocks=num_blocks,
        block_size=block_size,
        enable_prefix_caching=_setting(args, "prefix_caching"),
        seed=args.seed,
        async_scheduling=_setting(args, "async_scheduling"),
    )
    headline = (
        f"simulating {len(requests)} requests on {gpu.name} ({gpu.mem_bandwidth / 1e12:.2f} "
        f"TB/s, {gpu.flops / 1e12:.0f} TFLOP/s), {num_blocks} KV blocks of {block_size} "
        f"tokens ({num_blocks * block_size:,} tokens)"
    )
    return make, headline


if __name__ == "__main__":
    sys.exit(main())
