"""The MoE kernels compile for Hopper (sm_90a) without a GPU, in every way they take e4m3
experts (FP8 weights) and bf16 ones: the variants a GPU-less CI would otherwise first see on
a GPU (Triton's interpreter runs the Python, not the compiler). Each is lowered to PTX and
assembled by Triton's ptxas; e4m3 weights are widened by the hardware's conversion."""

from __future__ import annotations

import os
import subprocess

import pytest

triton = pytest.importorskip("triton")
torch = pytest.importorskip("torch")

from nano_models.layers.moe_rows import _down_rows, _gate_up_rows, launch_tiles  # noqa: E402
from nano_models.layers.moe_tiles import choose  # noqa: E402
from nano_models.layers.moe_triton import _grouped_gemm  # noqa: E402

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") == "1", reason="Triton's interpreter replaces the kernels"
)
# (SCALING, SCALE_BLOCK): bf16; a scale a row; a row and 128-column block; blocks of 48
SCALINGS = [(0, 0), (1, 2048), (2, 128), (3, 48)]


def assembled(kernel, pointers: dict, constants: dict, options: dict, tmp_path) -> str:
    """The kernel's PTX for sm_90a, after ptxas assembled it."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = kernel.arg_names
    signature = {n: "constexpr" if n in constants else pointers.get(n, "i32") for n in names}
    constexprs = {(names.index(k),): v for k, v in constants.items()}
    source = ASTSource(kernel, signature, constexprs=constexprs)
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
    ptx = compiled.asm["ptx"]
    (tmp_path / "kernel.ptx").write_text(ptx)
    subprocess.run(
        [triton.knobs.nvidia.ptxas.path, "-arch=sm_90a", tmp_path / "kernel.ptx",
         "-o", tmp_path / "kernel.cubin"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    return ptx


def weight_type(scaling: int, pack: int = 1) -> str:
    return "*bf16" if not scaling else ("*i32" if pack == 4 else "*fp8e4nv")


@pytest.mark.parametrize("tokens", [16, 256, 1024])
@pytest.mark.parametrize("gated", [True, False], ids=["gate_up", "down"])
@pytest.mark.parametrize("scaling,block", SCALINGS)
def test_the_grouped_gemms_compile(scaling, block, gated, tokens, tmp_path):
    """At the tiles Qwen3-30B-A3B's layer takes (``moe_tiles.choose``)."""
    tile = dict(choose(tokens, 128, 768, 2048, 8, torch.bfloat16)[0 if gated else 1])
    options = {"num_warps": tile.pop("num_warps"), "num_stages": tile.pop("num_stages")}
    if gated:  # (as grouped_gemm launches it: BLOCK_N rows, half gate and half up)
        tile["BLOCK_N"] //= 2
    pointers = {"a": "*bf16", "b": weight_type(scaling), "c": "*bf16", "weights": "*bf16"}
    pointers |= {"sorted_pairs": "*i32", "tile_experts": "*i32", "used": "*i32"}
    pointers["b_scale"] = "*fp32" if scaling else "*bf16"
    constants = {"PAIRS_PER_ROW": 8 if gated else 1, "GATED": gated, "MUL_WEIGHTS": not gated}
    constants |= {"PRECISION": "tf32", "SCALE_BLOCK": block, "SCALING": scaling, **tile}
    ptx = assembled(_grouped_gemm, pointers, constants, options, tmp_path)
    assert "mma" in ptx  # (the products on tensor cores)
    assert ("cvt.rn.f16x2.e4m3x2" in ptx) == bool(scaling)


@pytest.mark.parametrize("pack", [1, 4], ids=["values", "words"])
@pytest.mark.parametrize("scaling,block", SCALINGS)
def test_the_few_token_kernels_compile(scaling, block, pack, tmp_path):
    """At the tiles Qwen3-30B-A3B's layer takes (``moe_rows.launch_tiles``)."""
    if pack == 4 and not scaling:
        pytest.skip("bf16 experts are read as values")
    widen = {"SCALE_BLOCK": block, "SCALING": scaling, "PACK": pack, "E4M3_ASM": pack == 4}
    (up_n, up_k, up_warps), (down_n, down_k, down_warps) = launch_tiles(
        bool(scaling), 8, 768, block, block
    )
    scales = "*fp32" if scaling else "*bf16"
    up = {"x": "*bf16", "w13": weight_type(scaling, pack), "ids": "*i32", "h": "*bf16"}
    constants = {"TOP_K": 8, "BLOCK_N": up_n, "BLOCK_K": up_k, "PDL": True, **widen}
    options = {"num_warps": up_warps}
    ptx = assembled(_gate_up_rows, up | {"scales": scales}, constants, options, tmp_path)
    down = {"h": "*bf16", "w2": weight_type(scaling, pack), "weights": "*fp32", "ids": "*i32"}
    down |= {"out": "*bf16", "scales": scales}
    constants = {"TOP_K": 8, "SLOTS": 8, "BLOCK_N": down_n, "BLOCK_K": down_k, "PDL": True}
    options = {"num_warps": down_warps}
    ptx += assembled(_down_rows, down, constants | widen, options, tmp_path)
    assert ("cvt.rn.f16x2.e4m3x2" in ptx) == bool(scaling)


@pytest.mark.parametrize("route", [True, False], ids=["route", "ids"])
def test_the_parallel_alignment_compiles(route, tmp_path):
    """Its two launches at Qwen3-30B-A3B's router (128 experts, top-8), as
    ``route_align_parallel`` and ``align_parallel`` launch them."""
    from nano_models.layers.moe_routing import _count_kernel, _place_block, _place_kernel

    pointers = {"logits": "*bf16", "weights": "*bf16", "ids": "*i32", "counts": "*i32"}
    pointers["sorted_pairs"] = "*i32"
    block_t = 4 if route else 1
    constants = {"ROUTE": route, "TOP_K": 8 if route else 1, "RENORMALIZE": True}
    constants |= {"BLOCK_T": block_t, "BLOCK_K": 8 if route else 1, "BLOCK_E": 128}
    block = {"BLOCK": _place_block(128)}
    warps = {"num_warps": 2 if route else 4}
    ptx = assembled(_count_kernel, pointers, constants | block, warps, tmp_path)
    assert "atom.global" in ptx or "red.global" in ptx
    pointers = {n: "*i32" for n in ("ids", "counts", "sorted_pairs", "tile_experts", "used")}
    constants = {"BLOCK_M": 16, "BLOCK_E": 128, **block}
    ptx = assembled(_place_kernel, pointers, constants, {"num_warps": 4}, tmp_path)
    assert "atom.global" in ptx
