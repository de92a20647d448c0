"""CPU time of the scheduler, and of simulating the Azure conversation trace.

1. One decode step with 256 running sequences: schedule() + update(), block manager included
   (a new block and a full-block hash every 16 tokens per sequence). Target <= 200 us.
2. The whole Azure LLM conversation trace (19,366 requests) through nano_scheduler.sim with the
   Qwen3-0.6B roofline on an H200. Target <= 60 s.

    python benchmarks/bench_scheduler.py [--trace PATH] [--skip-trace]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path

from nano_kvcache import BlockManager
from nano_scheduler import SamplingParams, Scheduler, SchedulerConfig, Sequence
from nano_scheduler.sim import GPU, ModelShape, RooflineCostModel, Simulator, load_azure_trace

ROOT = Path(__file__).resolve().parents[1]


def decode_step_us(num_seqs: int = 256, steps: int = 2000) -> list[float]:
    rng = random.Random(0)
    config = SchedulerConfig(
        max_num_seqs=num_seqs, max_num_batched_tokens=16384, max_model_len=8192
    )
    sched = Scheduler(config, BlockManager(num_blocks=num_seqs * 200, block_size=16))
    for i in range(num_seqs):
        prompt = [rng.randrange(32000) for _ in range(rng.randint(100, 1000))]
        sched.add(Sequence(i, prompt, SamplingParams(max_tokens=steps + 10, ignore_eos=True)))
    while any(len(s.token_ids) - s.num_computed_tokens > 1 for s in sched.running) or sched.waiting:
        out = sched.schedule()
        sched.update(out, [7] * len(out.sampling_seqs))
    times = []
    tokens = [7] * num_seqs
    for _ in range(steps):
        start = time.perf_counter()
        out = sched.schedule()
        sched.update(out, tokens)
        times.append((time.perf_counter() - start) * 1e6)
        assert len(out.decodes) == num_seqs
    return times


def simulate_trace(trace: Path) -> tuple[float, dict]:
    requests = load_azure_trace(trace)
    model = ModelShape.from_hf_config(ROOT / "benchmarks" / "configs" / "qwen3-0.6b.json")
    cost = RooflineCostModel(model, GPU.preset("h200"))
    config = SchedulerConfig(max_num_seqs=256, max_num_batched_tokens=16384, max_model_len=40960)
    start = time.perf_counter()
    result = Simulator(requests, cost, config, num_blocks=68_000, block_size=16).run()
    return time.perf_counter() - start, result.summary()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--trace", type=Path, default=ROOT.parent / "shared" / "traces" / "azure_llm_2023_conv.csv"
    )
    parser.add_argument("--skip-trace", action="store_true")
    args = parser.parse_args()
    times = decode_step_us()
    print("scheduler, 256 running decodes, block size 16")
    print(
        f"  schedule + update: median {statistics.median(times):7.1f} us, "
        f"p90 {statistics.quantiles(times, n=10)[-1]:7.1f} us  (target <= 200 us)"
    )
    if not args.skip_trace and not args.trace.is_file():
        print(f"simulator: no trace at {args.trace} (see ../shared/traces); skipped")
    elif not args.skip_trace:
        seconds, summary = simulate_trace(args.trace)
        print(
            f"simulator, Azure conversation trace ({summary['requests']} requests, "
            f"{summary['steps']} steps, {summary['duration_s']:.0f} s simulated)"
        )
        print(f"  wall time {seconds:.1f} s  (target <= 60 s)")


if __name__ == "__main__":
    main()
