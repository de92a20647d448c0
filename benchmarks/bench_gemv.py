"""The linear layers of a decode step of a few sequences: cuBLAS (``F.linear``) against the
Triton few-row product (``nano_models.layers.gemv``) with and without programmatic dependent
launch, at Qwen3-0.6B's, Qwen3-8B's and Qwen3-30B-A3B's shapes. Each is timed as a decode
graph runs it: LAYERS copies of the weight (cold: read from memory, as layer after layer
reads them) called in turn inside one CUDA graph; microseconds per call, and the weights'
bytes over that time.

With --fp8, e4m3 weights instead: ``gemv`` with a scale a row (``quantization="fp8"``) and
with 128 x 128 scale blocks (FP8 checkpoints), against the FP8 product the layers took before
(``block_fp8_matmul``: split-K W8A16) and against bf16 ``gemv`` of the same shape.

    python benchmarks/bench_gemv.py [--rows 1 2 4 8] [--fp8] [--max-tile BYTES]
        [--max-slice COLUMNS] [--json F]
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
from graph_timing import replayed_us

from nano_kvcache import launch
from nano_models.layers import gemv as gemv_module
from nano_models.layers.fp8_matmul import block_fp8_matmul
from nano_models.layers.gemv import Scales, gemv

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
    ("Qwen3-0.6B", "lm_head", 151936, 1024),
    ("Qwen3-8B", "lm_head", 151936, 4096),
]


def timed(fn, x: torch.Tensor, weights: list[torch.Tensor]) -> float:
    """Microseconds per call of fn(x, w) over the weights in turn, replayed in a CUDA graph."""
    return replayed_us(lambda: [fn(x, w) for w in weights], 10, 50) / len(weights)


def fp8_rows(shapes, rows_list) -> list[dict]:
    """e4m3 weights: gemv (a scale a row; 128 x 128 blocks), the FP8 product before, bf16."""
    print(
        f"{'model':>14} {'layer':>8} {'N x K':>13} {'rows':>4} {'bf16 gemv':>9} "
        f"{'old row':>8} {'gemv row':>8} {'TB/s':>5} {'old block':>9} {'gemv block':>10} "
        f"{'TB/s':>5} {'vs bf16':>7}"
    )
    results = []
    for model, layer, n, k in shapes:
        if k % 128:
            continue
        dense = [(torch.randn(n, k, device="cuda") / k**0.5) for _ in range(LAYERS)]
        bf16 = [w.to(torch.bfloat16) for w in dense]
        e4m3 = [(w * 448 / w.abs().max()).to(torch.float8_e4m3fn) for w in dense]
        rows_scales = [torch.rand(n, 1, device="cuda") * 1e-3 for _ in range(LAYERS)]
        block_scales = [torch.rand(n, k // 128, device="cuda") * 1e-3 for _ in range(LAYERS)]
        row_pairs = list(zip(e4m3, rows_scales, strict=True))
        block_pairs = list(zip(e4m3, block_scales, strict=True))
        for rows in rows_list:
            x = torch.randn(rows, k, device="cuda").to(torch.bfloat16)
            row = dict(model=model, layer=layer, n=n, k=k, rows=rows)
            row["bf16_gemv_us"] = timed(gemv, x, bf16)
            row["old_row_us"] = timed(
                lambda x, p, k=k: block_fp8_matmul(x, p[0], p[1], k), x, row_pairs
            )
            row["gemv_row_us"] = timed(
                lambda x, p, k=k: gemv(x, p[0], None, Scales(p[1], k)), x, row_pairs
            )
            row["old_block_us"] = timed(
                lambda x, p: block_fp8_matmul(x, p[0], p[1], 128), x, block_pairs
            )
            row["gemv_block_us"] = timed(
                lambda x, p: gemv(x, p[0], None, Scales(p[1], 128)), x, block_pairs
            )
            for kind in ("row", "block"):
                row[f"gemv_{kind}_tbps"] = n * k / (row[f"gemv_{kind}_us"] * 1e-6) / 1e12
            results.append(row)
            print(
                f"{model:>14} {layer:>8} {f'{n}x{k}':>13} {rows:>4} {row['bf16_gemv_us']:9.1f} "
                f"{row['old_row_us']:8.1f} {row['gemv_row_us']:8.1f} {row['gemv_row_tbps']:5.2f} "
                f"{row['old_block_us']:9.1f} {row['gemv_block_us']:10.1f} "
                f"{row['gemv_block_tbps']:5.2f} {row['bf16_gemv_us'] / row['gemv_row_us']:6.2f}x",
                flush=True,
            )
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--fp8", action="store_true", help="e4m3 weights with scales")
    p.add_argument("--max-tile", type=int, help="gemv's tile bytes (default: its MAX_TILE)")
    p.add_argument("--max-slice", type=int, help="gemv's slice columns (default: MAX_SLICE)")
    p.add_argument("--json")
    args = p.parse_args()
    if args.max_tile:
        gemv_module.MAX_TILE = args.max_tile
    if args.max_slice:
        gemv_module.MAX_SLICE = args.max_slice
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    if args.fp8:
        results = fp8_rows(SHAPES, args.rows)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1)
        return
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
