"""The few-row linear product (``gemv``) against float64 torch: rows 1 to 4 and more, outputs
no tile divides, rows longer than one slice, a bias; which products the linear layers give it;
bad input. On the GPU also bf16 and fp16, and CUDA graphs in which it follows a kernel that
writes its input and feeds another (programmatic dependent launch on Hopper). GPU-marked; with
TRITON_INTERPRET=1 (float32) it also runs on the CPU."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")

from nano_models.layers import gemv as gemv_module
from nano_models.layers.gemv import GEMV_ROWS, gemv, tiles, usable
from nano_models.layers.linear import ReplicatedLinear

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        DEVICE == "cpu" and not INTERPRET, reason="needs a CUDA GPU (or TRITON_INTERPRET=1)"
    ),
]
DTYPES = [torch.float32] if DEVICE == "cpu" else [torch.float32, torch.bfloat16, torch.float16]


def operands(rows, n, k, dtype, seed, bias=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g)
    w = torch.randn(n, k, generator=g) / k**0.5
    b = torch.randn(n, generator=g) if bias else None
    return [None if t is None else t.to(DEVICE, dtype) for t in (x, w, b)]


def reference(x, w, b=None):
    y = x.double().cpu() @ w.double().cpu().T
    return y if b is None else y + b.double().cpu()


def tolerance(dtype) -> dict:
    return {"atol": 1e-4, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "rows,n,k,bias",
    [
        (1, 64, 128, False),
        (1, 37, 100, True),  # (no tile divides 37 outputs or 100 inputs)
        (2, 300, 48, False),
        (3, 129, 256, True),  # (3 rows in a tile of 4)
        (4, 8, 1000, False),
        (6, 40, 64, False),  # (more rows than GEMV_ROWS: it still computes them)
    ],
)
def test_the_product_matches_float64(rows, n, k, bias, dtype):
    x, w, b = operands(rows, n, k, dtype, seed=rows * n + k, bias=bias)
    out = gemv(x, w, b)
    assert out.dtype == dtype and out.shape == (rows, n)
    torch.testing.assert_close(out.double().cpu(), reference(x, w, b), **tolerance(dtype))


@pytest.mark.parametrize("rows", [1, 3])
def test_rows_longer_than_a_slice_are_taken_in_slices(rows, monkeypatch):
    monkeypatch.setattr(gemv_module, "MAX_TILE", 64)
    n, k = 20, 300  # (slices of 64 values: 5 of them, the last one partly masked)
    assert tiles(n, k)[1] == 64
    x, w, b = operands(rows, n, k, torch.float32, seed=5, bias=True)
    torch.testing.assert_close(
        gemv(x, w, b).double().cpu(), reference(x, w, b), atol=1e-4, rtol=1e-4
    )


def test_tiles_hold_at_most_max_tile_values_and_spread_over_the_device():
    for n, k in [(5120, 2048), (2048, 4096), (128, 2048), (1024, 3072), (4096, 12288), (7, 5)]:
        block_n, block_k, warps = tiles(n, k)
        assert block_n * block_k <= gemv_module.MAX_TILE or block_n == 1
        assert block_k >= min(k, gemv_module.MAX_TILE) and warps in (4, 8)
        if block_n > 1:  # (narrowed while there were too few programs)
            assert -(-n // block_n) >= gemv_module.MIN_PROGRAMS


def test_which_products_it_takes():
    w = torch.empty(8, 16, dtype=torch.bfloat16)
    x = torch.empty(1, 16, dtype=torch.bfloat16)
    assert not usable(x, w)  # (on the CPU: torch's matmul)
    if DEVICE == "cuda":
        x, w = x.cuda(), w.cuda()
        assert usable(x, w)
        assert usable(torch.empty(GEMV_ROWS, 16, dtype=torch.bfloat16, device="cuda"), w)
        assert not usable(torch.empty(GEMV_ROWS + 1, 16, dtype=torch.bfloat16, device="cuda"), w)
        big = torch.empty(gemv_module.TWO_ROWS_VALUES // 64 + 1, 64, device="cuda").bfloat16()
        two = torch.empty(2, 64, dtype=torch.bfloat16, device="cuda")
        assert usable(two[:1], big) and not usable(two, big)  # (two rows: small weights only)
        assert not usable(x.float(), w.float())  # (float32: cuBLAS)
        assert not usable(x, w.t().contiguous().t())  # (not contiguous along its input)
        assert not usable(torch.empty(0, 16, dtype=torch.bfloat16, device="cuda"), w)


def test_bad_input_is_refused():
    x, w, _ = operands(1, 8, 16, torch.float32, seed=1)
    with pytest.raises(ValueError, match="x has 16 columns, the weight 12"):
        gemv(x, w[:, :12].contiguous())
    with pytest.raises(ValueError, match="contiguous along its input"):
        gemv(x, w.t().contiguous().t())


def test_no_rows_give_an_empty_output():
    x, w, _ = operands(0, 8, 16, torch.float32, seed=2)
    assert gemv(x, w).shape == (0, 8)


@pytest.mark.skipif(DEVICE != "cuda", reason="the linear layers take it on a GPU only")
@pytest.mark.parametrize("rows", [1, GEMV_ROWS, GEMV_ROWS + 1])
def test_a_linear_layer_of_a_few_rows_matches_torch(rows, monkeypatch):
    layer = ReplicatedLinear(256, 96, bias=True).to("cuda", torch.bfloat16)
    torch.nn.init.normal_(layer.weight, std=0.05)
    torch.nn.init.normal_(layer.bias)
    calls = []
    real = gemv_module.gemv
    monkeypatch.setattr(gemv_module, "gemv", lambda *a: calls.append(len(a[0])) or real(*a))
    x = torch.randn(rows, 256, device="cuda", dtype=torch.bfloat16)
    torch.testing.assert_close(
        layer(x).double().cpu(), reference(x, layer.weight, layer.bias), atol=2e-2, rtol=2e-2
    )
    assert calls == ([rows] if rows <= GEMV_ROWS else [])


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs")
@pytest.mark.parametrize("rows", [1, 2])
def test_a_cuda_graph_chains_it_after_a_writer_and_into_another(rows):
    """x is rewritten by a kernel just before the first product, whose output is the next
    product's input: with programmatic dependent launch each must still wait for its input."""
    w1 = (torch.randn(4096, 2048, device="cuda") / 45).to(torch.bfloat16)
    w2 = (torch.randn(2048, 4096, device="cuda") / 64).to(torch.bfloat16)
    src = torch.randn(rows, 2048, device="cuda", dtype=torch.bfloat16)
    x = torch.empty_like(src)

    def chain():
        x.copy_(src * 2)  # (a torch kernel writes the first input)
        return gemv(gemv(x, w1), w2)

    chain()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = chain()
    for seed in range(3):
        src.copy_(torch.randn(rows, 2048, generator=torch.Generator().manual_seed(seed)))
        graph.replay()
        torch.cuda.synchronize()
        mid = (reference(src * 2, w1)).to(torch.bfloat16)
        torch.testing.assert_close(out.double().cpu(), reference(mid, w2), atol=3e-2, rtol=3e-2)
