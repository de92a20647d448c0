"""FP8 weight products on the GPU against the bf16 matmul of the same shape, in the same run.

Qwen3-8B's linear layers (qkv, o, gate/up, down) at decode and prefill row counts: bf16
``F.linear``; the block-scaled Triton kernel (e4m3 weights with 128 x 128 block scales, bf16
activations: a Qwen3-FP8 checkpoint); ``torch._scaled_mm`` with per-channel weight and
per-token activation scales, the activations' quantization included (``quantization="fp8"``).
Times are medians of CUDA-graph replays; weight bandwidth = the weight's bytes over the time.

    python benchmarks/bench_fp8_matmul.py [--rows 1 16 256 4096] [--json out.json]
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
from triton.testing import do_bench

from nano_models.layers.fp8_matmul import block_fp8_matmul
from nano_models.quantization import quantize_per_token

# Qwen3-8B: hidden 4096, 32 q heads and 8 kv heads of 128, intermediate 12288
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)}


def replayed(fn) -> float:
    """Median microseconds of fn replayed in a CUDA graph."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return do_bench(graph.replay, warmup=20, rep=100, return_mode="median") * 1e3


def run(name: str, n: int, k: int, m: int) -> dict:
    g = torch.Generator(device="cuda").manual_seed(m)
    x = torch.randn(m, k, device="cuda", generator=g).bfloat16()
    w = (torch.randn(n, k, device="cuda", generator=g) / 64).bfloat16()
    block_scales = torch.rand(n, k // 128, device="cuda", generator=g) * 1e-3
    w8 = (torch.randn(n, k, device="cuda", generator=g) * 64).to(torch.float8_e4m3fn)
    channel_scale = torch.rand(1, n, device="cuda", generator=g) * 1e-3

    def scaled():
        x8, sx = quantize_per_token(x)
        return torch._scaled_mm(
            x8, w8.t(), scale_a=sx, scale_b=channel_scale, out_dtype=torch.bfloat16
        )

    row = {"layer": name, "n": n, "k": k, "rows": m}
    for label, fn in (
        ("bf16", lambda: F.linear(x, w)),
        ("block_fp8", lambda: block_fp8_matmul(x, w8, block_scales, 128)),
        ("scaled_mm", scaled),
    ):
        us = replayed(fn)
        row[f"{label}_us"] = us
        row[f"{label}_weight_tbps"] = n * k * (2 if label == "bf16" else 1) / (us * 1e-6) / 1e12
    row["block_fp8_speedup"] = row["bf16_us"] / row["block_fp8_us"]
    row["scaled_mm_speedup"] = row["bf16_us"] / row["scaled_mm_us"]
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 16, 256, 4096])
    p.add_argument("--json")
    args = p.parse_args()
    print(torch.cuda.get_device_name())
    print(
        f"{'layer':>8} {'rows':>5} {'bf16 us':>8} {'block us':>9} {'x':>5} {'scaled us':>10} "
        f"{'x':>5} {'block TB/s':>10}"
    )
    rows = []
    for m in args.rows:
        for name, (n, k) in SHAPES.items():
            r = run(name, n, k, m)
            rows.append(r)
            print(
                f"{name:>8} {m:>5} {r['bf16_us']:>8.1f} {r['block_fp8_us']:>9.1f} "
                f"{r['block_fp8_speedup']:>5.2f} {r['scaled_mm_us']:>10.1f} "
                f"{r['scaled_mm_speedup']:>5.2f} {r['block_fp8_weight_tbps']:>10.2f}"
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
