"""Where the step loop's time goes, per phase, for the workloads of the low-overhead loop's
targets (Qwen3-0.6B config, dummy weights, temperature 0.6, as nano-vllm's benchmark):

  bs1       1 sequence, 128 in / 1024 out          bs32   32 sequences, 128 in / 1024 out
  nanovllm  256 sequences, 100-1024 in and out     prefill 768 requests, 32-4096 in / 4-256 out

For each: throughput of a run without the step log, then the same run with it, and the mean
microseconds per iteration of each host phase (schedule, launch, wait, post, sample, publish)
for CUDA-graph decode iterations and eager ones, with the device's forward and sampling time.
``--ops``: torch.profiler's CPU view of a few bs1 / bs32 decode steps (top ops by self time
and the CUDA launches per step). ``--syncs``: every host-device synchronization the loop makes
in a prefill-heavy run (torch.cuda.set_sync_debug_mode), by call site.

    python benchmarks/profile_loop.py [--workloads bs1,bs32,nanovllm,prefill] [--ops] [--syncs]
        [--model benchmarks/configs/qwen3-0.6b.json] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import traceback
import warnings
from collections import Counter
from pathlib import Path

import torch

from nano_engine import LLM, SamplingParams
from nano_engine.cli import bench_workload
from nano_scheduler.sim.profile import HOST_PHASES

ROOT = Path(__file__).resolve().parents[1]
WORKLOADS = {  # name: (requests, input range, output range)
    "bs1": (1, (128, 128), (1024, 1024)),
    "bs32": (32, (128, 128), (1024, 1024)),
    "nanovllm": (256, (100, 1024), (100, 1024)),
    "prefill": (768, (32, 4096), (4, 256)),
}


def workload(name: str, vocab: int) -> tuple[list[list[int]], list[SamplingParams]]:
    n, input_len, output_len = WORKLOADS[name]
    _, prompts, max_tokens = bench_workload(0, n, input_len, output_len)
    prompts = [[t % vocab for t in p] for p in prompts]
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=m) for m in max_tokens]
    return prompts, params


def run(llm: LLM, prompts, params, record: bool) -> tuple[float, list]:
    engine = llm.engine
    llm.reset_prefix_cache()
    engine.stats.__init__()
    recorder = engine.record_steps() if record else None
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    engine.stop_recording()
    return seconds, recorder.steps if recorder else []


def phases(steps) -> dict:
    """Mean microseconds per iteration of each phase, by kind of iteration."""
    table = {}
    for kind, chosen in (
        ("graph", [s for s in steps if not s.eager and s.decodes[0]]),
        ("eager", [s for s in steps if s.eager]),
    ):
        if not chosen:
            continue
        row = {"iterations": len(chosen)}
        for name in (*HOST_PHASES, "wait"):
            row[name] = 1e6 * statistics.fmean(getattr(s, name) for s in chosen)
        row["host"] = sum(row[p] for p in HOST_PHASES)
        for name in ("forward", "sample_device"):
            values = [getattr(s, name) for s in chosen if getattr(s, name) is not None]
            row[name] = 1e6 * statistics.fmean(values) if values else None
        row["batch"] = statistics.fmean(s.decodes[0] + len(s.prefills) for s in chosen)
        row["tokens"] = statistics.fmean(
            s.decodes[0] + sum(p[0] for p in s.prefills) for s in chosen
        )
        table[kind] = row
    return table


def profile_ops(llm: LLM, name: str, prompts, params, steps: int) -> dict:
    """torch.profiler's CPU view of the loop thread (ops by self time) over a run."""
    from torch._C._profiler import _ExperimentalConfig
    from torch.profiler import ProfilerActivity, profile

    llm.generate(prompts, params, use_tqdm=False)  # warm
    config = _ExperimentalConfig(profile_all_threads=True)
    with profile(activities=[ProfilerActivity.CPU], experimental_config=config) as prof:
        llm.generate(prompts, params, use_tqdm=False)
    rows = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
    launches = sum(
        e.count
        for e in prof.key_averages()
        if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaGraphLaunch")
        or e.key.startswith("cudaMemcpy")
    )
    top = [
        {"op": e.key, "count": e.count, "self_us_per_step": e.self_cpu_time_total / steps}
        for e in rows[:30]
    ]
    print(f"\n== torch.profiler, {name}, {steps} steps: {launches / steps:.1f} launches/step")
    for r in top:
        print(f"{r['self_us_per_step']:9.1f} us/step  {r['count']:6d}  {r['op']}")
    return {"launches_per_step": launches / steps, "top": top}


def time_pieces(llm: LLM, prompts, params) -> dict:
    """Host milliseconds per eager and per graph iteration in each piece of the loop's work
    (inclusive, nested pieces counted in their parents too), timed in place."""
    from nano_engine.engine import LLMEngine
    from nano_engine.model_runner import ModelRunner
    from nano_engine.sampler import Sampler
    from nano_models.layers.linear import LinearBase
    from nano_models.layers.norm import RMSNorm
    from nano_models.layers.rotary import RotaryEmbedding
    from nano_scheduler import Scheduler

    model = type(llm.engine.runner.model)
    backend = type(llm.engine.runner.backend)
    targets = [
        (LLMEngine, "_step"),
        (Scheduler, "schedule"),
        (ModelRunner, "execute"),
        (ModelRunner, "tensors"),
        (model, "forward"),
        (model, "compute_logits"),
        (LinearBase, "forward"),
        (backend, "forward"),
        (RotaryEmbedding, "split_qkv"),
        (RMSNorm, "forward"),
        (Sampler, "prepare"),
        (Sampler, "sample"),
        (LLMEngine, "_resolve"),
        (LLMEngine, "_output"),
    ]
    totals: dict[str, list[float]] = {}
    kind = ["graph"]
    originals = []

    def wrap(cls, name):
        fn = getattr(cls, name)
        key = f"{cls.__name__}.{name}"

        def timed(*a, **k):
            start = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                row = totals.setdefault(f"{kind[0]}:{key}", [0.0, 0])
                row[0] += time.perf_counter() - start
                row[1] += 1

        originals.append((cls, name, fn))
        setattr(cls, name, timed)

    execute = ModelRunner.execute

    def classify(self, step, previous=None):
        eager = self.graphs is None or step.num_prefills > 0 or not self.graphs.fits(step)
        kind[0] = "eager" if eager else "graph"
        return execute(self, step, previous)

    ModelRunner.execute = classify
    for cls, name in targets:
        wrap(cls, name)
    try:
        llm.generate(prompts, params, use_tqdm=False)
    finally:
        for cls, name, fn in reversed(originals):
            setattr(cls, name, fn)
        ModelRunner.execute = execute
    steps = {k: totals.get(f"{k}:ModelRunner.execute", [0, 0])[1] for k in ("eager", "graph")}
    print("\n== host ms per iteration, by piece (inclusive)")
    out = {}
    for key, (seconds, calls) in sorted(totals.items()):
        k = key.split(":")[0]
        per = seconds / max(steps[k], 1) * 1e3
        out[key] = {"ms_per_iteration": per, "calls": calls}
        print(f"{per:9.3f} ms  {calls:7d} calls  {key}")
    return out


def replay_host_time(llm: LLM) -> dict:
    """Host microseconds of one cudaGraphLaunch of each captured decode graph."""
    graphs = llm.engine.runner.graphs
    out = {}
    for size, (graph, _, _) in graphs.graphs.items():
        graph.replay()
        torch.cuda.synchronize()
        host = 0.0
        for _ in range(20):
            start = time.perf_counter()
            graph.replay()
            host += time.perf_counter() - start
            torch.cuda.synchronize()
        out[size] = host / 20 * 1e6
    print("graph replay host us:", {k: round(v, 1) for k, v in out.items()})
    return out


def find_syncs(llm: LLM, prompts, params) -> list:
    """Call sites of the loop's synchronizations (the warnings sync debug mode raises)."""
    sites: Counter = Counter()
    show = warnings.showwarning

    def record(message, category, filename, lineno, file=None, line=None):
        stack = [f for f in traceback.extract_stack()[:-1] if "warnings" not in f.filename]
        ours = [f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in stack[-6:]]
        sites[f"{str(message)[:60]} <- " + " <- ".join(reversed(ours))] += 1

    warnings.showwarning = record
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = record
            llm.generate(prompts, params, use_tqdm=False)
    finally:
        torch.cuda.set_sync_debug_mode("default")
        warnings.showwarning = show
    print("\n== synchronizations in the prefill-heavy run")
    for site, count in sites.most_common(20):
        print(f"{count:6d}  {site}")
    return [{"site": s, "count": c} for s, c in sites.most_common(20)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(ROOT / "benchmarks/configs/qwen3-0.6b.json"))
    parser.add_argument("--workloads", default="bs1,bs32,nanovllm,prefill")
    parser.add_argument("--max-model-len", type=int, default=4608)
    parser.add_argument("--ops", action="store_true", help="torch.profiler at batch 1 and 32")
    parser.add_argument("--syncs", action="store_true", help="find the prefill steps' syncs")
    parser.add_argument("--pieces", action="store_true", help="time the loop's pieces")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    llm = LLM(
        args.model, load_format="dummy", skip_tokenizer_init=True, max_model_len=args.max_model_len
    )
    vocab = llm.engine.model_config.vocab_size
    warm_prompts, _ = workload("nanovllm", vocab)
    llm.generate(warm_prompts[:64], [SamplingParams(max_tokens=24, ignore_eos=True)] * 64)
    results = {}
    for name in args.workloads.split(","):
        prompts, params = workload(name, vocab)
        seconds = min(run(llm, prompts, params, record=False)[0] for _ in range(2))
        host_share = llm.engine.stats.host_share
        _, steps = run(llm, prompts, params, record=True)
        inputs = sum(len(p) for p in prompts)
        outputs = sum(p.max_tokens for p in params)
        result = {
            "seconds": seconds,
            "output_tok_per_s": outputs / seconds,
            "input_tok_per_s": inputs / seconds,
            "host_share": host_share,
            "iterations": len(steps),
            "phases_us": phases(steps),
        }
        results[name] = result
        print(
            f"\n== {name}: {outputs / seconds:,.0f} output tok/s, {inputs / seconds:,.0f} input "
            f"tok/s, {seconds:.2f} s, host share {host_share:.0%}"
        )
        for kind, row in result["phases_us"].items():
            print(
                f"  {kind}: " + ", ".join(f"{k} {v:.1f}" for k, v in row.items() if v is not None)
            )
    if args.ops:
        results["ops"] = {}
        for b in (1, 32):
            prompts = [[1 + i] * 128 for i in range(b)]
            params = SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=32)
            results["ops"][f"bs{b}"] = profile_ops(llm, f"batch {b}", prompts, params, 32)
        prompts, params = workload("prefill", vocab)
        params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=1)] * 16
        results["ops"]["prefill"] = profile_ops(llm, "16 prompts", prompts[:16], params, 4)
        results["replay_us"] = replay_host_time(llm)
        stats = torch.cuda.memory_stats()
        results["allocator"] = {
            k: stats.get(k)
            for k in (
                "num_alloc_retries",
                "num_device_alloc",
                "num_device_free",
                "num_sync_all_streams",
            )
        }
        print("allocator:", results["allocator"])
    if args.pieces:
        for name in ("bs32", "prefill"):
            prompts, params = workload(name, vocab)
            if name == "bs32":
                params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=128)] * 32
            results[f"pieces_{name}"] = time_pieces(llm, prompts, params)
    if args.syncs:
        prompts, params = workload("prefill", vocab)
        results["syncs"] = find_syncs(llm, prompts[:96], params[:96])
    llm.shutdown()
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
