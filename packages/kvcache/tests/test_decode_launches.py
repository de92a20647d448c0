"""The decode launch's measured choices, worked out on the host (no kernel runs): the register
cap and the pipeline stages for the cache, the batch's splits and the tile."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from nano_kvcache.attention import decode  # noqa: E402


def launches(**kwargs) -> decode.DecodeLaunches:
    lens = torch.ones(4, dtype=torch.int32)
    return decode.DecodeLaunches(torch.zeros(4, 1, dtype=torch.int32), lens, **kwargs)


def test_the_register_cap_is_the_fp8_tiles_measured_one_or_what_was_asked():
    assert launches().registers(True, 128) == 128  # (FP8 tiles, head_dim 128, 64 x 4 warps)
    assert launches(num_stages=3).registers(True, 128) == 128  # (at any stage count)
    assert launches(num_stages=1).registers(True, 128) == 128
    assert launches().registers(False, 128) is None  # (16-bit caches: the compiler's choice)
    assert launches().registers(True, 64) is None  # (not measured at other head sizes)
    assert launches().registers(True, 256) is None
    assert launches(block_n=32).registers(True, 128) is None  # (nor with other tiles)
    assert launches(num_warps=8).registers(True, 128) is None
    assert launches(max_registers=96).registers(False, 64) == 96  # (asked: taken as it is)
    assert launches(max_registers=0).registers(True, 128) is None  # (0: the compiler's)


def test_the_stages_are_three_over_an_fp8_cache_read_in_one_split_only():
    assert launches().stages(True, 1) == decode.FP8_STAGES == 3
    assert launches().stages(True, 2) == 2  # (splits)
    assert launches().stages(True, 16) == 2
    assert launches().stages(False, 1) == 2  # (a 16-bit cache)
    assert launches(block_n=128).stages(True, 1) == 2  # (another tile)
    assert launches(num_warps=8).stages(True, 1) == 2
    assert launches(num_stages=1).stages(True, 1) == 1  # (asked)
    assert launches(num_stages=4).stages(False, 16) == 4


def test_one_split_from_128_sequences_at_8_kv_heads():
    """Where the FP8 stages change: 1,024 programs without splits."""
    assert decode.decode_splits(128, 8) == 1 and decode.decode_splits(256, 8) == 1
    assert decode.decode_splits(127, 8) == 2 and decode.decode_splits(1, 8) == 16
