"""Activations rounded to e4m3 per token and per token and group of columns: the torch
reference against a group-by-group loop; the Triton kernel (GPU-marked; on the CPU with
TRITON_INTERPRET=1) exact on values whose scales and quotients e4m3 holds exactly (the
interpreter rounds some others wrongly), and on the GPU the torch reference bit for bit on
random data, inside a CUDA graph too."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")

from nano_models import quantization
from nano_models.layers import fp8_quant
from nano_models.layers.fp8_quant import round_fp8, round_per_token
from nano_models.quantization import FP8, round_per_token_group

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_kernels = pytest.mark.skipif(
    DEVICE == "cpu" and not INTERPRET, reason="needs a CUDA GPU (or TRITON_INTERPRET=1)"
)
needs_fp8_gpu = pytest.mark.skipif(
    DEVICE != "cuda" or torch.cuda.get_device_capability() < (8, 9) or INTERPRET,
    reason="e4m3 conversions on a GPU of compute capability 8.9 or later (the interpreter "
    "rounds some values wrongly)",
)
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
SHAPES = [(1, 64, 64), (3, 300, 128), (5, 256, 32), (2, 100, 100), (4, 96, 1000)]


def on_the_grid(t: int, k: int, group: int, g: torch.Generator):
    """x [t, k] float32 whose groups are e4m3 values times 2^e, each group's first |x| 448 *
    2^e: its scale is 2^e and x / scale the e4m3 values exactly. Row 0's first group is zeros
    (scale 1e-12). Returns x, the e4m3 values, the scales."""
    codes = torch.randint(0, 256, (t, k), generator=g, dtype=torch.uint8)
    values = codes.view(FP8).float().nan_to_num(0.0)
    groups = -(-k // group)
    first = torch.arange(groups) * group
    values[:, first] = torch.where(torch.rand(t, groups, generator=g) < 0.5, -448.0, 448.0)
    scales = 2.0 ** torch.randint(-8, 6, (t, groups), generator=g).float()
    values[0, :group] = 0
    scales[0, 0] = 1e-12
    x = values * scales.repeat_interleave(group, dim=1)[:, :k]
    return x, values, scales


@pytest.mark.parametrize("t,k,group", SHAPES)
def test_the_reference_rounds_each_group_by_its_largest_value(t, k, group):
    g = torch.Generator().manual_seed(t * k + group)
    x = torch.randn(t, k, generator=g) * torch.logspace(-3, 3, t)[:, None]
    q, scales = round_per_token_group(x, group)
    assert q.shape == (t, k) and q.dtype == FP8 and scales.shape == (t, -(-k // group))
    for i, first in enumerate(range(0, k, group)):
        part = x[:, first : first + group]
        scale = (part.abs().amax(dim=1) / 448).clamp(min=1e-12)
        torch.testing.assert_close(scales[:, i], scale, atol=0, rtol=0)
        want = (part / scale[:, None]).clamp(-448, 448).to(FP8)
        assert torch.equal(q[:, first : first + group].view(torch.uint8), want.view(torch.uint8))


@pytest.mark.gpu
@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,k,group", SHAPES)
def test_rounding_on_the_grid_is_exact(t, k, group, dtype):
    x, values, scales = on_the_grid(t, k, group, torch.Generator().manual_seed(k + group))
    q, s = round_fp8(x.to(DEVICE, dtype), group)
    assert q.dtype == FP8 and s.dtype == torch.float32 and s.shape == scales.shape
    assert torch.equal(s.cpu(), scales)
    assert torch.equal(q.cpu().float(), values)


@pytest.mark.gpu
@needs_kernels
def test_long_groups_are_read_in_two_passes(monkeypatch):
    monkeypatch.setattr(fp8_quant, "MAX_BLOCK", 64)
    assert not fp8_quant.settings(200)["ONE_PASS"]
    x, values, scales = on_the_grid(3, 450, 200, torch.Generator().manual_seed(1))
    q, s = round_fp8(x.to(DEVICE), 200)
    assert torch.equal(s.cpu(), scales) and torch.equal(q.cpu().float(), values)


@pytest.mark.gpu
@needs_kernels
def test_per_token_is_one_group_per_row():
    x, values, scales = on_the_grid(4, 320, 320, torch.Generator().manual_seed(2))
    q, s = round_per_token(x.to(DEVICE, torch.bfloat16))
    assert s.shape == (4, 1)
    assert torch.equal(s.cpu(), scales) and torch.equal(q.cpu().float(), values)


@pytest.mark.gpu
@needs_fp8_gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "t,k,group",
    [
        (1, 4096, 128),
        (7, 1000, 128),
        (16, 12288, 128),
        (64, 4096, 64),
        (200, 4096, 4096),
        (4096, 12288, 12288),
        (3, 40000, 40000),
    ],
)
def test_rounding_matches_the_reference_bit_for_bit(t, k, group, dtype):
    g = torch.Generator(device="cuda").manual_seed(t + k)
    spread = torch.logspace(-4, 4, t, device="cuda")[:, None]
    x = (torch.randn(t, k, device="cuda", generator=g) * spread).to(dtype)
    x[0, : min(group, k)] = 0
    q, s = round_fp8(x, group)
    q_ref, s_ref = round_per_token_group(x, group)
    assert torch.equal(s, s_ref)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    if group == k:  # (quantize_per_token takes the kernel on CUDA)
        q_tok, s_tok = quantization.quantize_per_token(x)
        assert torch.equal(s_tok, s_ref) and torch.equal(
            q_tok.view(torch.uint8), q.view(torch.uint8)
        )


@pytest.mark.gpu
@needs_fp8_gpu
def test_rounding_in_a_cuda_graph():
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(16, 4096, device="cuda", generator=g).bfloat16()
    round_fp8(x, 128)  # (compiled before the capture)
    round_per_token(x)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        grouped = round_fp8(x, 128)
        per_token = round_per_token(x)
    x.copy_(torch.randn(16, 4096, device="cuda", generator=g) * 3)
    graph.replay()
    for (q, s), group in ((grouped, 128), (per_token, 4096)):
        q_ref, s_ref = round_per_token_group(x, group)
        assert torch.equal(s, s_ref) and torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
