"""benchmarks/bench_host.py, the loop's host time with the device work removed (the number
that guards the loop's overhead), still drives the engine as it serves: its no-op runner takes
the runner's place (the step's launch, the fused draw's rows), requests finish, and the
streamed scenario's outputs go through a replica's core to another process."""

from __future__ import annotations

import gc
import importlib
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def bench_host(monkeypatch):
    # (on the path, not loaded from its file: the streamed scenario's reader process, spawned,
    # imports it by name)
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    return importlib.import_module("bench_host")


def test_the_host_benchmark_times_steady_decode_steps(monkeypatch):
    bench = bench_host(monkeypatch)
    for running, waiting in ((1, 0), (4, 6)):
        us = bench.run(running, waiting, 24)
        assert math.isfinite(us) and us > 0, (running, waiting, us)


def test_the_streamed_scenario_finishes_through_a_replica_core(monkeypatch):
    bench = bench_host(monkeypatch)
    # (a replica's core tunes the interpreter for serving: as it was for the tests after this)
    interval, thresholds = sys.getswitchinterval(), gc.get_threshold()
    try:
        us = bench.run_streamed(4, 24)  # (raises unless every request finished)
    finally:
        sys.setswitchinterval(interval)
        gc.set_threshold(*thresholds)
    assert math.isfinite(us) and us > 0
