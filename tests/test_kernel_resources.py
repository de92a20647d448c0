"""benchmarks/kernel_resources.py still compiles what it reports: the prefill kernel's variants
for sm_90a through Triton's bundled ptxas (no GPU), each within Hopper's limits."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

pytest.importorskip("triton")
pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    "cache,tma,block_size", [("none", True, 16), ("pointers", False, 16), ("tma", True, 256)]
)
def test_the_prefill_variants_compile_for_hopper(monkeypatch, cache, tma, block_size):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    bench = importlib.import_module("kernel_resources")
    r = bench.resources((64, 64, 4, 2), cache, tma, block_size)
    assert 0 < r["registers"] <= 255, r
    assert 0 < r["shared_kib"] <= 227, r
    assert r["spilled_bytes"] >= 0, r
