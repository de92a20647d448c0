"""benchmarks/sweep_decode.py (the decode kernel's tile sweep) runs every variant and compares
each to the default: on the CPU under Triton's interpreter (``TRITON_INTERPRET=1``, as the
kernels' other CPU runs; marked gpu with them), tiny shapes, GQA 3 and MHA; a malformed
variant is refused before anything runs, and the closing summary names each case's fastest
variant (CPU)."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.gpu
@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="runs under TRITON_INTERPRET=1"
)
def test_the_sweep_runs_each_variant_against_the_default(tmp_path):
    out = tmp_path / "sweep.json"
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    command = [sys.executable, str(ROOT / "benchmarks" / "sweep_decode.py"), "--smoke"]
    command += ["--cache", "fp8", "--rounds", "1", "--json", str(out)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(out.read_text())
    variants = {r["variant"] for r in rows}
    assert {"auto/64/4/auto/auto", "16/64/4/2/auto", "1/64/4/3/auto"} <= variants
    assert len(variants) == 8
    assert {r["case"] for r in rows} == {"tiny gqa 3", "tiny mha"}
    assert all(r["error"] <= 1e-2 for r in rows)


def test_a_malformed_variant_is_refused_by_name(monkeypatch):
    # The command line refuses it before anything runs (exit 2, the reason on stderr)...
    command = [sys.executable, str(ROOT / "benchmarks" / "sweep_decode.py"), "--smoke"]
    done = subprocess.run(
        [*command, "--variants", "1/auto/4/2/0"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2 and "only rows, stages and registers may be auto" in done.stderr
    # ... through the variants' parser, each malformed kind by its own reason
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    sweep_decode = importlib.import_module("sweep_decode")
    for bad, why in [
        ("1/64/4/2", "rows/tokens/warps/stages/registers"),
        ("1/auto/4/2/0", "only rows, stages and registers may be auto"),
        ("3/64/4/2/0", "powers of two"),
        ("1/64/4/0/0", "stages >= 1"),
        ("1/64/4/2/-1", "registers >= 0"),
        ("1/64/x/2/0", "integers or auto"),
    ]:
        with pytest.raises(argparse.ArgumentTypeError, match=re.escape(why)):
            sweep_decode.variant_of(bad)
    assert sweep_decode.variant_of("auto/64/4/auto/auto") == (None, 64, 4, None, None)
    assert sweep_decode.variant_of("1/32/8/2/0") == (1, 32, 8, 2, 0)


def test_the_summary_names_each_cases_fastest_variant_against_the_default(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    sweep_decode = importlib.import_module("sweep_decode")
    rows = [
        {"cache": "fp8", "case": "a", "variant": "auto/64/4/auto/auto", "us": 10.0},
        {"cache": "fp8", "case": "a", "variant": "1/64/4/3/auto", "us": 9.5},
        {"cache": "fp8", "case": "a", "variant": "1/64/4/3/auto", "us": 8.0},  # (a 2nd round)
        {"cache": "fp8", "case": "b", "variant": "auto/64/4/auto/auto", "us": 4.0},
        {"cache": "fp8", "case": "b", "variant": "1/64/4/3/auto", "us": 5.0},
    ]
    a, b = sweep_decode.best(rows)
    assert "fastest 1/64/4/3/auto 8.0 us (-20.0%)" in a
    assert "default auto/64/4/auto/auto 4.0 us, fastest auto/64/4/auto/auto 4.0 us (+0.0%)" in b
