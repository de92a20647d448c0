"""The fused MoE layer on the GPU against reading its touched experts' weights at the copy
bandwidth, in the same run, and against the torch experts.

Qwen3-30B-A3B's shapes by default (2048 hidden, 768 expert intermediate, 128 experts, top-8,
bf16). For each batch size: the experts the routing touches (uniform random scores, so about
E (1 - (1 - k/E)^T) of them), their weight bytes (gate, up and down), the copy time of as many
bytes (a device-to-device copy measured here), the fused layer's time replayed in a CUDA graph
(router, routing and experts, as a decode step runs it; at most ``ONE_PROGRAM_PAIRS`` pairs the
routing and alignment are one program), the torch path's time (eager), and the routing with the
pairs' alignment, and the alignment alone, in torch's ops, in one Triton program and in the
parallel launches (in graphs). ``--torch-align``: the layer takes torch's ops past
``ONE_PROGRAM_PAIRS`` pairs, as before the parallel launches (``moe_routing.PARALLEL_ALIGN``);
``--one-program-pairs N`` sets ``ONE_PROGRAM_PAIRS``.
Up to 16 tokens also the two ways apart: the grouped GEMMs (``moe_triton``) and the products row
by row (``moe_rows``, which ``routed_moe`` takes up to ``ROWS_TOKENS`` tokens).

    python benchmarks/bench_moe.py [--batch 1 32 256] [--fp8 block|row] [--torch-align]
        [--one-program-pairs N] [--json out.json]
        # --fp8: the experts in e4m3 with scales a row and 128-column block (an FP8
        # checkpoint's) or a row (-q fp8's), their bytes counted as e4m3 and float32 scales
    python benchmarks/bench_moe.py --sweep-rows [--batch 1 4]   # moe_rows' tiles, each launch,
        # over 8 layers of cold experts (~10 GB at Qwen3-30B-A3B's shapes)
"""

from __future__ import annotations

import argparse
import json

import torch
from graph_timing import replayed_us
from triton.testing import do_bench

from nano_models.layers import moe_routing
from nano_models.layers.moe import ExpertScales, moe_torch, route
from nano_models.layers.moe_routing import (
    align_parallel,
    align_torch,
    align_triton,
    route_align_parallel,
    route_align_triton,
    route_triton,
)
from nano_models.layers.moe_rows import moe_rows, routed_moe_rows
from nano_models.layers.moe_triton import _tiles, routed_moe

ROWS_CANDIDATES = [
    (n, k, w)
    for n in (1, 2, 4, 8, 16)
    for k in (128, 256, 512, 1024, 2048)
    for w in (2, 4, 8)
    if 256 <= n * k <= 16384
]


def copy_bandwidth(nbytes: int = 1 << 30) -> float:
    """Bytes per second a device-to-device copy moves, reads and writes counted (the traffic
    the memory sustains; the MoE layer's traffic is almost all weight reads)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=20, rep=200, return_mode="median")
    return 2 * nbytes / (ms * 1e-3)


def e4m3(w: torch.Tensor, block: int) -> tuple[torch.Tensor, ExpertScales]:
    """w [E, N, K] in e4m3 with a float32 scale a row and block of columns (max|w| / 448)."""
    e, n, k = w.shape
    blocks = -(-k // block)
    padded = torch.nn.functional.pad(w.float(), (0, blocks * block - k))
    scale = (padded.view(e, n, blocks, block).abs().amax(dim=-1) / 448).clamp(min=1e-12)
    full = scale.repeat_interleave(block, dim=-1)[..., :k]
    return (w.float() / full).to(torch.float8_e4m3fn), ExpertScales(scale, block)


def run(
    batch: int, experts: int, inter: int, hidden: int, top_k: int, dtype, bandwidth, fp8=None
) -> dict:
    g = torch.Generator(device="cuda").manual_seed(batch)
    x = torch.randn(batch, hidden, device="cuda", generator=g).to(dtype)
    router = torch.randn(hidden, experts, device="cuda", generator=g).to(dtype) / hidden**0.5
    w13 = (torch.randn(experts, 2 * inter, hidden, device="cuda", generator=g) / 30).to(dtype)
    w2 = (torch.randn(experts, hidden, inter, device="cuda", generator=g) / 30).to(dtype)
    scales = None
    if fp8 is not None:  # ("block": 128 columns; "row": a scale a row)
        (w13, s13), (w2, s2) = (e4m3(w, 128 if fp8 == "block" else w.shape[2]) for w in (w13, w2))
        scales = (s13, s2)

    def layer():
        return routed_moe(x, x @ router, w13, w2, top_k, True, scales=scales)

    weights, ids = route(x @ router, top_k, True, dtype)
    touched = int(torch.unique(ids).numel())
    expert_bytes = 3 * inter * hidden * w13.element_size()
    if scales is not None:
        expert_bytes += sum(s.values[0].numel() * 4 for s in scales)
    nbytes = touched * expert_bytes
    fused_us = replayed_us(layer, rep=200)
    torch_ms = do_bench(
        lambda: moe_torch(x, w13, w2, weights, ids, scales=scales),
        warmup=5,
        rep=50,
        return_mode="median",
    )
    copy_us = nbytes / bandwidth * 1e6
    both = {}
    if batch <= 16:  # (the two ways apart)
        tiles = _tiles(x, w13, top_k)
        both = {
            "grouped_us": replayed_us(
                lambda: routed_moe(x, x @ router, w13, w2, top_k, True, tiles, scales), rep=200
            ),
            "rows_us": replayed_us(
                lambda: routed_moe_rows(x, x @ router, w13, w2, top_k, True, scales=scales),
                rep=200,
            ),
        }
    # The routing and the pairs' alignment alone, both ways (moe_routing.ONE_PROGRAM_PAIRS
    # picks between them), and the alignment alone.
    logits = x @ router
    ways = {
        "route_align_torch": lambda: align_torch(route(logits, top_k, True, dtype)[1], experts, 16),
        "route_align_triton": lambda: route_align_triton(logits, top_k, True, dtype, 16),
        "route_align_parallel": lambda: route_align_parallel(logits, top_k, True, dtype, 16),
        "align_torch": lambda: align_torch(ids, experts, 16),
        "align_triton": lambda: align_triton(ids, experts, 16),
        "align_parallel": lambda: align_parallel(ids, experts, 16),
        "route_triton": lambda: route_triton(logits, top_k, True, dtype),
    }
    align_us = {name: replayed_us(fn) for name, fn in ways.items()}
    return {
        "batch": batch,
        "experts_touched": touched,
        "weight_bytes": nbytes,
        "copy_us": copy_us,
        "fused_us": fused_us,
        "fused_tbps": nbytes / (fused_us * 1e-6) / 1e12,
        "fused_vs_copy": copy_us / fused_us,
        "torch_us": torch_ms * 1e3,
        **{f"{name}_us": us for name, us in align_us.items()},
        **both,
    }


def sweep_rows(
    batch: int,
    experts: int,
    inter: int,
    hidden: int,
    top_k: int,
    dtype,
    layers: int = 8,
    fp8: str | None = None,
) -> dict:
    """``moe_rows``' two launches over ``ROWS_CANDIDATES`` (BLOCK_N, BLOCK_K, num_warps): the
    gate/up launch's tiles under the default down tile, then the down launch's under the best
    gate/up tile; microseconds a layer of the whole (routing given), ``layers`` layers of
    their own experts replayed in one CUDA graph, so that each reads its experts from memory
    as a model does (one layer replayed alone finds part of them in L2: there the down launch
    in whole rows of 1,024 by four warps looked fastest; in the model, slices of 256 by two
    are, 24.6 against 25.5 us at Qwen3-30B-A3B's shapes and one token). ``fp8``: the experts
    in e4m3, as ``run``'s (the defaults then are the e4m3 tiles)."""
    from nano_models.layers.moe_rows import DOWN_TILE, DOWN_TILE_E4M3

    g = torch.Generator(device="cuda").manual_seed(batch)
    x = torch.randn(batch, hidden, device="cuda", generator=g).to(dtype)
    stack = []
    for _ in range(layers):
        w13 = (torch.randn(experts, 2 * inter, hidden, device="cuda", generator=g) / 30).to(dtype)
        w2 = (torch.randn(experts, hidden, inter, device="cuda", generator=g) / 30).to(dtype)
        logits = torch.randn(batch, experts, device="cuda", generator=g)
        weights, ids = route(logits, top_k, True, dtype)
        scales = None
        if fp8 is not None:
            (w13, s13), (w2, s2) = (
                e4m3(w, 128 if fp8 == "block" else w.shape[2]) for w in (w13, w2)
            )
            scales = (s13, s2)
        stack.append((w13, w2, weights, ids.int(), scales))

    def timed(up, down) -> float:
        def step():
            for w13, w2, weights, ids, scales in stack:
                moe_rows(x, w13, w2, weights, ids, up, down, scales)

        return replayed_us(step, 5, 20) / layers

    up = {
        tile: timed(tile, DOWN_TILE if fp8 is None else DOWN_TILE_E4M3) for tile in ROWS_CANDIDATES
    }
    best_up = min(up, key=up.get)
    down = {tile: timed(best_up, tile) for tile in ROWS_CANDIDATES}
    best_down = min(down, key=down.get)
    return {
        "batch": batch,
        "layers": layers,
        "up": best_up,
        "down": best_down,
        "us": down[best_down],
        "up_us": {str(k): v for k, v in up.items()},
        "down_us": {str(k): v for k, v in down.items()},
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 32, 256])
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--intermediate", type=int, default=768)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--json")
    p.add_argument("--fp8", choices=("block", "row"), help="the experts in e4m3 with scales")
    p.add_argument("--sweep-rows", action="store_true", help="moe_rows' tiles at each batch")
    p.add_argument(
        "--torch-align",
        action="store_true",
        help="past ONE_PROGRAM_PAIRS torch's ops, not the parallel launches (PARALLEL_ALIGN)",
    )
    p.add_argument("--one-program-pairs", type=int, help="moe_routing.ONE_PROGRAM_PAIRS")
    args = p.parse_args()
    if args.torch_align:
        moe_routing.PARALLEL_ALIGN = False
    if args.one_program_pairs is not None:
        moe_routing.ONE_PROGRAM_PAIRS = args.one_program_pairs
    shape = (args.experts, args.intermediate, args.hidden, args.top_k, torch.bfloat16)
    if args.sweep_rows:
        sweeps = []
        for batch in args.batch:
            res = sweep_rows(batch, *shape, fp8=args.fp8)
            sweeps.append(res)
            ranked = sorted(res["up_us"].items(), key=lambda kv: kv[1])[:5]
            print(f"batch {batch}: up {res['up']} down {res['down']}: {res['us']:.1f} us")
            print("   fastest gate/up tiles:", ", ".join(f"{k} {v:.1f}" for k, v in ranked))
            ranked = sorted(res["down_us"].items(), key=lambda kv: kv[1])[:5]
            print("   fastest down tiles:", ", ".join(f"{k} {v:.1f}" for k, v in ranked))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(sweeps, f, indent=2)
        return
    bandwidth = copy_bandwidth()
    print(f"device-to-device copy: {bandwidth / 1e12:.2f} TB/s ({torch.cuda.get_device_name()})")
    print(
        f"{'batch':>6} {'experts':>8} {'MB':>8} {'copy us':>8} {'fused us':>9} {'TB/s':>6} "
        f"{'of copy':>8} {'torch us':>9} {'route+align: torch us':>22} {'one program':>12} "
        f"{'parallel':>9} {'align: torch us':>16} {'one program':>12} {'parallel':>9}"
    )
    rows = []
    for batch in args.batch:
        row = run(batch, *shape, bandwidth, args.fp8)
        rows.append(row)
        print(
            f"{batch:>6} {row['experts_touched']:>8} {row['weight_bytes'] / 1e6:>8.1f} "
            f"{row['copy_us']:>8.1f} {row['fused_us']:>9.1f} {row['fused_tbps']:>6.2f} "
            f"{row['fused_vs_copy']:>8.0%} {row['torch_us']:>9.1f} "
            f"{row['route_align_torch_us']:>22.1f} {row['route_align_triton_us']:>12.1f} "
            f"{row['route_align_parallel_us']:>9.1f} {row['align_torch_us']:>16.1f} "
            f"{row['align_triton_us']:>12.1f} {row['align_parallel_us']:>9.1f}"
            + (
                f"   grouped {row['grouped_us']:.1f} us, rows {row['rows_us']:.1f} us, "
                f"route alone {row['route_triton_us']:.1f} us"
                if "rows_us" in row
                else ""
            )
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"copy_tbps": bandwidth / 1e12, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
