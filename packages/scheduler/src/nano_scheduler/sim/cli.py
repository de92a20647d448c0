"""nano-sim: simulate serving a workload with the real scheduler on a virtual clock."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from nano_scheduler.config import SchedulerConfig
from nano_scheduler.sim.cost_model import GPU, FittedCostModel, ModelShape, RooflineCostModel
from nano_scheduler.sim.metrics import format_summary
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

    m = p.add_argument_group("model and GPU")
    m.add_argument(
        "--model-config",
        type=Path,
        required=True,
        help="a Hugging Face config.json, or the directory holding it",
    )
    m.add_argument("--gpu", default="h200", help="GPU preset (h200, h100, a100)")
    m.add_argument("--bandwidth", type=float, help="memory bandwidth in TB/s (overrides --gpu)")
    m.add_argument("--tflops", type=float, help="dense bf16 TFLOP/s (overrides --gpu)")
    m.add_argument("--gpu-memory", type=float, help="GPU memory in GB (overrides --gpu)")
    m.add_argument(
        "--step-overhead-ms",
        type=float,
        default=0.0,
        help="fixed time added to every step (CPU, launches)",
    )
    m.add_argument(
        "--fitted",
        type=Path,
        help="a fitted cost model JSON (coefficients or measured samples) instead of the roofline",
    )

    s = p.add_argument_group("engine")
    s.add_argument("--block-size", type=int, default=16)
    s.add_argument("--num-blocks", type=int, help="KV blocks (default: from GPU memory)")
    s.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    s.add_argument("--max-num-seqs", type=int, default=256)
    s.add_argument("--max-num-batched-tokens", type=int, default=16384)
    s.add_argument("--max-model-len", type=int, help="default: the model's max positions")
    s.add_argument("--policy", default="decode_first", choices=("decode_first", "prefill_first"))
    s.add_argument("--no-chunked-prefill", action="store_true")
    s.add_argument("--no-prefix-caching", action="store_true")
    s.add_argument("--admission-lookahead", type=int, default=16)
    s.add_argument("--watermark", type=float, default=0.01)

    o = p.add_argument_group("output")
    o.add_argument("--json", type=Path, help="write the summary and timeline as JSON")
    o.add_argument("--plot", type=Path, help="write latency CDFs and usage over time (PNG)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        return _run(args)
    except (ValueError, OSError) as e:
        print(f"nano-sim: error: {e}", file=sys.stderr)
        return 2


def _check(args: argparse.Namespace) -> None:
    """Values out of range and options that the chosen workload or cost model would ignore."""
    for name in ("bandwidth", "tflops", "gpu_memory", "rate", "rate_scale"):
        value = getattr(args, name)
        if value is not None and not value > 0:
            raise ValueError(f"--{name.replace('_', '-')} must be > 0, got {value}")
    if args.step_overhead_ms < 0:
        raise ValueError(f"--step-overhead-ms must be >= 0, got {args.step_overhead_ms}")
    for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "num_blocks"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    problems = []
    if args.fitted:
        fitted = {"--bandwidth": args.bandwidth is not None, "--tflops": args.tflops is not None}
        fitted["--step-overhead-ms"] = args.step_overhead_ms != 0
        problems += [f"{flag} would be ignored with --fitted" for flag, on in fitted.items() if on]
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


def _run(args: argparse.Namespace) -> int:
    _check(args)
    config_path = args.model_config
    if config_path.is_dir():
        config_path = config_path / "config.json"
    hf_config = json.loads(config_path.read_text())
    model = ModelShape.from_hf_config(hf_config)
    gpu = GPU.preset(args.gpu)
    gpu = GPU(
        gpu.name,
        args.bandwidth * 1e12 if args.bandwidth is not None else gpu.mem_bandwidth,
        args.tflops * 1e12 if args.tflops is not None else gpu.flops,
        args.gpu_memory * 1e9 if args.gpu_memory is not None else gpu.memory,
    )
    if args.fitted:
        cost = FittedCostModel.from_json(args.fitted)
    else:
        cost = RooflineCostModel(model, gpu, args.step_overhead_ms / 1e3)

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

    num_blocks = args.num_blocks
    if num_blocks is None:
        free = gpu.memory * args.gpu_memory_utilization - model.weight_bytes
        num_blocks = int(free // (model.kv_bytes_per_token * args.block_size))
        if num_blocks < 1:
            raise ValueError(f"the weights ({model.weight_bytes / 1e9:.1f} GB) leave no KV memory")
    max_model_len = args.max_model_len or hf_config.get("max_position_embeddings", 4096)
    sched_config = SchedulerConfig(
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=max_model_len,
        enable_chunked_prefill=not args.no_chunked_prefill,
        policy=args.policy,
        admission_lookahead=args.admission_lookahead,
        watermark=args.watermark,
    )
    sim = Simulator(
        requests,
        cost,
        sched_config,
        num_blocks,
        args.block_size,
        not args.no_prefix_caching,
        args.seed,
    )
    print(
        f"simulating {len(requests)} requests on {gpu.name} ({gpu.mem_bandwidth / 1e12:.2f} "
        f"TB/s, {gpu.flops / 1e12:.0f} TFLOP/s), {num_blocks} KV blocks of {args.block_size} "
        f"tokens ({num_blocks * args.block_size:,} tokens)",
        flush=True,
    )
    start = time.perf_counter()
    result = sim.run()
    print(format_summary(result.summary()))
    print(f"(simulated in {time.perf_counter() - start:.1f} s)")
    if args.json:
        result.to_json(args.json)
    if args.plot:
        result.plot(args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
