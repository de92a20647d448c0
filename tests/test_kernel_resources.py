"""benchmarks/kernel_resources.py still compiles what it reports: the prefill kernel's variants
and the decode kernel as the engine sets it up, for sm_90a through Triton's bundled ptxas (no
GPU), each within Hopper's limits."""

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


@pytest.mark.parametrize(
    "cache,batch,splits,stages,rows,cap",
    [("fp8", 256, 1, 3, 2, 128), ("fp8", 1, 16, 2, 2, 128), ("bf16", 256, 1, 2, 16, None)],
)
def test_the_decode_kernel_compiles_for_hopper_as_the_engine_sets_it_up(
    monkeypatch, cache, batch, splits, stages, rows, cap
):
    """Qwen3-0.6B's heads: the tile DecodeLaunches chooses for the cache and the batch, within
    Hopper's limits; at 256 sequences (one split) nothing spills under the register cap."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    bench = importlib.import_module("kernel_resources")
    r = bench.decode_resources(cache, batch)
    assert r["settings"]["splits"] == splits and r["settings"]["stages"] == stages, r
    assert r["settings"]["BLOCK_G"] == rows and r["settings"]["max_registers"] == cap, r
    assert 0 < r["registers"] <= (cap or 255) and 0 < r["shared_kib"] <= 227, r
    assert r["instructions"] > 100, r
    if splits == 1:
        assert r["spilled_bytes"] == 0, r
