"""Measure the fused MoE launches' tile settings on this GPU and print the fastest per token
count, as entries of ``nano_models.layers.moe_tiles.MEASURED``.

For each token count the gate/up launch and the down launch are timed apart (CUDA graphs,
median of replays) over a grid of (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps,
num_stages); settings that do not compile or run out of shared memory are skipped. The
routing is uniform random, as a trained router's is near enough for tile choice.

    python benchmarks/tune_moe.py [--tokens 1 2 4 ... 16384] [--experts 128 --intermediate 768
        --hidden 2048 --top-k 8] [--quick] [--json tiles.json]
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch
from graph_timing import replayed_us

from nano_models.layers.moe_routing import align
from nano_models.layers.moe_tiles import as_kwargs
from nano_models.layers.moe_triton import grouped_gemm

TOKENS = [1, 8, 32, 128, 256, 1024, 4096, 16384]


def grid(tokens: int, top_k: int, experts: int, quick: bool) -> list[tuple]:
    """Candidate tiles: tile heights up to about twice an expert's average share of the pairs
    (taller ones pad), widths and depths of the usual GEMM tiles."""
    share = tokens * top_k / experts
    heights = [m for m in (16, 32, 64, 128) if m == 16 or m <= 2 * share]
    if quick:
        return list(itertools.product(heights[:2], (64, 128), (64,), (8,), (4,), (3,)))
    if share <= 32:  # weight reads bound it: deep tiles and stages keep more bytes in flight
        return list(itertools.product(heights, (32, 64, 128), (64, 128), (1,), (4,), (3, 4, 5)))
    return list(itertools.product(heights[-2:], (64, 128), (64, 128), (8,), (4, 8), (3, 4)))


def time_launch(a, b, out, ids, experts, pairs_per_row, weights, gated, tile) -> float | None:
    """Median microseconds of one launch replayed in a CUDA graph."""
    try:
        kwargs = as_kwargs(tile)
        aligned = align(ids, experts, tile[0])

        def launch():
            grouped_gemm(a, b, out, aligned, pairs_per_row, weights, kwargs, gated)

        return replayed_us(launch, warmup=5, rep=25)
    except Exception:  # (too much shared memory, or registers: not a candidate here)
        torch.cuda.synchronize()
        return None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, nargs="+", default=TOKENS)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--intermediate", type=int, default=768, help="per tensor-parallel rank")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--quick", action="store_true", help="a small grid (a smoke test)")
    p.add_argument("--json")
    p.add_argument(
        "--write", action="store_true", help="put the entry into nano_models/layers/moe_tiles.py"
    )
    args = p.parse_args()
    dtype = torch.bfloat16
    e, inter, hidden, k = args.experts, args.intermediate, args.hidden, args.top_k
    w13 = torch.randn(e, 2 * inter, hidden, device="cuda").to(dtype) / 30
    w2 = torch.randn(e, hidden, inter, device="cuda").to(dtype) / 30
    entries = []
    for tokens in args.tokens:
        x = torch.randn(tokens, hidden, device="cuda").to(dtype)
        ids = torch.topk(torch.rand(tokens, e, device="cuda"), k, dim=-1).indices
        weights = torch.rand(tokens * k, device="cuda").to(dtype)
        h_out = torch.empty(tokens * k, inter, device="cuda", dtype=dtype)
        h = torch.randn(tokens * k, inter, device="cuda").to(dtype)
        down = torch.empty(tokens * k, hidden, device="cuda", dtype=dtype)
        best = []
        launches = {
            "up": (x, w13, h_out, k, None, True),  # (gate and up, SiLU-and-mul in the epilogue)
            "down": (h, w2, down, 1, weights, False),
        }
        for name, (a, b, out, pairs_per_row, scale, gated) in launches.items():
            timed = []
            for tile in grid(tokens, k, e, args.quick):
                us = time_launch(a, b, out, ids, e, pairs_per_row, scale, gated, tile)
                if us is not None:
                    timed.append((us, tile))
            us, tile = min(timed)
            best.append(tile)
            print(f"tokens {tokens:>6} {name:>4}: {us:8.1f} us  {tile}  ({len(timed)} ran)")
        entries.append((tokens, *best))
    key = (e, inter, hidden, k, "bfloat16")
    print(f"\n# moe_tiles.MEASURED entry ({torch.cuda.get_device_name()}):")
    print(f"{key!r}: [")
    for tokens, up, down in entries:
        print(f"    ({tokens}, {up!r}, {down!r}),")
    print("],")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"key": list(key), "entries": entries}, f, indent=2)
    if args.write:
        print(f"written to {write_entry(key, entries)}")


def write_entry(key: tuple, entries: list[tuple]) -> str:
    """Replace (or add) ``key``'s entry of ``moe_tiles.MEASURED`` in its source file, the other
    entries kept; returns the file's path."""
    import importlib

    from nano_models.layers import moe_tiles

    table = dict(importlib.reload(moe_tiles).MEASURED)  # (as the file holds it now)
    table[key] = [(int(t), tuple(up), tuple(down)) for t, up, down in entries]
    lines = [HEADER]
    for k in sorted(table):
        lines.append(f'    ({", ".join(map(str, k[:4]))}, "{k[4]}"): [')
        lines += [f"        ({t}, {up!r}, {down!r})," for t, up, down in table[k]]
        lines.append("    ],")
    lines.append("}")
    path = moe_tiles.__file__
    with open(path) as f:
        source = f.read()
    start = source.index(HEADER)
    end = source.index("\n}\n", start) + 2
    with open(path, "w") as f:
        f.write(source[:start] + "\n".join(lines) + source[end:])
    return path


HEADER = "MEASURED: dict[tuple[int, int, int, int, str], list[tuple[int, Tile, Tile]]] = {"


if __name__ == "__main__":
    main()
