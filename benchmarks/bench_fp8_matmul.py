"""FP8 weight products on the GPU against the bf16 matmul of the same shape, in the same run.

Qwen3-8B's linear layers (qkv, o, gate/up, down) at decode and prefill row counts: bf16
``F.linear``; block-scaled e4m3 weights with 128 x 128 block scales and bf16 activations (a
Qwen3-FP8 checkpoint): the first kernel's tiles (W8A16, no split K loop: "old"), the W8A16
kernel as ``plan`` tiles and splits it, and W8A8 (the activations rounded per token and block,
FP8 tensor cores; the rounding's launch included); the path ``plan`` takes at that row count
is the speedup's ("x"). Per-channel weights with per-token activations (``quantization="fp8"``):
``torch._scaled_mm`` after the torch rounding ("old") and after the one-launch Triton rounding.
Times are medians of CUDA-graph replays; weight bandwidth = the weight's bytes over the time.
``--sweep`` also times other splits and W8A8 tiles and prints the fastest settings.

    python benchmarks/bench_fp8_matmul.py [--rows 1 16 64 256 4096] [--sweep] [--json out.json]
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
from graph_timing import replayed_us

from nano_models import quantization
from nano_models.layers.fp8_matmul import block_fp8_matmul, plan
from nano_models.layers.fp8_quant import round_per_token

# Qwen3-8B: hidden 4096, 32 q heads and 8 kv heads of 128, intermediate 12288
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)}
A8_TILES = [(64, 64, 128, 4, 4), (64, 128, 128, 4, 4), (128, 128, 64, 8, 4), (128, 128, 128, 8, 3)]


def old_tile(m: int) -> dict:
    """The W8A16 kernel's tiles of the first GPU run (RESULTS.md), without a split."""
    if m <= 16:
        tile = {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "GROUP_M": 1, "num_warps": 4}
    elif m <= 128:
        tile = {"BLOCK_M": 32, "BLOCK_N": 128, "BLOCK_K": 128, "GROUP_M": 8, "num_warps": 4}
    else:
        tile = {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 8}
    return {"A8": False, **tile, "num_stages": 3, "SPLIT_K": 1}


def neighbours(planned: dict, m: int, n: int, k: int) -> list[dict]:
    """Settings near the planned ones: both paths, other W8A8 tiles, other splits (their
    float32 partial sums under 256 MiB)."""
    w8a8 = {**planned, "A8": True}
    tiles = [{**planned, "A8": False}, w8a8]
    for bm, bn, bk, warps, stages in A8_TILES:
        tiles.append({**w8a8, "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk})
        tiles[-1] |= {"num_warps": warps, "num_stages": stages}
    variants = []
    for tile in tiles:
        k_tiles = -(-k // tile["BLOCK_K"])
        for split in sorted({1, 2, 4, 8, 16, planned["SPLIT_K"]}):
            if split <= max(1, k_tiles // 2) and (split == 1 or split * m * n * 4 <= 2**28):
                variants.append({**tile, "SPLIT_K": split})
    return variants


def fastest(x, w8, scales, planned: dict) -> tuple[float, dict]:
    """The fastest of the planned settings' neighbours, and its time."""
    timed = [
        (replayed_us(lambda s=settings: block_fp8_matmul(x, w8, scales, 128, s)), settings)
        for settings in neighbours(planned, x.shape[0], w8.shape[0], x.shape[1])
    ]
    return min(timed, key=lambda t: t[0])


def run(name: str, n: int, k: int, m: int, multiprocessors: int, search: bool) -> dict:
    g = torch.Generator(device="cuda").manual_seed(m)
    x = torch.randn(m, k, device="cuda", generator=g).bfloat16()
    w = (torch.randn(n, k, device="cuda", generator=g) / 64).bfloat16()
    block_scales = torch.rand(n, k // 128, device="cuda", generator=g) * 1e-3
    w8 = (torch.randn(n, k, device="cuda", generator=g) * 64).to(torch.float8_e4m3fn)
    channel_scale = torch.rand(1, n, device="cuda", generator=g) * 1e-3
    planned = plan(m, n, k, 128, multiprocessors)

    def scaled(rounding):
        x8, sx = rounding(x)
        return torch._scaled_mm(
            x8, w8.t(), scale_a=sx, scale_b=channel_scale, out_dtype=torch.bfloat16
        )

    row = {"layer": name, "n": n, "k": k, "rows": m, "plan": planned}
    for label, fn in (
        ("bf16", lambda: F.linear(x, w)),
        ("block_old", lambda: block_fp8_matmul(x, w8, block_scales, 128, old_tile(m))),
        ("w8a16", lambda: block_fp8_matmul(x, w8, block_scales, 128, {**planned, "A8": False})),
        ("w8a8", lambda: block_fp8_matmul(x, w8, block_scales, 128, {**planned, "A8": True})),
        ("scaled_old", lambda: scaled(quantization.round_per_token)),
        ("scaled", lambda: scaled(round_per_token)),
    ):
        us = replayed_us(fn)
        row[f"{label}_us"] = us
        row[f"{label}_weight_tbps"] = n * k * (2 if label == "bf16" else 1) / (us * 1e-6) / 1e12
    row["block_us"] = row["w8a8_us" if planned["A8"] else "w8a16_us"]
    row["block_speedup"] = row["bf16_us"] / row["block_us"]
    row["scaled_speedup"] = row["bf16_us"] / row["scaled_us"]
    if search:
        row["best_us"], row["best"] = fastest(x, w8, block_scales, planned)
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64, 256, 4096])
    p.add_argument("--sweep", action="store_true", help="time other splits and W8A8 tiles")
    p.add_argument("--json")
    args = p.parse_args()
    print(torch.cuda.get_device_name())
    multiprocessors = torch.cuda.get_device_properties(0).multi_processor_count
    print(
        f"{'layer':>8} {'rows':>5} {'bf16 us':>8} {'old blk':>8} {'w8a16 us':>9} "
        f"{'w8a8 us':>8} {'plan':>5} {'x':>5} {'old scl':>8} {'scaled us':>10} {'x':>5} "
        f"{'block TB/s':>10}"
    )
    rows = []
    for m in args.rows:
        for name, (n, k) in SHAPES.items():
            r = run(name, n, k, m, multiprocessors, args.sweep)
            rows.append(r)
            path = "w8a8" if r["plan"]["A8"] else "w8a16"
            print(
                f"{name:>8} {m:>5} {r['bf16_us']:>8.1f} {r['block_old_us']:>8.1f} "
                f"{r['w8a16_us']:>9.1f} {r['w8a8_us']:>8.1f} {path:>5} "
                f"{r['block_speedup']:>5.2f} {r['scaled_old_us']:>8.1f} {r['scaled_us']:>10.1f} "
                f"{r['scaled_speedup']:>5.2f} {n * k / (r['block_us'] * 1e-6) / 1e12:>10.2f}"
            )
            if args.sweep:
                print(f"{'':>14} fastest {r['best_us']:.1f} us: {r['best']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
