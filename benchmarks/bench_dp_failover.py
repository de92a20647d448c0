"""Data-parallel replicas' life cycle on any machine: a fleet of two replicas of a tiny random
checkpoint (CPU by default) is started, one replica's process is killed while it streams a
request, and the fleet is shut down; for each backend (mp, ray), the start time, the time from
the kill to the request's error, and the shutdown time, over a few rounds.

    python benchmarks/bench_dp_failover.py [--rounds 3] [--backends mp ray] [--device cpu]
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import tempfile
import time

from nano_engine import LLM, EngineDeadError, SamplingParams
from nano_models.testing import build_checkpoint


def one_round(path: str, backend: str, device: str) -> tuple[float, float, float]:
    start = time.monotonic()
    llm = LLM(
        path, device=device, data_parallel_size=2, data_parallel_backend=backend, max_model_len=512
    )
    started = time.monotonic() - start
    prompt = [random.Random(0).randrange(3, 200) for _ in range(20)]
    stream = llm.engine.add_request(
        prompt, SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
    )
    stream.get(timeout=120)  # (streaming: its replica is busy with it)
    os.kill(llm.engine.replicas[stream.engine_index].info.pid, signal.SIGKILL)
    killed = time.monotonic()
    try:
        for _ in stream:
            pass
        raise RuntimeError("the killed replica's stream ended without an error")
    except EngineDeadError:
        detected = time.monotonic() - killed
    start = time.monotonic()
    llm.shutdown()
    return started, detected, time.monotonic() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--backends", nargs="+", default=["mp", "ray"], choices=["mp", "ray"])
    p.add_argument("--device", default="cpu")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = str(build_checkpoint(tmp, "qwen3"))
        for backend in args.backends:
            rounds = [one_round(path, backend, args.device) for _ in range(args.rounds)]
            start, detect, stop = zip(*rounds)
            print(
                f"{backend:>4}: start {', '.join(f'{s:.2f}' for s in start)} s; kill to error "
                f"{', '.join(f'{d * 1e3:.0f}' for d in detect)} ms; shutdown "
                f"{', '.join(f'{s:.2f}' for s in stop)} s",
                flush=True,
            )


if __name__ == "__main__":
    main()
