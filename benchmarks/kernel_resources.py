"""Registers, spills and shared memory of the prefill kernel's variants, compiled for Hopper
(sm_90a) without a GPU: Triton lowers the kernel to PTX and its bundled ptxas reports what the
GPU would run. Occupancy follows: a multiprocessor has 64k registers and 227 KiB of shared
memory. Qwen3-0.6B's shape (16 query heads, 8 KV heads, head_dim 128, bf16).

    python benchmarks/kernel_resources.py
"""

from __future__ import annotations

import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from nano_kvcache.attention import _prefill_kernel

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
            signature[name] = "fp32" if name == "scale_log2" else "i32"
    names = _prefill_kernel.arg_names
    source = ASTSource(
        _prefill_kernel, signature, constexprs={(names.index(k),): v for k, v in constants.items()}
    )
    kernel = triton.compile(
        source,
        target=GPUTarget("cuda", 90, 32),
        options={"num_warps": num_warps, "num_stages": num_stages},
    )
    ptxas = triton.knobs.nvidia.ptxas.path
    with tempfile.TemporaryDirectory() as tmp:
        with open(f"{tmp}/kernel.ptx", "w") as f:
            f.write(kernel.asm["ptx"])
        report = subprocess.run(
            [ptxas, "-arch=sm_90a", "-v", f"{tmp}/kernel.ptx", "-o", f"{tmp}/kernel.cubin"],
            capture_output=True,
            text=True,
            check=True,
        ).stderr
    return {
        "shared_kib": kernel.metadata.shared // 1024,
        "registers": int(re.search(r"Used (\d+) registers", report).group(1)),
        "spilled_bytes": int(re.search(r"(\d+) bytes spill stores", report).group(1)),
    }


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


if __name__ == "__main__":
    main()
