"""The FP8 weight products against float64: the block-scaled Triton kernel (e4m3 weights,
a scale per output row and input block; partial blocks, decode and prefill row counts), and
on GPUs with FP8 tensor cores torch._scaled_mm of per-channel weights and per-token
activations against the same arithmetic on the CPU. GPU-marked; with TRITON_INTERPRET=1 the
kernel also runs on the CPU (float32 and float16)."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")

from nano_models.layers.fp8_matmul import block_fp8_matmul, tile

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        DEVICE == "cpu" and not INTERPRET, reason="needs a CUDA GPU (or TRITON_INTERPRET=1)"
    ),
]
DTYPES = [torch.float32, torch.float16] if DEVICE == "cpu" else [torch.float32, torch.bfloat16]


def weights(n: int, k: int, block: int, g: torch.Generator):
    w8 = (torch.randn(n, k, generator=g) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    scales = torch.rand(n, -(-k // block), generator=g) * 0.01 + 1e-4
    return w8.to(DEVICE), scales.to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block", [32, 128])
@pytest.mark.parametrize("m,n,k", [(1, 64, 96), (5, 96, 160), (33, 200, 128), (130, 64, 64)])
def test_block_fp8_matmul_matches_float64(m, n, k, block, dtype):
    g = torch.Generator().manual_seed(m * n + k)
    x = torch.randn(m, k, generator=g).to(DEVICE, dtype)
    w8, scales = weights(n, k, block, g)
    y = block_fp8_matmul(x, w8, scales, block)
    w = w8.double() * scales.double().repeat_interleave(block, dim=1)[:, :k]
    want = x.double() @ w.t()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert y.dtype == dtype and y.shape == (m, n)
    assert ((y.double() - want).norm() / want.norm()) < tol


@pytest.mark.parametrize("m", [1, 16, 100, 300])
def test_every_tile_gives_the_same_product(m):
    g = torch.Generator().manual_seed(m)
    x = torch.randn(m, 256, generator=g).to(DEVICE)
    w8, scales = weights(96, 256, 128, g)
    want = block_fp8_matmul(x, w8, scales, 128)
    for rows in (1, 64, 1000):
        got = block_fp8_matmul(x, w8, scales, 128, tile(rows, 128))
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_bad_shapes_are_named():
    x = torch.randn(3, 64, device=DEVICE)
    w8, scales = weights(32, 64, 32, torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="do not fit"):
        block_fp8_matmul(x, w8, scales[:, :1], 32)
    with pytest.raises(ValueError, match="multiple of 16"):
        block_fp8_matmul(x, w8, scales, 24)
    with pytest.raises(ValueError, match=r"BLOCK_K \(64\) must be >= 16 and divide"):
        block_fp8_matmul(x, w8, scales, 32, {**tile(1, 32), "BLOCK_K": 64})


@pytest.mark.skipif(
    DEVICE != "cuda" or torch.cuda.get_device_capability() < (8, 9),
    reason="FP8 tensor cores (compute capability 8.9 or later)",
)
@pytest.mark.parametrize("m", [1, 16, 200])
def test_scaled_mm_matches_the_cpus_arithmetic(m):
    from nano_models.layers.linear import ReplicatedLinear
    from nano_models.quantization import ChannelFp8

    g = torch.Generator().manual_seed(m)
    layer = ReplicatedLinear(256, 512, bias=True)
    w = torch.randn(512, 256, generator=g) / 16
    scale = w.abs().amax(dim=1) / 448
    layer.weight = torch.nn.Parameter((w / scale[:, None]).to(torch.float8_e4m3fn), False)
    layer.weight_scale = torch.nn.Parameter(scale, False)
    layer.bias.data = torch.randn(512, generator=g)
    layer.quant = ChannelFp8()
    x = torch.randn(m, 256, generator=g)
    want = layer(x.bfloat16()).float()  # (the CPU: float32 arithmetic, rounded to bf16)
    got = layer.to("cuda")(x.to("cuda", torch.bfloat16)).float().cpu()
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
