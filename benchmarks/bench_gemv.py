"""The linear layers of a decode step of a few sequences: cuBLAS (``F.linear``) against the
Triton few-row product (``nano_models.layers.gemv``) with and without programmatic dependent
launch, at Qwen3-0.6B's, Qwen3-8B's and Qwen3-30B-A3B's shapes. Each is timed as a decode
graph runs it: LAYERS copies of the weight (cold: read from memory, as layer after layer
reads them) called in turn inside one CUDA graph; microseconds per call, and the weights'
bytes over that time.

    python benchmarks/bench_gemv.py [--rows 1 2 4 8] [--json out.json]
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
from graph_timing import replayed_us

from nano_kvcache import launch
from nano_models.layers.gemv import gemv

LAYERS = 8
SHAPES = [  # model, layer, N (outputs), K (inputs)
    ("Qwen3-0.6B", "qkv", 4096, 1024),
    ("Qwen3-0.6B", "o", 1024, 2048),
    ("Qwen3-0.6B", "gate_up", 6144, 1024),
    ("Qwen3-0.6B", "down", 1024, 3072),
    ("Qwen3-8B", "qkv", 6144, 4096),
    ("Qwen3-8B", "o", 4096, 4096),
    ("Qwen3-8B", "gate_up", 24576, 4096),
    ("Qwen3-8B", "down", 4096, 12288),
    ("Qwen3-30B-A3B", "qkv", 5120, 2048),
    ("Qwen3-30B-A3B", "o", 2048, 4096),
    ("Qwen3-30B-A3B", "router", 128, 2048),
]


def timed(fn, x: torch.Tensor, weights: list[torch.Tensor]) -> float:
    """Microseconds per call of fn(x, w) over the weights in turn, replayed in a CUDA graph."""
    return replayed_us(lambda: [fn(x, w) for w in weights], 10, 50) / len(weights)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--json")
    args = p.parse_args()
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    print(
        f"{'model':>14} {'layer':>8} {'N x K':>13} {'rows':>4} {'cuBLAS us':>10} "
        f"{'gemv us':>8} {'TB/s':>5} {'no PDL us':>10} {'speed-up':>8}"
    )
    results = []
    for model, layer, n, k in SHAPES:
        weights = [
            (torch.randn(n, k, device="cuda") / k**0.5).to(torch.bfloat16) for _ in range(LAYERS)
        ]
        for rows in args.rows:
            x = torch.randn(rows, k, device="cuda").to(torch.bfloat16)
            cublas = timed(F.linear, x, weights)
            ours = timed(gemv, x, weights)
            launch.ENABLED = False
            try:
                no_pdl = timed(gemv, x, weights)
            finally:
                launch.ENABLED = True
            row = dict(
                model=model,
                layer=layer,
                n=n,
                k=k,
                rows=rows,
                cublas_us=cublas,
                gemv_us=ours,
                gemv_no_pdl_us=no_pdl,
                gemv_tbps=n * k * 2 / (ours * 1e-6) / 1e12,
            )
            results.append(row)
            print(
                f"{model:>14} {layer:>8} {f'{n}x{k}':>13} {rows:>4} {cublas:10.1f} {ours:8.1f} "
                f"{row['gemv_tbps']:5.2f} {no_pdl:10.1f} {cublas / ours:7.2f}x",
                flush=True,
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
