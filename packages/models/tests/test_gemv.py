"""The few-row linear product (``gemv``) against float64 torch: rows 1 to 4 and more, outputs
no tile divides, rows longer than one slice, a bias; e4m3 weights with a scale a row or a row
and block of columns; which products the linear layers give it (FP8 layers too); bad input;
the prologue that makes the input (RMSNorm with the residual add) and the epilogue of a gated
MLP's gate/up product (SiLU-and-mul).
On the GPU also bf16 and fp16, and CUDA graphs in which it follows a kernel that
writes its input and feeds another (programmatic dependent launch on Hopper). GPU-marked; with
TRITON_INTERPRET=1 (float32) it also runs on the CPU."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")

from nano_models.layers import gemv as gemv_module
from nano_models.layers.activation import SiluAndMul
from nano_models.layers.gemv import (
    GEMV_ROWS,
    Scales,
    gemv,
    normed_gemv,
    tiles,
    usable,
)
from nano_models.layers.linear import (
    MergedColumnParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from nano_models.layers.norm import RMSNorm
from nano_models.quantization import (
    Fp8Config,
    dequantize,
    fp8_lm_head,
    prepare_block_fp8,
    quantize_channel_fp8,
    round_per_token,
)

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


def fp8_weight(n, k, block, seed):
    """An e4m3 weight [n, k] (values over its whole range) and float32 scales per ``block``
    columns, and the float64 weight they stand for."""
    g = torch.Generator().manual_seed(seed)
    w8 = (torch.randn(n, k, generator=g) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    values = torch.rand(n, -(-k // block), generator=g) * 0.01 + 1e-4
    dense = w8.double() * values.double().repeat_interleave(block, dim=1)[:, :k]
    return w8.to(DEVICE), Scales(values.to(DEVICE), block), dense


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "rows,n,k,block,bias",
    [
        (1, 64, 256, 256, False),  # (a scale a row)
        (2, 37, 100, 100, True),
        (1, 96, 384, 128, True),  # (blocks of 128 columns)
        (2, 50, 300, 48, False),  # (blocks of 48: cut in 16s; the last one short)
        (3, 40, 256, 64, True),
        (1, 130, 1000, 1000, False),
    ],
)
def test_e4m3_weights_with_their_scales_match_float64(rows, n, k, block, bias, dtype):
    x, _, b = operands(rows, n, k, dtype, seed=rows + n * k, bias=bias)
    w8, scales, dense = fp8_weight(n, k, block, seed=n + k)
    out = gemv(x, w8, b, scales)
    assert out.dtype == dtype and out.shape == (rows, n)
    torch.testing.assert_close(out.double().cpu(), reference(x, dense, b), **tolerance(dtype))


@pytest.mark.parametrize("programs", [1, None])
@pytest.mark.parametrize("block", [32, 300])
@pytest.mark.parametrize("rows", [1, 2])
def test_e4m3_weights_in_slices_walked_with_the_norm_and_activation(
    rows, block, programs, monkeypatch
):
    """Slices of 64 e4m3 values (two scale blocks of 32 each, or one scale a row), walked by
    one program or dealt a program each; the normed prologue, the gated epilogue."""
    monkeypatch.setattr(gemv_module, "MAX_TILE", 64)
    if programs is not None:
        monkeypatch.setattr(gemv_module, "_multiprocessors", lambda device: 1)
        monkeypatch.setattr(gemv_module, "PROGRAMS_PER_SM", programs)
        monkeypatch.setattr(gemv_module, "ONE_WAVE_BYTES", 0)
    n, k = 20, 300
    x, _, b = operands(rows, n, k, torch.float32, seed=11, bias=True)
    w8, scales, dense = fp8_weight(n, k, block, seed=block)
    torch.testing.assert_close(
        gemv(x, w8, b, scales).double().cpu(), reference(x, dense, b), atol=1e-4, rtol=1e-4
    )
    residual = torch.randn(rows, k).to(DEVICE)
    norm_w = torch.rand(k).to(DEVICE) + 0.5
    out, _, _ = normed_gemv(x, residual, norm_w, 1e-5, w8, scales=scales)
    h = rms_normed(x.double().cpu() + residual.double().cpu(), norm_w, 1e-5)
    torch.testing.assert_close(out.double().cpu(), reference(h, dense), atol=1e-4, rtol=1e-4)
    gate, up = reference(x, dense, b).chunk(2, dim=-1)
    torch.testing.assert_close(
        gemv(x, w8, b, scales, glu=True).double().cpu(),
        gate * torch.sigmoid(gate) * up,
        atol=1e-4,
        rtol=1e-4,
    )
    out, _, _ = normed_gemv(x, residual, norm_w, 1e-5, w8, scales=scales, glu=True)
    gate, up = reference(h, dense).chunk(2, dim=-1)
    torch.testing.assert_close(
        out.double().cpu(), gate * torch.sigmoid(gate) * up, atol=1e-4, rtol=1e-4
    )


@pytest.mark.parametrize("programs", [1, 3, None])
@pytest.mark.parametrize("rows", [1, 3])
def test_rows_longer_than_a_slice_are_taken_in_slices(rows, programs, monkeypatch):
    """Slices of 64 values (5 a row, the last partly masked), the tiles dealt to one program,
    to three, or to as many as the device holds."""
    monkeypatch.setattr(gemv_module, "MAX_TILE", 64 * 4)  # (bytes: 64 float32 values)
    if programs is not None:
        monkeypatch.setattr(gemv_module, "_multiprocessors", lambda device: 1)
        monkeypatch.setattr(gemv_module, "PROGRAMS_PER_SM", programs)
    n, k = 20, 300
    assert tiles(n, k, 4, element_size=4)[:2] == (1, 64)
    if programs is not None:
        monkeypatch.setattr(gemv_module, "ONE_WAVE_BYTES", 0)  # (the tiles walked)
    x, w, b = operands(rows, n, k, torch.float32, seed=5, bias=True)
    torch.testing.assert_close(
        gemv(x, w, b).double().cpu(), reference(x, w, b), atol=1e-4, rtol=1e-4
    )


@pytest.mark.parametrize("size", [2, 1])
def test_tiles_hold_at_most_max_tile_bytes_and_spread_over_the_programs(size):
    for n, k in [(5120, 2048), (2048, 4096), (128, 2048), (1024, 3072), (4096, 12288), (7, 5)]:
        for multiprocessors in (1, 132):
            block_n, block_k, warps, grid, block_s = tiles(n, k, multiprocessors, size)
            programs = multiprocessors * gemv_module.PROGRAMS_PER_SM
            values = gemv_module.MAX_TILE // size
            assert block_n * block_k <= values or block_n == 1
            assert block_k >= min(k, values, gemv_module.MAX_SLICE) and warps in (4, 8)
            assert block_k <= gemv_module.MAX_SLICE and block_s == 0
            blocks = -(-n // block_n)
            if block_n > 1:  # (narrowed while there were fewer row blocks than programs)
                assert blocks >= programs
            # a program per tile for small weights, at most ``programs`` for large ones
            small = n * k * size <= gemv_module.ONE_WAVE_BYTES * multiprocessors
            assert grid == (blocks if small else min(blocks, programs))


def test_tiles_of_block_scaled_weights_are_cut_in_whole_scale_blocks():
    assert tiles(6144, 4096, 132, 1, 128)[1::3] == (4096, 128)  # (32 blocks of 128 a slice)
    assert tiles(4096, 12288, 132, 1, 128)[:2] == (8, gemv_module.MAX_SLICE)
    assert tiles(64, 96, 4, 1, 32)[1::3] == (128, 32)
    assert tiles(64, 300, 4, 1, 48)[1::3] == (512, 16)  # (48: blocks of 16, never across two)
    assert tiles(64, 100, 4, 1, 128).block_s == 0  # (one scale a row: applied to its sum)


def test_which_products_it_takes():
    w = torch.empty(8, 16, dtype=torch.bfloat16)
    x = torch.empty(1, 16, dtype=torch.bfloat16)
    assert not usable(x, w)  # (on the CPU: torch's matmul)
    if DEVICE == "cuda":
        x, w = x.cuda(), w.cuda()
        assert usable(x, w)
        assert usable(torch.empty(GEMV_ROWS, 16, dtype=torch.bfloat16, device="cuda"), w)
        assert not usable(torch.empty(GEMV_ROWS + 1, 16, dtype=torch.bfloat16, device="cuda"), w)
        big = torch.empty(gemv_module.TWO_ROWS_BYTES // 128 + 1, 64, device="cuda").bfloat16()
        two = torch.empty(2, 64, dtype=torch.bfloat16, device="cuda")
        assert usable(two[:1], big) and not usable(two, big)  # (two rows: small weights only)
        big8 = torch.empty(gemv_module.TWO_ROWS_BYTES // 64 + 1, 64, device="cuda")
        big8 = big8.to(torch.float8_e4m3fn)
        assert usable(two, big8, scaled=True)  # (e4m3: two rows always)
        assert not usable(two, big8) and not usable(two, big, scaled=True)
        assert not usable(x, torch.empty(8, 18, device="cuda").to(big8.dtype)[:, :16], True)
        assert not usable(x.float(), w.float())  # (float32: cuBLAS)
        assert not usable(x, w.t().contiguous().t())  # (not contiguous along its input)
        assert not usable(torch.empty(0, 16, dtype=torch.bfloat16, device="cuda"), w)


def test_bad_input_is_refused():
    x, w, _ = operands(1, 8, 16, torch.float32, seed=1)
    with pytest.raises(ValueError, match="x has 16 columns, the weight 12"):
        gemv(x, w[:, :12].contiguous())
    with pytest.raises(ValueError, match="contiguous along its input"):
        gemv(x, w.t().contiguous().t())


def test_bad_scales_are_refused():
    x, _, _ = operands(1, 8, 64, torch.float32, seed=1)
    w8, scales, _ = fp8_weight(8, 64, 32, seed=1)
    with pytest.raises(ValueError, match="comes with its scales"):
        gemv(x, w8)
    with pytest.raises(ValueError, match="comes with its scales"):
        gemv(x, w8.float(), scales=scales)
    with pytest.raises(ValueError, match=r"takes scales \[8, 2\], got \[8, 3\]"):
        gemv(x, w8, scales=Scales(torch.ones(8, 3, device=DEVICE), 32))
    with pytest.raises(ValueError, match="must be float32"):
        gemv(x, w8, scales=Scales(scales.values.double(), 32))
    with pytest.raises(ValueError, match="a multiple of 16"):
        gemv(x, w8, scales=Scales(torch.ones(8, 3, device=DEVICE), 24))
    odd, odd_scales, _ = fp8_weight(8, 62, 62, seed=2)
    with pytest.raises(ValueError, match="multiples of 4, got 62 columns"):
        gemv(x[:, :62], odd, scales=odd_scales)


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


@pytest.mark.skipif(DEVICE != "cuda", reason="the linear layers take it on a GPU only")
@pytest.mark.parametrize("scheme", ["channel", "block"])
@pytest.mark.parametrize("rows", [1, GEMV_ROWS, GEMV_ROWS + 1])
def test_fp8_layers_of_a_few_rows_take_it_with_their_prologues(rows, scheme, monkeypatch):
    """FP8 layers (quantization="fp8": a scale a row; a checkpoint's 128 x 128 blocks): up to
    GEMV_ROWS rows ``gemv`` reads the e4m3 weight and its scales, the norm in its prologue and
    SiLU-and-mul in the gate/up product's epilogue; past that the layer's own FP8 product. Both
    against float64 products of the weights the FP8 ones stand for."""
    torch.manual_seed(rows)
    norm = RMSNorm(512, eps=1e-6).to("cuda", torch.bfloat16)
    norm.weight.uniform_(0.5, 1.5)
    model = torch.nn.ModuleDict(
        {
            "up": MergedColumnParallelLinear(512, [384, 384], bias=False),
            "down": RowParallelLinear(384, 512, bias=True),
        }
    ).to("cuda", torch.bfloat16)
    for layer in model.values():
        torch.nn.init.normal_(layer.weight, std=0.05)
    torch.nn.init.normal_(model["down"].bias)
    if scheme == "channel":
        quantize_channel_fp8(model, Fp8Config("channel"))
    else:
        config = Fp8Config("block", (128, 128))
        prepare_block_fp8(model, config)
        for layer in model.values():
            g = torch.Generator().manual_seed(layer.weight.shape[0])
            w = (torch.randn(layer.weight.shape, generator=g) * 100).clamp(-448, 448)
            layer.weight.data.copy_(w.to(torch.float8_e4m3fn))
            layer.weight_scale_inv.data.uniform_(1e-4, 1e-3)
    up, down = model["up"], model["down"]
    calls = []
    real = gemv_module._launch
    monkeypatch.setattr(gemv_module, "_launch", lambda *a, **k: calls.append(1) or real(*a, **k))
    x = torch.randn(rows, 512, device="cuda", dtype=torch.bfloat16)
    residual = torch.randn(rows, 512, device="cuda", dtype=torch.bfloat16)

    h, s, normed = up.normed(norm, x, residual, keep_normed=True)
    normed_ref, s_ref = norm(x, residual)
    assert torch.equal(s, s_ref)
    torch.testing.assert_close(normed, normed_ref, atol=0, rtol=2**-7)
    tol = tolerance(torch.bfloat16)
    torch.testing.assert_close(h.double().cpu(), reference(normed_ref, dequantize(up)), **tol)
    a, _, _ = up.normed(norm, x, residual, act=SiluAndMul())
    gate, up_half = reference(normed_ref, dequantize(up)).chunk(2, dim=-1)
    torch.testing.assert_close(a.double().cpu(), gate * torch.sigmoid(gate) * up_half, **tol)
    torch.testing.assert_close(
        down(a).double().cpu(), reference(a, dequantize(down), down.bias), **tol
    )
    assert len(calls) == (3 if rows <= GEMV_ROWS else 0)


@pytest.mark.skipif(DEVICE != "cuda", reason="the LM head takes it on a GPU only")
@pytest.mark.parametrize("rows", [1, GEMV_ROWS, 16, 64])
def test_an_fp8_lm_head_takes_it_at_a_few_rows(rows, monkeypatch):
    """The LM head in e4m3 (quantize_lm_head: a scale a vocabulary row): up to GEMV_ROWS rows
    ``gemv``; past that the per-channel FP8 product (the weight widened up to 16 rows, FP8
    tensor cores with the activations rounded per token after). Against float64 products of
    the weight the FP8 one stands for."""
    from nano_models.layers.embedding import ParallelLMHead

    torch.manual_seed(rows)
    holder = torch.nn.Module()
    holder.lm_head = ParallelLMHead(4000, 512).to("cuda", torch.bfloat16)
    torch.nn.init.normal_(holder.lm_head.weight, std=0.05)
    fp8_lm_head(holder)
    head = holder.lm_head
    assert head.weight.dtype == torch.float8_e4m3fn
    calls = []
    real = gemv_module._launch
    monkeypatch.setattr(gemv_module, "_launch", lambda *a, **k: calls.append(1) or real(*a, **k))
    x = torch.randn(rows, 512, device="cuda", dtype=torch.bfloat16)
    if rows > 16:
        x8, scale = round_per_token(x)
        x_ref = x8.double() * scale.double()
    else:
        x_ref = x
    logits = head(x)
    assert logits.shape == (rows, 4000) and logits.dtype == torch.bfloat16
    torch.testing.assert_close(
        logits.double().cpu(), reference(x_ref, dequantize(head)), **tolerance(torch.bfloat16)
    )
    assert len(calls) == (1 if rows <= GEMV_ROWS else 0)


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


def rms_normed(s, weight, eps):
    """float64 RMSNorm of s [M, K] times weight [K]."""
    s = s.double().cpu()
    return weight.double().cpu() * s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + eps)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "rows,n,k,with_residual,bias",
    [
        (1, 64, 128, True, False),
        (1, 37, 100, False, True),  # (no residual: the first layer's input norm)
        (2, 300, 48, True, True),
        (3, 20, 200, True, False),
    ],
)
def test_the_normed_product_matches_float64(rows, n, k, with_residual, bias, dtype):
    x, w, b = operands(rows, n, k, dtype, seed=rows + n + k, bias=bias)
    g = torch.Generator().manual_seed(k)
    residual = torch.randn(rows, k, generator=g).to(DEVICE, dtype) if with_residual else None
    norm_w = (1 + torch.rand(k, generator=g)).to(DEVICE, dtype)
    out, new_residual, normed = normed_gemv(x, residual, norm_w, 1e-6, w, b, keep_normed=True)
    s = x.double().cpu() + (0 if residual is None else residual.double().cpu())
    h = rms_normed(s, norm_w, 1e-6)
    tol = tolerance(dtype)
    torch.testing.assert_close(new_residual.double().cpu(), s, **tol)
    torch.testing.assert_close(normed.double().cpu(), h, **tol)
    torch.testing.assert_close(out.double().cpu(), reference(h, w, b), **tol)
    if residual is None:
        assert new_residual is x  # (the residual is the input itself)
    else:
        assert new_residual.data_ptr() not in (x.data_ptr(), residual.data_ptr())
    assert normed_gemv(x, residual, norm_w, 1e-6, w, b).normed is None  # (kept when asked)


@pytest.mark.parametrize("programs", [1, None])
@pytest.mark.parametrize("rows", [1, 2])
def test_a_normed_product_takes_long_rows_in_slices(rows, programs, monkeypatch):
    """The norm's sums and the product over 5 slices of 64; with one program, which also
    writes the new residual and the normed input (once, in its first row block)."""
    monkeypatch.setattr(gemv_module, "MAX_TILE", 64 * 4)  # (bytes: 64 float32 values)
    if programs is not None:
        monkeypatch.setattr(gemv_module, "_multiprocessors", lambda device: 1)
        monkeypatch.setattr(gemv_module, "PROGRAMS_PER_SM", programs)
        monkeypatch.setattr(gemv_module, "ONE_WAVE_BYTES", 0)
    n, k = 12, 300
    x, w, _ = operands(rows, n, k, torch.float32, seed=9)
    residual = torch.randn(rows, k).to(DEVICE)
    norm_w = torch.rand(k).to(DEVICE) + 0.5
    out, new_residual, normed = normed_gemv(x, residual, norm_w, 1e-5, w, keep_normed=True)
    summed = x.double().cpu() + residual.double().cpu()
    h = rms_normed(summed, norm_w, 1e-5)
    torch.testing.assert_close(new_residual.double().cpu(), summed, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(normed.double().cpu(), h, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out.double().cpu(), reference(h, w), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("programs", [1, 3, None])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "rows,n,k,bias",
    [
        (1, 64, 96, False),
        (2, 66, 200, True),  # (33 gate rows: no row block divides them)
        (1, 2, 300, True),  # (one gate row, one up row)
        (3, 40, 64, False),
    ],
)
def test_the_gated_product_matches_float64(rows, n, k, bias, dtype, programs, monkeypatch):
    """glu: SiLU(gate) * up of the [gate | up] products, each rounded to the dtype first (as
    the layer's output), in row blocks dealt a program each or walked by one or three."""
    if programs is not None:
        monkeypatch.setattr(gemv_module, "_multiprocessors", lambda device: 1)
        monkeypatch.setattr(gemv_module, "PROGRAMS_PER_SM", programs)
        monkeypatch.setattr(gemv_module, "ONE_WAVE_BYTES", 0)
    x, w, b = operands(rows, n, k, dtype, seed=n + k, bias=bias)
    gate, up = reference(x, w, b).to(dtype).double().chunk(2, dim=-1)
    out = gemv(x, w, b, glu=True)
    assert out.shape == (rows, n // 2) and out.dtype == dtype
    torch.testing.assert_close(
        out.double().cpu(), gate * torch.sigmoid(gate) * up, **tolerance(dtype)
    )


def test_bad_prologue_input_is_refused():
    x, w, _ = operands(1, 7, 16, torch.float32, seed=1)
    with pytest.raises(ValueError, match=r"gate and up halves: an even number of rows, got 7"):
        gemv(x, w, glu=True)
    norm_w = torch.ones(16, device=DEVICE)
    with pytest.raises(ValueError, match=r"the norm's weight must be torch.float32 \[16\]"):
        normed_gemv(x, None, norm_w[:8], 1e-6, w)
    with pytest.raises(ValueError, match=r"the residual must be torch.float32 \[1, 16\]"):
        normed_gemv(x, x[:, :8], norm_w, 1e-6, w)


@pytest.mark.skipif(DEVICE != "cuda", reason="the linear layers take it on a GPU only")
@pytest.mark.parametrize("rows", [1, GEMV_ROWS, GEMV_ROWS + 1])
def test_layers_with_the_norm_and_activation_inside_match_their_own_kernels(rows):
    """The fused layers (rows <= GEMV_ROWS) against the norm, SiLU-and-mul and product as
    separate torch kernels; past GEMV_ROWS the layers take those kernels themselves."""
    torch.manual_seed(rows)
    norm = RMSNorm(256, eps=1e-6).to("cuda", torch.bfloat16)
    norm.weight.uniform_(0.5, 1.5)
    up = MergedColumnParallelLinear(256, [96, 96], bias=False).to("cuda", torch.bfloat16)
    down = RowParallelLinear(96, 256, bias=True).to("cuda", torch.bfloat16)
    for layer in (up, down):
        torch.nn.init.normal_(layer.weight, std=0.05)
    torch.nn.init.normal_(down.bias)
    x = torch.randn(rows, 256, device="cuda", dtype=torch.bfloat16)
    residual = torch.randn(rows, 256, device="cuda", dtype=torch.bfloat16)

    h, s, normed = up.normed(norm, x, residual, keep_normed=True)
    normed_ref, s_ref = norm(x, residual)
    assert torch.equal(s, s_ref)  # (one bf16 rounding of the same sum)
    torch.testing.assert_close(normed, normed_ref, atol=0, rtol=2**-7)  # (an ulp at most)
    torch.testing.assert_close(
        h.double().cpu(), reference(normed_ref, up.weight), **tolerance(torch.bfloat16)
    )
    first, s_first, _ = up.normed(norm, x)  # (no residual: the first layer)
    assert s_first is x
    torch.testing.assert_close(first, up(norm(x)), **tolerance(torch.bfloat16))

    act = SiluAndMul()
    a, s_act, _ = up.normed(norm, x, residual, act=act)
    assert torch.equal(s_act, s_ref)
    assert a.shape == (rows, 96)
    torch.testing.assert_close(a, act(h), atol=0, rtol=2**-7)  # (an ulp at most)
    torch.testing.assert_close(up(normed_ref, act), act(up(normed_ref)), atol=0, rtol=2**-7)
    other = torch.nn.Tanh()  # (not SiLU-and-mul: applied to the whole product, after it)
    assert torch.equal(up(normed_ref, other), torch.tanh(up(normed_ref)))
    assert torch.equal(up.normed(norm, x, residual, act=other)[0], torch.tanh(up(normed_ref)))
    torch.testing.assert_close(
        down(a).double().cpu(),
        reference(a, down.weight, down.bias),
        **tolerance(torch.bfloat16),
    )
