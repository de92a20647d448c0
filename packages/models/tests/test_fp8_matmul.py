"""The block-FP8 weight products (e4m3 weights, a scale per output row and input block) against
float64: W8A16 (x in its dtype) with and without split K loops, W8A8 (x rounded to e4m3 per
token and block) against the product of its own rounded activations, ``plan``'s choices, and
every kernel variant ``plan`` picks for Qwen3-8B's layers compiled for Hopper (sm_90, no GPU
needed: FP8 tensor-core instructions, pipelined loads, no spills). Kernel tests are GPU-marked;
with TRITON_INTERPRET=1 they also run on the CPU (float32 and float16). On GPUs with FP8
tensor cores: the planned product at decode and prefill row counts against the reference, in
a CUDA graph too, and torch._scaled_mm of per-channel weights and per-token activations
against the same arithmetic on the CPU."""

from __future__ import annotations

import os
import re
import subprocess

import pytest
import torch

triton = pytest.importorskip("triton")

from nano_models.layers.fp8_matmul import (  # noqa: E402
    W8A8_ROWS,
    _block_fp8_kernel,
    _sum_splits_kernel,
    block_fp8_matmul,
    plan,
)
from nano_models.layers.fp8_quant import round_fp8  # noqa: E402
from nano_models.quantization import round_per_token_group  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_kernels = pytest.mark.skipif(
    DEVICE == "cpu" and not INTERPRET, reason="needs a CUDA GPU (or TRITON_INTERPRET=1)"
)
needs_fp8_gpu = pytest.mark.skipif(
    DEVICE != "cuda" or torch.cuda.get_device_capability() < (8, 9),
    reason="FP8 tensor cores (compute capability 8.9 or later)",
)
compiles = pytest.mark.skipif(INTERPRET, reason="Triton's interpreter replaces the kernels")
DTYPES = [torch.float32, torch.float16] if DEVICE == "cpu" else [torch.float32, torch.bfloat16]
H200 = 132  # multiprocessors
QWEN3_8B = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)}


def weights(n: int, k: int, block: int, g: torch.Generator):
    w8 = (torch.randn(n, k, generator=g) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    scales = torch.rand(n, -(-k // block), generator=g) * 0.01 + 1e-4
    return w8.to(DEVICE), scales.to(DEVICE)


def spread(scales: torch.Tensor, block: int, k: int) -> torch.Tensor:
    """Scales per block [rows, ceil(k / block)] as float64 per column [rows, k]."""
    return scales.double().repeat_interleave(block, dim=1)[:, :k]


def forced(m: int, n: int, k: int, block: int, a8: bool, split: int) -> dict:
    return {**plan(m, n, k, block, H200), "A8": a8, "SPLIT_K": split}


def relative_error(y: torch.Tensor, want: torch.Tensor) -> float:
    return ((y.double().cpu() - want.cpu()).norm() / want.cpu().norm()).item()


@pytest.mark.gpu
@needs_kernels
@pytest.mark.parametrize("split", [1, 3])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block", [32, 128])
@pytest.mark.parametrize("m,n,k", [(1, 64, 96), (5, 96, 160), (33, 200, 128), (130, 64, 448)])
def test_w8a16_matches_float64(m, n, k, block, dtype, split):
    g = torch.Generator().manual_seed(m * n + k)
    x = torch.randn(m, k, generator=g).to(DEVICE, dtype)
    w8, scales = weights(n, k, block, g)
    y = block_fp8_matmul(x, w8, scales, block, forced(m, n, k, block, False, split))
    want = x.double() @ (w8.double() * spread(scales, block, k)).t()
    assert y.dtype == dtype and y.shape == (m, n)
    # (float32: Hopper's FP8 tensor cores accumulate with ~14 bits of mantissa within an MMA
    # (DeepSeek-V3's report, 3.3.2): relative errors of 4-8e-5 measured on an H200)
    assert relative_error(y, want) < (3e-4 if dtype == torch.float32 else 2e-2)


@pytest.mark.gpu
@needs_kernels
@pytest.mark.parametrize("split", [1, 2])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "m,n,k,block", [(64, 96, 160, 32), (70, 130, 300, 32), (130, 64, 256, 128)]
)
def test_w8a8_is_the_product_of_its_rounded_activations(m, n, k, block, dtype, split):
    """x rounded per token and block (as the kernel rounds it: Triton's interpreter rounds
    some values to e4m3 wrongly, and the GPU test checks the rounding against torch), times
    the weight, in float64."""
    g = torch.Generator().manual_seed(m + n + k)
    x = torch.randn(m, k, generator=g).to(DEVICE, dtype)
    w8, scales = weights(n, k, block, g)
    y = block_fp8_matmul(x, w8, scales, block, forced(m, n, k, block, True, split))
    q, q_scales = round_fp8(x, block)
    x_rounded = q.double() * spread(q_scales, block, k)
    want = x_rounded @ (w8.double() * spread(scales, block, k)).t()
    assert y.dtype == dtype and y.shape == (m, n)
    # (float32: Hopper's FP8 tensor cores accumulate with ~14 bits of mantissa within an MMA
    # (DeepSeek-V3's report, 3.3.2): relative errors of 4-8e-5 measured on an H200)
    assert relative_error(y, want) < (3e-4 if dtype == torch.float32 else 2e-2)
    # (and it is near the unrounded product: e4m3 keeps 3 bits of mantissa)
    assert relative_error(y, x.double() @ (w8.double() * spread(scales, block, k)).t()) < 0.1


@pytest.mark.gpu
@needs_kernels
@pytest.mark.parametrize("m", [1, 16, 100, 300])
def test_every_w8a16_tile_and_split_gives_the_same_product(m):
    g = torch.Generator().manual_seed(m)
    x = torch.randn(m, 1024, generator=g).to(DEVICE)
    w8, scales = weights(96, 1024, 128, g)
    want = block_fp8_matmul(x, w8, scales, 128, forced(m, 96, 1024, 128, False, 1))
    for rows in (1, 40, 1000):
        for split in (1, 2, 5, 8):
            settings = {**plan(rows, 96, 1024, 128, H200), "A8": False, "SPLIT_K": split}
            got = block_fp8_matmul(x, w8, scales, 128, settings)
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    again = block_fp8_matmul(x, w8, scales, 128, forced(m, 96, 1024, 128, False, 5))
    assert torch.equal(
        again, block_fp8_matmul(x, w8, scales, 128, forced(m, 96, 1024, 128, False, 5))
    )


def test_bad_shapes_are_named():
    x = torch.randn(3, 64)
    w8, scales = torch.zeros(32, 64, dtype=torch.float8_e4m3fn), torch.ones(32, 2)
    with pytest.raises(ValueError, match="do not fit"):
        block_fp8_matmul(x, w8, scales[:, :1], 32)
    with pytest.raises(ValueError, match="multiple of 16"):
        block_fp8_matmul(x, w8, scales, 24)
    with pytest.raises(ValueError, match=r"BLOCK_K \(64\) must be >= 16 and divide"):
        block_fp8_matmul(x, w8, scales, 32, {**plan(1, 32, 64, 32, H200), "BLOCK_K": 64})
    with pytest.raises(ValueError, match=r"BLOCK_K \(16\) must be >= 32"):
        block_fp8_matmul(x, w8, scales, 32, {**forced(64, 32, 64, 32, True, 1), "BLOCK_K": 16})


@pytest.mark.parametrize("block", [128, 48])
@pytest.mark.parametrize("rows", [1, 7, 16, 40, 63, 64, 200, 4096])
@pytest.mark.parametrize("layer", list(QWEN3_8B))
def test_the_plan_keeps_every_multiprocessor_busy(layer, rows, block):
    """FP8 dots from W8A8_ROWS rows where the block allows them (a multiple of 32 columns);
    the K loop split until an H200 holds a few programs per multiprocessor, each split at
    least 4 k-tiles and none empty; tiles whose depth divides the block."""
    n, k = QWEN3_8B[layer]
    p = plan(rows, n, k, block, H200)
    assert p["A8"] == (rows >= W8A8_ROWS and block == 128)
    assert block % p["BLOCK_K"] == 0 and p["BLOCK_K"] >= (32 if p["A8"] else 16)
    tiles = -(-rows // p["BLOCK_M"]) * -(-n // p["BLOCK_N"])
    k_tiles = -(-k // p["BLOCK_K"])
    per_split = -(-k_tiles // p["SPLIT_K"])
    assert (p["SPLIT_K"] - 1) * per_split < k_tiles  # (none empty)
    assert p["SPLIT_K"] == 1 or per_split >= 4
    assert tiles * p["SPLIT_K"] >= 2 * H200 or per_split < 8


def compiled(settings: dict, x: str, block: int):
    """``_block_fp8_kernel`` compiled for sm_90 as a launch would specialize it (16-byte
    aligned pointers, sizes and strides multiples of 16, M not)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    settings = dict(settings)
    a8 = settings.pop("A8")
    options = {"num_warps": settings.pop("num_warps"), "num_stages": settings.pop("num_stages")}
    names = _block_fp8_kernel.arg_names
    out = "fp32" if settings["SPLIT_K"] > 1 else x
    signature = {name: "i32" for name in names}
    signature |= {"x": "*fp8e4nv" if a8 else f"*{x}", "xs": "*fp32", "w": "*fp8e4nv"}
    signature |= {"s": "*fp32", "y": f"*{out}"}
    constants = {**settings, "A8": a8, "SCALE_COLS": block, "PRECISION": "tf32"}
    signature |= dict.fromkeys(constants, "constexpr")
    aligned = [n for n in names if n not in constants and n != "M"]
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    source = ASTSource(_block_fp8_kernel, signature, constexprs=constants, attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)


def plans_of_qwen3_8b() -> list:
    """The distinct kernel variants ``plan`` picks for Qwen3-8B at 1-4096 rows."""
    found = {}
    for n, k in QWEN3_8B.values():
        for rows in (1, 16, 40, 64, 256, 4096):
            p = plan(rows, n, k, 128, H200)
            found.setdefault(tuple(sorted(p.items())), pytest.param(p, id=f"{rows}x{n}x{k}"))
    return list(found.values())


@compiles
@pytest.mark.parametrize("settings", plans_of_qwen3_8b())
def test_the_planned_kernels_compile_for_hopper(settings, tmp_path):
    kernel = compiled(settings, "bf16", 128)
    ptx, ttgir = kernel.asm["ptx"], kernel.asm["ttgir"]
    if settings["A8"]:
        assert re.search(r"wgmma\.mma_async\.sync\.aligned\.m64n\d+k32\.f32\.e4m3\.e4m3", ptx)
    assert "async_copy_global_to_local" in ttgir  # (the loads are pipelined)
    (tmp_path / "kernel.ptx").write_text(ptx)
    ptxas = triton.knobs.nvidia.ptxas.path
    report = subprocess.run(
        [ptxas, "-arch=sm_90a", "-v", tmp_path / "kernel.ptx", "-o", tmp_path / "kernel.cubin"],
        capture_output=True,
        text=True,
        check=True,
    ).stderr
    assert re.search(r"\b0 bytes spill stores", report), report


@compiles
def test_the_split_sum_compiles_for_hopper():
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = {"parts": "*fp32", "y": "*bf16", "size": "i32"}
    signature |= {"SPLIT_K": "constexpr", "BLOCK": "constexpr"}
    source = ASTSource(_sum_splits_kernel, signature, constexprs={"SPLIT_K": 6, "BLOCK": 1024})
    triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})


@pytest.mark.gpu
@needs_fp8_gpu
@pytest.mark.parametrize("k", [4096, 1000])  # (1000: the last block is partial)
@pytest.mark.parametrize("m", [1, 7, 16, 64, 200, 4096])
def test_the_planned_product_matches_the_reference_and_replays_in_a_cuda_graph(m, k):
    """bf16 activations against float64 of the same rounded activations (W8A8's: torch's
    rounding, which the kernel's equals bit for bit) times the dequantized weight."""
    g = torch.Generator().manual_seed(m + k)
    n = 768
    w8, scales = weights(n, k, 128, g)
    x = torch.randn(m, k, generator=g).to(DEVICE, torch.bfloat16)
    y = block_fp8_matmul(x, w8, scales, 128)
    if plan(m, n, k, 128, torch.cuda.get_device_properties(0).multi_processor_count)["A8"]:
        q, q_scales = round_per_token_group(x, 128)
        x_used = q.double() * spread(q_scales, 128, k)
    else:
        x_used = x.double()
    want = x_used @ (w8.double() * spread(scales, 128, k)).t()
    assert relative_error(y, want) < 1e-2
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = block_fp8_matmul(x, w8, scales, 128)
    x.copy_(torch.randn(m, k, generator=g))
    graph.replay()
    assert torch.equal(replayed, block_fp8_matmul(x, w8, scales, 128))


@pytest.mark.gpu
@needs_fp8_gpu
@pytest.mark.parametrize("m", [1, 16, 17, 200])
def test_scaled_mm_matches_the_cpus_arithmetic(m):
    """From WIDEN_ROWS + 1 rows: the CPU's arithmetic (activations rounded per token); up to
    it the weight is widened and the activations kept: float64 of the bf16 activations."""
    from nano_models.layers.linear import ReplicatedLinear
    from nano_models.quantization import WIDEN_ROWS, ChannelFp8

    g = torch.Generator().manual_seed(m)
    layer = ReplicatedLinear(256, 512, bias=True)
    w = torch.randn(512, 256, generator=g) / 16
    scale = w.abs().amax(dim=1) / 448
    layer.weight = torch.nn.Parameter((w / scale[:, None]).to(torch.float8_e4m3fn), False)
    layer.weight_scale = torch.nn.Parameter(scale, False)
    layer.bias.data = torch.randn(512, generator=g)
    layer.quant = ChannelFp8()
    x = torch.randn(m, 256, generator=g)
    cpu = layer(x.bfloat16()).float()  # (the CPU: float32 arithmetic, rounded to bf16)
    if m > WIDEN_ROWS:
        want = cpu
    else:
        w64 = layer.weight.double() * scale.double()[:, None]
        want = (x.bfloat16().double() @ w64.t() + layer.bias.double()).bfloat16().float()
    got = layer.to("cuda")(x.to("cuda", torch.bfloat16)).float().cpu()
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
    if m <= WIDEN_ROWS:  # (closer than with the activations rounded)
        assert (got - want).abs().max() < 0.5 * (cpu - want).abs().max()
