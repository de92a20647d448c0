"""Tile settings of the fused MoE launches (``moe_triton``), by problem shape.

``MEASURED`` holds, per (experts, intermediate size per rank, hidden size, top-k, dtype), the
fastest settings ``benchmarks/tune_moe.py`` found on an H200 for a list of token counts, each
entry good up to its count; a shape that is not there takes ``rule``'s settings. A setting is
(BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages), for the gate/up launch then the
down launch; BLOCK_N counts the weight rows a program reads (in the gate/up launch half are gate
rows and half up rows, for BLOCK_N / 2 outputs).
"""

from __future__ import annotations

import torch

Tile = tuple[int, int, int, int, int, int]

# (experts, intermediate, hidden, top_k, dtype) -> [(up to tokens, up tile, down tile), ...]
MEASURED: dict[tuple[int, int, int, int, str], list[tuple[int, Tile, Tile]]] = {
    (128, 768, 2048, 8, "bfloat16"): [
        (1, (16, 128, 128, 1, 4, 4), (16, 64, 64, 1, 4, 5)),
        (8, (16, 64, 128, 1, 4, 3), (16, 64, 128, 1, 4, 3)),
        (32, (16, 64, 128, 1, 4, 3), (16, 64, 128, 1, 4, 3)),
        (128, (16, 64, 128, 1, 4, 5), (16, 64, 128, 1, 4, 3)),
        (256, (32, 128, 128, 1, 4, 3), (32, 64, 128, 1, 4, 3)),
        (1024, (128, 128, 64, 8, 8, 3), (64, 128, 64, 8, 4, 3)),
        (4096, (128, 128, 64, 8, 8, 3), (128, 128, 64, 8, 8, 3)),
        (16384, (128, 128, 64, 8, 8, 3), (128, 128, 64, 8, 4, 3)),
    ],
}


def rule(tokens: int, top_k: int) -> tuple[Tile, Tile]:
    """Settings for a shape without measurements, by the pairs each expert gets on average
    (few: short tiles; many: the tall tiles of a dense GEMM)."""
    pairs = tokens * top_k
    if pairs <= 64:
        tile = (16, 64, 128, 1, 4, 3)
    elif pairs <= 1024:
        tile = (32, 64, 64, 8, 4, 3)
    elif pairs <= 8192:
        tile = (64, 128, 64, 8, 4, 3)
    else:
        tile = (128, 128, 64, 8, 8, 3)
    return tile, tile


def choose(
    tokens: int, experts: int, intermediate: int, hidden: int, top_k: int, dtype: torch.dtype
) -> tuple[dict, dict]:
    """The two launches' settings, as keyword arguments of the kernel."""
    measured = MEASURED.get((experts, intermediate, hidden, top_k, str(dtype).split(".")[-1]))
    if measured:
        up, down = next(((u, d) for most, u, d in measured if tokens <= most), measured[-1][1:])
    else:
        up, down = rule(tokens, top_k)
    return as_kwargs(up), as_kwargs(down)


def as_kwargs(tile: Tile) -> dict:
    block_m, block_n, block_k, group_m, warps, stages = tile
    return {
        "BLOCK_M": block_m,
        "BLOCK_N": block_n,
        "BLOCK_K": block_k,
        "GROUP_M": group_m,
        "num_warps": warps,
        "num_stages": stages,
    }
