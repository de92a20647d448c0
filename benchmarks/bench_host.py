"""The step loop's host time with the device work removed: the number that guards the loop's
overhead in code CI can see.

The engine runs as it does on a GPU with CUDA graphs and async scheduling (the scheduler, the
block manager, the step inputs, the sampler's inputs, the scheduler's update, output objects,
publishing to every request's stream), except that the model runner is a no-op that returns a
fixed token per sampled row as if a decode graph had drawn it. Reported: microseconds per
iteration of the loop, median over the steady decode steps, at 1, 32 and 256 running sequences,
and at 256 running with 1,000 more waiting.

    python benchmarks/bench_host.py [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from itertools import pairwise
from pathlib import Path

import torch

from nano_engine import LLM, SamplingParams
from nano_engine.model_runner import StepResult
from nano_engine.sampler import FusedRows

ROOT = Path(__file__).resolve().parents[1]
SCENARIOS = {"1 running": (1, 0), "32 running": (32, 0), "256 running": (256, 0)}
SCENARIOS["256 running, 1000 waiting"] = (256, 1000)


def no_device(llm: LLM, stamps: list[tuple[float, int, bool]]) -> None:
    """Replace the device work: every step's rows 'drawn' in a graph, token 7 each."""
    engine = llm.engine
    runner, sampler, scheduler = engine.runner, engine.sampler, engine.scheduler

    def execute(step, previous=None, sampling=None):
        stamps.append((time.perf_counter(), len(scheduler.waiting), step.num_prefills == 0))
        return StepResult(None, torch.full((len(step.logits_rows),), 7, dtype=torch.int64))

    runner.execute = execute
    runner.is_eager = lambda out: bool(out.prefills)
    sampler.fused = True  # the rows take the fused pass, as on a GPU

    def fused_rows(seqs, fused_rows=sampler.fused_rows):
        return fused_rows(seqs) or FusedRows([1.0] * len(seqs), [0] * len(seqs))

    sampler.fused_rows = fused_rows


def run(running: int, waiting: int, steps: int) -> float:
    """Median microseconds per decode iteration with ``waiting`` requests queued."""
    stamps: list[tuple[float, int, bool]] = []
    with LLM(
        str(ROOT / "benchmarks/configs/tiny-qwen3.json"),
        load_format="dummy",
        skip_tokenizer_init=True,
        device="cpu",
        max_num_seqs=running,
        max_num_batched_tokens=max(4096, 16 * running),
        num_kvcache_blocks=(running + waiting) * (-(-(16 + steps) // 16) + 1) + 64,
        max_model_len=1024,
    ) as llm:
        no_device(llm, stamps)
        prompts = [[1 + (i * 7 + j) % 1000 for j in range(16)] for i in range(running + waiting)]
        params = SamplingParams(temperature=0.8, max_tokens=steps, ignore_eos=True)
        llm.generate(prompts, params, use_tqdm=False)
    gaps = [
        b[0] - a[0]
        for a, b in pairwise(stamps)
        if a[2] and b[2] and a[1] >= waiting and b[1] >= waiting
    ]
    gaps = gaps[len(gaps) // 10 :]  # (past the first steps)
    return statistics.median(gaps) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200, help="decode steps per request")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    results = {}
    for name, (running, waiting) in SCENARIOS.items():
        results[name] = run(running, waiting, args.steps)
        print(f"{name:28} {results[name]:8.1f} us per iteration")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
