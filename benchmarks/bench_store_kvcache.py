"""store_kvcache bandwidth on the GPU against a device-to-device copy of the same bytes.

Writes K and V of 16k tokens at Qwen3-8B's KV shape (8 heads x 128, bf16) into a paged cache,
blocks in random order, and copies the same bytes with torch in the same run. Reports achieved
bandwidth (bytes read + bytes written over time) and the ratio (target >= 80% of the copy).

    python benchmarks/bench_store_kvcache.py [--tokens 16384] [--heads 8] [--head-dim 128]
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from triton.testing import do_bench

from nano_kvcache import ops
from nano_kvcache.layout import KVCacheLayout


def run(tokens: int, heads: int, head_dim: int, block_size: int, dtype: torch.dtype) -> dict:
    g = torch.Generator(device="cuda").manual_seed(0)
    layout = KVCacheLayout(1, heads, head_dim, block_size, dtype)
    num_blocks = 2 * tokens // block_size
    cache = layout.allocate(num_blocks, "cuda")
    key = torch.randn(tokens, heads, head_dim, generator=g, device="cuda").to(dtype)
    value = torch.randn(tokens, heads, head_dim, generator=g, device="cuda").to(dtype)
    # Consecutive rows inside blocks, blocks scattered over the pool: what a prefill writes.
    blocks = torch.randperm(num_blocks, generator=g, device="cuda")[: tokens // block_size]
    rows = torch.arange(block_size, device="cuda")
    slots = (blocks[:, None] * block_size + rows).flatten()
    k_cache, v_cache = cache[0, 0], cache[0, 1]
    k_dst, v_dst = torch.empty_like(key), torch.empty_like(value)

    def store():
        ops.store_kvcache(key, value, k_cache, v_cache, slots)

    def store_torch():
        ops.store_kvcache_torch(key, value, k_cache, v_cache, slots)

    def copy():
        k_dst.copy_(key)
        v_dst.copy_(value)

    moved = 2 * 2 * key.numel() * key.element_size()  # K and V, read once and written once
    result = {
        "tokens": tokens,
        "heads": heads,
        "head_dim": head_dim,
        "dtype": str(dtype),
        "block_size": block_size,
        "bytes": moved,
    }
    for name, fn in (("copy", copy), ("store_kvcache", store), ("store_torch", store_torch)):
        ms = do_bench(fn, warmup=50, rep=400, return_mode="median")
        result[f"{name}_us"] = ms * 1e3
        result[f"{name}_tbps"] = moved / (ms * 1e-3) / 1e12
    result["store_vs_copy"] = result["store_kvcache_tbps"] / result["copy_tbps"]
    return result


def host_overhead_us(calls: int = 2000) -> float:
    """CPU time of one store_kvcache call at a decode-sized batch (validation + launch)."""
    layout = KVCacheLayout(1, 8, 128, 16, torch.bfloat16)
    cache = layout.allocate(1024, "cuda")
    key = torch.randn(256, 8, 128, device="cuda", dtype=torch.bfloat16)
    slots = torch.arange(256, device="cuda")
    for _ in range(100):
        ops.store_kvcache(key, key, cache[0, 0], cache[0, 1], slots)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        ops.store_kvcache(key, key, cache[0, 0], cache[0, 1], slots)
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args()
    results = [run(args.tokens, args.heads, args.head_dim, args.block_size, torch.bfloat16)]
    results.append(run(args.tokens, 5, 96, args.block_size, torch.bfloat16))
    print(f"store_kvcache on {torch.cuda.get_device_name()}")
    print(f"{'shape':>22} {'copy TB/s':>10} {'store TB/s':>11} {'ratio':>6} {'torch TB/s':>11}")
    for r in results:
        shape = f"{r['tokens']}x{r['heads']}x{r['head_dim']} bf16"
        print(
            f"{shape:>22} {r['copy_tbps']:10.2f} {r['store_kvcache_tbps']:11.2f} "
            f"{r['store_vs_copy']:6.2f} {r['store_torch_tbps']:11.2f}"
        )
    overhead = host_overhead_us()
    print(f"host time per store_kvcache call (256 tokens, validation + launch): {overhead:.1f} us")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
