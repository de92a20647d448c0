"""The step loop's host time with the device work removed: the number that guards the loop's
overhead in code CI can see.

The engine runs as it does on a GPU with CUDA graphs and async scheduling (the scheduler, the
block manager, the step inputs, the sampler's inputs, the scheduler's update, output objects,
publishing to every request's stream), except that the model runner is a no-op that returns a
fixed token per sampled row as if a decode graph had drawn it. Reported: microseconds per
iteration of the loop, median over the steady decode steps, at 1, 32 and 256 running sequences,
at 256 running with 1,000 more waiting, and at 256 streamed as the server's engine process
streams them (``ReplicaCore``: every step's outputs onto the core's queue, and a thread that
collects them and sends them down a pipe to another process, as ``nano-engine serve`` does).

    python benchmarks/bench_host.py [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import threading
import time
from itertools import pairwise
from pathlib import Path

import torch

from nano_engine import LLM, SamplingParams
from nano_engine.config import EngineConfig
from nano_engine.data_parallel.replica import STATS_PERIOD, ReplicaCore, RequestSpec
from nano_engine.model_runner import StepResult
from nano_engine.sampler import FusedRows

ROOT = Path(__file__).resolve().parents[1]
SCENARIOS = {"1 running": (1, 0), "32 running": (32, 0), "256 running": (256, 0)}
SCENARIOS["256 running, 1000 waiting"] = (256, 1000)
STREAMED = "256 streamed (engine process)"


def no_device(engine, stamps: list[tuple[float, int, bool]]) -> None:
    """Replace ``engine``'s device work: every step's rows 'drawn' in a graph, token 7 each."""
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


def settings(running: int, waiting: int, steps: int) -> dict:
    return dict(
        load_format="dummy",
        skip_tokenizer_init=True,
        device="cpu",
        max_num_seqs=running,
        max_num_batched_tokens=max(4096, 16 * running),
        num_kvcache_blocks=(running + waiting) * (-(-(16 + steps) // 16) + 1) + 64,
        max_model_len=1024,
    )


def prompts(n: int) -> list[list[int]]:
    return [[1 + (i * 7 + j) % 1000 for j in range(16)] for i in range(n)]


def run(running: int, waiting: int, steps: int) -> float:
    """Median microseconds per decode iteration with ``waiting`` requests queued."""
    stamps: list[tuple[float, int, bool]] = []
    model = str(ROOT / "benchmarks/configs/tiny-qwen3.json")
    with LLM(model, **settings(running, waiting, steps)) as llm:
        no_device(llm.engine, stamps)
        params = SamplingParams(temperature=0.8, max_tokens=steps, ignore_eos=True)
        llm.generate(prompts(running + waiting), params, use_tqdm=False)
    return steady(stamps, waiting)


def run_streamed(running: int, steps: int) -> float:
    """Median microseconds per decode iteration of ``running`` requests streamed by a
    replica's core, its outputs sent to another process as the replica's main thread does."""
    stamps: list[tuple[float, int, bool]] = []
    model = str(ROOT / "benchmarks/configs/tiny-qwen3.json")
    # (it tunes this whole interpreter for serving, as in the engine's process: the last
    # scenario)
    core = ReplicaCore(EngineConfig.from_kwargs(model, **settings(running, 0, steps)), 0)
    context = mp.get_context("spawn")
    front, replica = context.Pipe(duplex=False)
    reader = context.Process(target=_drain, args=(front,), daemon=True)
    reader.start()
    front.close()
    done, failed = threading.Event(), []

    def send() -> None:  # (the replica process's main thread)
        try:
            while not done.is_set():
                replica.send(("batch", core.outputs(STATS_PERIOD)))
        except Exception as e:  # (the reader gone, a batch that does not pickle: said below)
            failed.append(e)

    sender = threading.Thread(target=send, daemon=True)
    try:
        no_device(core.engine, stamps)
        sender.start()
        params = SamplingParams(temperature=0.8, max_tokens=steps, ignore_eos=True)
        ids = prompts(running)
        core.submit([RequestSpec(f"r{i}", None, p, params, True, False) for i, p in enumerate(ids)])
        deadline = time.monotonic() + 600
        while len(stamps) < steps or core.engine.scheduler.has_unfinished():
            if time.monotonic() > deadline or failed:
                raise RuntimeError(f"the streamed requests did not finish: {failed or 'in 10 min'}")
            time.sleep(0.05)
    finally:
        done.set()
        sender.join(5)
        replica.close()
        reader.join(5)
        core.shutdown()
    return steady(stamps, 0)


def _drain(conn) -> None:
    """The front's end of the pipe: it reads every batch."""
    try:
        while True:
            conn.recv()
    except EOFError:
        pass


def steady(stamps: list[tuple[float, int, bool]], waiting: int) -> float:
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
        print(f"{name:30} {results[name]:8.1f} us per iteration", flush=True)
    results[STREAMED] = run_streamed(256, args.steps)
    print(f"{STREAMED:30} {results[STREAMED]:8.1f} us per iteration")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
