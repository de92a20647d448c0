"""Where a whole run of nano-vllm's benchmark spends the GPU's time.

Runs the benchmark's workload once to warm up and time it, then once more under torch.profiler
(CUDA kernels only, CUDA graphs included) with the per-step log, and prints: the GPU's busy and
idle time, kernel time by kind, and the decode attention kernels' effective bandwidth (KV bytes
read / kernel time) by batch size, from each step's 28 (num_layers) decode launches.

    python benchmarks/profile_run.py benchmarks/configs/qwen3-0.6b.json [--max-model-len 2048]
        [--tensor-parallel-size 2]   (rank 0's GPU; NCCL's kernels are the all-reduce kind)
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict

import torch

from nano_engine import LLM, SamplingParams
from nano_engine.cli import bench_workload

KINDS = [  # (kind, name fragments), first match wins
    ("all-reduce (NCCL)", ("nccl",)),
    ("sampler", ("_gumbel", "softmax", "argmax", "exponential", "sort")),
    ("attention decode", ("_decode_kernel", "_merge_kernel")),
    ("attention prefill", ("_prefill_kernel",)),
    ("matmul", ("gemm", "nvjet", "cutlass", "xmma", "splitK")),
    ("KV store", ("store_kvcache",)),
    ("norm/rotary/act (inductor)", ("triton_",)),
    ("copies", ("Memcpy", "Memset", "copy_", "fill")),
]


def kind_of(name: str) -> str:
    return next((k for k, frags in KINDS if any(f in name for f in frags)), "other")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--top", type=int, default=12, help="kernels listed by total time")
    parser.add_argument(
        "--tensor-parallel-size", type=int, default=1, help="(the profile is rank 0's GPU)"
    )
    args = parser.parse_args()
    rng, prompts, max_tokens = bench_workload(0, args.num_seqs, (100, 1024), (100, 1024))
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=n) for n in max_tokens]
    llm = LLM(
        args.model,
        load_format="dummy",
        skip_tokenizer_init=True,
        max_model_len=args.max_model_len,
        tensor_parallel_size=args.tensor_parallel_size,
    )
    engine = llm.engine
    warm = [[rng.randint(0, 10_000) for _ in range(rng.randint(1, 300))] for _ in range(64)]
    llm.generate(warm, SamplingParams(max_tokens=24, ignore_eos=True), use_tqdm=False)
    llm.reset_prefix_cache()  # both runs compute their prompts, as a single run would
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    plain = time.perf_counter() - start

    llm.reset_prefix_cache()
    recorder = engine.record_steps()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        torch.cuda.synchronize()
        profiled = time.perf_counter() - start
    engine.stop_recording()
    steps = [r for r in recorder.steps if r.num_tokens]
    kv_token_bytes = engine.runner.layout.bytes_per_block / engine.config.kvcache_block_size
    num_layers = engine.model_config.num_hidden_layers
    llm.shutdown()

    events = [
        e
        for e in prof.profiler.kineto_results.events()
        if e.device_type() == torch.autograd.DeviceType.CUDA and e.duration_ns() > 0
    ]
    events.sort(key=lambda e: e.start_ns())
    busy, cursor, previous = 0, events[0].start_ns(), events[0].name()
    gaps = defaultdict(float)  # idle time between kernels, by the length of the gap
    long_gaps = []  # (seconds, offset into the run, the kernels before and after)
    for e in events:
        begin, end = max(e.start_ns(), cursor), e.start_ns() + e.duration_ns()
        if e.start_ns() > cursor:
            gap = e.start_ns() - cursor
            gaps[next(b for b in (5e3, 50e3, 500e3, float("inf")) if gap < b)] += gap / 1e9
            if gap >= 500e3:
                offset = (cursor - events[0].start_ns()) / 1e9
                long_gaps.append((gap / 1e9, offset, previous, e.name()))
        previous = e.name() if end > cursor else previous
        busy += max(0, end - begin)
        cursor = max(cursor, end)
    span = (events[-1].start_ns() + events[-1].duration_ns() - events[0].start_ns()) / 1e9
    by_kind, by_name = defaultdict(float), defaultdict(lambda: [0.0, 0])
    for e in events:
        by_kind[kind_of(e.name())] += e.duration_ns() / 1e9
        by_name[e.name()][0] += e.duration_ns() / 1e9
        by_name[e.name()][1] += 1
    print(f"run: {plain:.2f} s unprofiled, {profiled:.2f} s profiled; {len(steps)} steps")
    print(
        f"GPU kernels and copies: busy {busy / 1e9:.2f} s of {span:.2f} s "
        f"({busy / 1e9 / span:.0%}), idle {span - busy / 1e9:.2f} s "
        f"({(span - busy / 1e9) / len(steps) * 1e3:.3f} ms per step)"
    )
    print(
        "idle gaps: "
        + ", ".join(
            f"under {b / 1e3:.0f} us {gaps[b]:.2f} s"
            if b != float("inf")
            else f"longer {gaps[b]:.2f} s"
            for b in (5e3, 50e3, 500e3, float("inf"))
        )
    )
    if long_gaps:
        print(f"{len(long_gaps)} gaps of 0.5 ms or more; the longest:")
        for gap, offset, before, after in sorted(long_gaps, reverse=True)[:8]:
            print(f"  {gap * 1e3:7.2f} ms at {offset:6.3f} s: {before[:40]} -> {after[:40]}")
        tenths = defaultdict(float)
        for gap, offset, _, _ in long_gaps:
            tenths[min(9, int(offset / span * 10))] += gap
        print("  by tenth of the run (s): " + " ".join(f"{tenths[i]:.3f}" for i in range(10)))
    print(f"{'kind':32} {'seconds':>8} {'share':>6}")
    total = sum(by_kind.values())
    for kind, seconds in sorted(by_kind.items(), key=lambda kv: -kv[1]):
        print(f"{kind:32} {seconds:8.3f} {seconds / total:6.1%}")
    print(f"\n{'kernel (top by time)':60} {'kind':12} {'seconds':>8} {'count':>7}")
    for name, (seconds, count) in sorted(by_name.items(), key=lambda kv: -kv[1][0])[: args.top]:
        print(f"{name[:60]:60} {kind_of(name)[:12]:12} {seconds:8.3f} {count:7d}")

    # Each step with decodes launches the decode kernel once per layer, in step order.
    decode = [e.duration_ns() / 1e9 for e in events if "_decode_kernel" in e.name()]
    with_decodes = [s for s in steps if s.decodes[0]]
    if len(decode) != num_layers * len(with_decodes):
        print(f"\n{len(decode)} decode launches for {len(with_decodes)} steps: no per-step view")
        return
    buckets = defaultdict(lambda: [0.0, 0.0, 0])  # batch bucket -> seconds, bytes, steps
    for i, step in enumerate(with_decodes):
        seconds = sum(decode[i * num_layers : (i + 1) * num_layers])
        bucket = 1 << (step.decodes[0] - 1).bit_length()
        entry = buckets[bucket]
        entry[0] += seconds
        entry[1] += step.decodes[1] * kv_token_bytes
        entry[2] += 1
    print(f"\n{'decodes per step (up to)':>24} {'steps':>6} {'kernel s':>9} {'TB/s':>6}")
    for bucket in sorted(buckets):
        seconds, nbytes, count = buckets[bucket]
        print(f"{bucket:>24} {count:6d} {seconds:9.3f} {nbytes / seconds / 1e12:6.2f}")
    seconds = sum(b[0] for b in buckets.values())
    nbytes = sum(b[1] for b in buckets.values())
    print(f"{'all':>24} {len(with_decodes):6d} {seconds:9.3f} {nbytes / seconds / 1e12:6.2f}")


if __name__ == "__main__":
    main()
