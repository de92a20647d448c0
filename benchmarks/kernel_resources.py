"""Registers, spills and shared memory of kernel variants compiled for Hopper (sm_90a) without a
GPU: Triton lowers a kernel to PTX and its bundled ptxas reports what the GPU would run.
Occupancy follows: a multiprocessor has 64k registers and 227 KiB of shared memory. The prefill
kernel at Qwen3-0.6B's shape (16 query heads, 8 KV heads, head_dim 128, bf16); the decode
kernel as ``DecodeLaunches`` sets it up for a batch (bf16 and FP8 caches, Qwen3-0.6B's and
Qwen3-8B's heads, with the static count of its SASS instructions); the block-FP8 products as
``fp8_matmul.plan`` launches them for Qwen3-8B's layers, and the activations' rounding.

    python benchmarks/kernel_resources.py
"""

from __future__ import annotations

import re
import subprocess
import tempfile
from unittest import mock

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from nano_kvcache.attention.prefill import _prefill_kernel

TILES = ((64, 64, 4, 3), (64, 64, 4, 2), (128, 64, 4, 2), (128, 128, 8, 3))


def resources(tile: tuple[int, int, int, int], cache: str, tma: bool, block_size: int) -> dict:
    """Shared memory (KiB), registers per thread and spilled bytes of one variant."""
    block_m, block_n, num_warps, num_stages = tile
    constants = {
        "BLOCK_SIZE": block_size,
        "GROUP": 2,
        "HEAD_DIM": 128,
        "BLOCK_D": 128,
        "BLOCK_M": block_m,
        "BLOCK_N": block_n,
        "TMA": tma,
        "CACHE": cache,
        "PRECISION": "ieee",
        "FP8": False,
    }
    rows = {"q_src": block_m, "k_new": block_n, "v_new": block_n}
    if cache == "tma":
        rows |= {"k_cache": block_n, "v_cache": block_n}
    signature = {}
    for name in _prefill_kernel.arg_names:
        if name in constants:
            signature[name] = "constexpr"
        elif name in rows and (tma or name.endswith("cache")):
            signature[name] = f"tensordesc<bf16[{rows[name]},128]>"
        elif name in ("q_src", "k_new", "v_new", "k_cache", "v_cache", "out_ptr"):
            signature[name] = "*bf16"
        elif name in ("block_tables", "seq_lens", "query_start_loc"):
            signature[name] = "*i32"
        else:
            scalars = ("scale_log2", "inv_k_scale", "inv_v_scale", "v_scale")
            signature[name] = "fp32" if name in scalars else "i32"
    names = _prefill_kernel.arg_names
    source = ASTSource(
        _prefill_kernel, signature, constexprs={(names.index(k),): v for k, v in constants.items()}
    )
    return report(source, num_warps, num_stages)


def report(
    source: ASTSource, num_warps: int, num_stages: int, max_registers: int | None = None
) -> dict:
    """Shared memory (KiB), registers per thread, spilled bytes and SASS instructions (static
    count) of a compiled source."""
    options = {"num_warps": num_warps, "num_stages": num_stages}
    if max_registers:
        options["maxnreg"] = max_registers
    kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
    ptxas = triton.knobs.nvidia.ptxas.path
    nvdisasm = triton.knobs.nvidia.nvdisasm.path
    with tempfile.TemporaryDirectory() as tmp:
        with open(f"{tmp}/kernel.ptx", "w") as f:
            f.write(kernel.asm["ptx"])
        report = subprocess.run(
            [ptxas, "-arch=sm_90a", "-v", f"{tmp}/kernel.ptx", "-o", f"{tmp}/kernel.cubin"],
            capture_output=True,
            text=True,
            check=True,
        ).stderr
        sass = subprocess.run(
            [nvdisasm, "-c", f"{tmp}/kernel.cubin"], capture_output=True, text=True, check=True
        ).stdout
    return {
        "shared_kib": kernel.metadata.shared // 1024,
        "registers": int(re.search(r"Used (\d+) registers", report).group(1)),
        "spilled_bytes": int(re.search(r"(\d+) bytes spill stores", report).group(1)),
        "instructions": len(re.findall(r"^\s+/\*[0-9a-f]{4,}\*/\s", sass, re.MULTILINE)),
    }


def aligned(kernel, types: dict, constants: dict, exempt: tuple = ("M",)) -> ASTSource:
    """``kernel`` as a launch specializes it: pointers 16-byte aligned, integer arguments
    multiples of 16 except M (without it, Triton neither vectorizes nor pipelines loads), and
    none of the ``exempt`` arguments (floats, what the kernel does not specialize on)."""
    names = kernel.arg_names
    signature = {name: types.get(name, "i32") for name in names}
    signature |= dict.fromkeys(constants, "constexpr")
    attrs = {
        (names.index(name),): [["tt.divisibility", 16]]
        for name in names
        if name not in constants and name not in exempt
    }
    return ASTSource(kernel, signature, constexprs=constants, attrs=attrs)


def decode_resources(cache: str, batch: int, heads: int = 16, kv_heads: int = 8) -> dict:
    """The decode kernel as ``DecodeLaunches`` sets it up for ``batch`` sequences on an H200
    (programmatic dependent launch on, its register cap), with bf16 queries, head_dim 128 and
    16-token blocks; ``cache``: "bf16" or "fp8". Its settings are returned with the report."""
    from nano_kvcache.attention import decode

    dtype = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}[cache]
    q = torch.empty(batch, heads, 128, dtype=torch.bfloat16)
    k_cache = torch.empty(4, kv_heads, 16, 128, dtype=dtype)
    lens = torch.ones(batch, dtype=torch.int32)
    launches = decode.DecodeLaunches(torch.zeros(batch, 1, dtype=torch.int32), lens, lens)
    on_cuda = mock.patch.object(torch.Tensor, "is_cuda", property(lambda _: True))
    with on_cuda, mock.patch.object(decode, "pdl", lambda _: True):  # (as on an H200)
        launches._setup(q, k_cache, q)
    launch = launches._decode.kwargs
    names = decode._decode_kernel.arg_names
    constants = {n: launch[n] for n in names if n in launch}
    pointers = {"q_ptr": "*bf16", "out_ptr": "*bf16", "part_ml": "*fp32", "part_acc": "*fp32"}
    pointers |= dict.fromkeys(["k_cache", "v_cache"], "*fp8e4nv" if cache == "fp8" else "*bf16")
    pointers |= dict.fromkeys(["block_tables", "seq_lens", "order"], "*i32")
    types = pointers | {"scale_log2": "fp32", "v_scale": "fp32"}
    # (the step's metadata are exempt from specialization by metadata_jit)
    exempt = ("block_tables", "seq_lens", "order", "stride_bt", "scale_log2", "v_scale")
    source = aligned(decode._decode_kernel, types, constants, exempt)
    cap = launch.get("maxnreg")
    r = report(source, launch["num_warps"], launch["num_stages"], cap)
    settings = {"BLOCK_G": constants["BLOCK_G"], "BLOCK_N": constants["BLOCK_N"]}
    settings |= {"splits": constants["NUM_SPLITS"], "warps": launch["num_warps"]}
    settings |= {"stages": launch["num_stages"], "max_registers": cap}
    return r | {"settings": settings}


def decode_kernels() -> None:
    print(f"\n{'decode':>22} {'settings':>78} {'KiB':>4} {'regs':>5} {'spill':>6} {'instr':>6}")
    for cache in ("bf16", "fp8"):
        for model, heads in (("0.6B", 16), ("8B", 32)):
            for batch in (1, 32, 256):
                r = decode_resources(cache, batch, heads)
                label = f"{cache} {model} x {batch}"
                print(
                    f"{label:>22} {r['settings']!s:>78} {r['shared_kib']:4} {r['registers']:5}"
                    f" {r['spilled_bytes']:6} {r['instructions']:6}",
                    flush=True,
                )


def fp8_products() -> None:
    """The block-FP8 kernels ``plan`` launches for Qwen3-8B's layers (bf16 activations)."""
    from nano_models.layers.fp8_matmul import _block_fp8_kernel, plan
    from nano_models.layers.fp8_quant import _round_kernel, settings

    shapes = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096)}
    shapes["down"] = (4096, 12288)
    print(
        f"\n{'fp8 product':>22} {'rows':>5} {'settings':>46} {'shared KiB':>11} {'registers':>10}"
        f" {'spilled B':>10}"
    )
    for rows in (1, 16, 64, 256, 4096):
        for name, (n, k) in shapes.items():
            p = plan(rows, n, k, 128, 132)
            constants = {key: v for key, v in p.items() if not key.startswith("num_")}
            constants |= {"SCALE_COLS": 128, "PRECISION": "tf32"}
            out = "*fp32" if p["SPLIT_K"] > 1 else "*bf16"
            x = "*fp8e4nv" if p["A8"] else "*bf16"
            types = {"x": x, "xs": "*fp32", "w": "*fp8e4nv", "s": "*fp32", "y": out}
            r = report(
                aligned(_block_fp8_kernel, types, constants), p["num_warps"], p["num_stages"]
            )
            tile = (p["BLOCK_M"], p["BLOCK_N"], p["BLOCK_K"], p["num_warps"], p["num_stages"])
            label = f"{'w8a8' if p['A8'] else 'w8a16'} {tile} split {p['SPLIT_K']}"
            print(
                f"{name:>22} {rows:5} {label:>46} {r['shared_kib']:11} {r['registers']:10}"
                f" {r['spilled_bytes']:10}",
                flush=True,
            )
    for group in (128, 4096, 12288):
        launch = settings(group)
        constants = {"BLOCK": launch["BLOCK"], "ONE_PASS": launch["ONE_PASS"]}
        types = {"x": "*bf16", "q": "*fp8e4nv", "s": "*fp32"}
        r = report(aligned(_round_kernel, types, constants), launch["num_warps"], 1)
        label = f"rounding, groups of {group}"
        print(
            f"{label:>22} {'':5} {constants!s:>46} {r['shared_kib']:11} {r['registers']:10}"
            f" {r['spilled_bytes']:10}"
        )


def main() -> None:
    variants = [
        ("no cached keys", "none", True, 16),
        ("cached keys, pointers", "pointers", True, 16),
        ("cached keys, TMA (256-token blocks)", "tma", True, 256),
        ("no TMA at all (pre-Hopper path)", "pointers", False, 16),
    ]
    print(f"{'tile':>18} {'variant':>36} {'shared KiB':>11} {'registers':>10} {'spilled B':>10}")
    for tile in TILES:
        for label, cache, tma, block_size in variants:
            r = resources(tile, cache, tma, block_size)
            print(
                f"{tile!s:>18} {label:>36} {r['shared_kib']:11} {r['registers']:10} "
                f"{r['spilled_bytes']:10}",
                flush=True,
            )
    decode_kernels()
    fp8_products()


if __name__ == "__main__":
    main()
