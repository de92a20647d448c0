"""Decode attention's tiles swept on the GPU: each variant of the decode kernel (q tile rows,
tokens a tile, warps, pipeline stages, register cap) over the shapes nano-vllm's benchmark and
the issue targets run, bf16 and FP8 caches, every variant's output checked against the
default's (a variant that differs fails the run). Microseconds from ``do_bench`` medians; TB/s
of the cache's own bytes.

    python benchmarks/sweep_decode.py [--cache bf16 fp8] [--rounds 2] [--json out.json]
    TRITON_INTERPRET=1 python benchmarks/sweep_decode.py --smoke   (CPU: tiny shapes, outputs
                                                                  compared, nothing timed)

Variants are ``rows/tokens/warps/stages/registers`` (rows, stages "auto": the kernel's
choice for the cache and the batch; registers "auto": the measured cap of ``DecodeLaunches``;
0: the compiler's choice); ``--variants`` replaces the default list.
"""

from __future__ import annotations

import argparse
import json
import random
import time

import torch

from nano_kvcache.attention import decode

BLOCK = 16
DEFAULT_ROWS = (decode.GROUP_ROWS, decode.FP8_GROUP_ROWS)
FP8 = torch.float8_e4m3fn
CACHES = {"bf16": torch.bfloat16, "fp8": FP8}
# A variant's output may differ from the default's by this much of the largest output (the
# tiles sum in other orders; fp16/bf16 P)
TOLERANCE = 1e-2
# (rows, block_n, num_warps, num_stages, max_registers): the default first (None: "auto", the
# kernel's own choice for the cache and the batch)
VARIANTS = [
    (None, 64, 4, None, None),
    (1, 64, 4, 3, None),
    (1, 64, 4, 2, None),
    (16, 64, 4, 2, None),
    (1, 32, 8, 2, 0),
    (1, 128, 8, 2, 0),
    (1, 32, 4, 2, 0),
    (16, 32, 8, 2, 0),
]


def cases(smoke: bool) -> list[tuple[str, list[int], int, int, int]]:
    """(name, context lengths, heads, kv heads, head_dim)."""
    r = random.Random(0)
    if smoke:
        return [("tiny gqa 3", [5, 40, 17], 6, 2, 64), ("tiny mha", [33, 1], 2, 2, 64)]
    ragged = [r.randint(100, 2000) for _ in range(256)]
    return [
        ("0.6B 256 x 1k", [1024] * 256, 16, 8, 128),
        ("0.6B 256 x 100-2k", ragged, 16, 8, 128),
        ("0.6B 16 x 8k", [8192] * 16, 16, 8, 128),
        ("0.6B 32 x 1k", [1024] * 32, 16, 8, 128),
        ("0.6B 1 x 640", [640], 16, 8, 128),
        ("0.6B 1 x 4k", [4096], 16, 8, 128),
        ("0.6B 4 x 2k", [2048] * 4, 16, 8, 128),
        ("8B 256 x 640", [640] * 256, 32, 8, 128),
        ("30B-A3B 1 x 640", [640], 32, 4, 128),
    ]


def inputs(lens: list[int], heads: int, kv_heads: int, head_dim: int, cache, device):
    # (Triton's interpreter multiplies bf16 as its bits: fp16 on the CPU)
    dtype = torch.bfloat16 if device == "cuda" else torch.float16
    cache = dtype if cache == torch.bfloat16 else cache
    g = torch.Generator(device=device).manual_seed(len(lens))
    per_seq = -(-max(lens) // BLOCK)
    num_blocks = len(lens) * per_seq + 8
    shape = (num_blocks, kv_heads, BLOCK, head_dim)
    k = torch.randn(shape, generator=g, device=device).to(cache)
    v = torch.randn(shape, generator=g, device=device).to(cache)
    perm = torch.randperm(num_blocks, generator=g, device=device).int()
    tables = perm[: len(lens) * per_seq].view(len(lens), per_seq).contiguous()
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    longest = sorted(range(len(lens)), key=lens.__getitem__, reverse=True)
    order = torch.tensor(longest, dtype=torch.int32, device=device)
    q = torch.randn(len(lens), heads, head_dim, generator=g, device=device).to(dtype)
    return q, k, v, tables, seq_lens, order


def run(variant, q, k, v, tables, seq_lens, order):
    """A callable launching ``variant`` (the launch set up by a first call), and its output."""
    rows, block_n, warps, stages, registers = variant
    decode.GROUP_ROWS, decode.FP8_GROUP_ROWS = DEFAULT_ROWS if rows is None else (rows, rows)
    launches = decode.DecodeLaunches(
        tables,
        seq_lens,
        order,
        block_n=block_n,
        num_warps=warps,
        num_stages=stages,
        max_registers=registers,
    )
    out = torch.empty_like(q)
    scales = (0.7, 1.3) if k.dtype == FP8 else (1.0, 1.0)

    def launch():
        launches(q, k, v, q.shape[-1] ** -0.5, out, *scales)

    launch()
    return launch, out


def sweep(caches: list[str], variants: list, rounds: int, smoke: bool) -> list[dict]:
    device = "cpu" if smoke else "cuda"
    results = []
    try:
        for cache in caches:
            for name, lens, heads, kv_heads, head_dim in cases(smoke):
                tensors = inputs(lens, heads, kv_heads, head_dim, CACHES[cache], device)
                kv_bytes = 2 * sum(lens) * kv_heads * head_dim * tensors[1].element_size()
                _, reference = run(variants[0], *tensors)
                reference = reference.float().clone()
                scale = reference.abs().max().item()
                for rnd in range(rounds):
                    for variant in variants:
                        launch, out = run(variant, *tensors)
                        error = (out.float() - reference).abs().max().item()
                        if not error <= TOLERANCE * scale:  # (NaN included)
                            raise AssertionError(
                                f"{cache} {name}: variant {variant} differs from the default "
                                f"by {error:.2e} (outputs up to {scale:.2e})"
                            )
                        row = {"cache": cache, "case": name, "round": rnd, "error": error}
                        row["variant"] = "/".join("auto" if x is None else str(x) for x in variant)
                        if not smoke:
                            from triton.testing import do_bench

                            ms = do_bench(launch, warmup=25, rep=200, return_mode="median")
                            row |= {"us": ms * 1e3, "tbps": kv_bytes / (ms * 1e-3) / 1e12}
                        results.append(row)
                        shown = f"{row['us']:8.1f} us {row['tbps']:5.2f} TB/s" if not smoke else ""
                        print(
                            f"{cache:>4} {name:>18} r{rnd} {row['variant']:>16} {shown} "
                            f"max |diff| {error:.1e}",
                            flush=True,
                        )
    finally:
        decode.GROUP_ROWS, decode.FP8_GROUP_ROWS = DEFAULT_ROWS
    return results


def best(results: list[dict]) -> list[str]:
    """A line per (cache, case): the fastest variant (its best round) against the default's."""
    lines = []
    for key in dict.fromkeys((r["cache"], r["case"]) for r in results):
        times: dict[str, float] = {}
        for r in results:
            if (r["cache"], r["case"]) == key:
                times[r["variant"]] = min(times.get(r["variant"], float("inf")), r["us"])
        default = next(iter(times))
        fastest = min(times, key=times.get)
        change = times[fastest] / times[default] - 1
        lines.append(
            f"{key[0]:>4} {key[1]:>18}: default {default} {times[default]:.1f} us, fastest "
            f"{fastest} {times[fastest]:.1f} us ({change:+.1%})"
        )
    return lines


def variant_of(text: str) -> tuple:
    parts = text.split("/")
    if len(parts) != 5:
        raise argparse.ArgumentTypeError(f"rows/tokens/warps/stages/registers, got {text!r}")
    try:
        rows, *ints = (None if x == "auto" else int(x) for x in parts)
    except ValueError:
        raise argparse.ArgumentTypeError(f"integers or auto, got {text!r}") from None
    if None in ints[:2]:
        raise argparse.ArgumentTypeError(
            f"only rows, stages and registers may be auto, got {text!r}"
        )
    tokens, warps, stages, registers = ints
    powers = [x for x in (rows, tokens, warps) if x is not None]
    if any(x < 1 or x & (x - 1) for x in powers):
        raise argparse.ArgumentTypeError(f"rows, tokens and warps are powers of two: {text!r}")
    if (stages is not None and stages < 1) or (registers is not None and registers < 0):
        raise argparse.ArgumentTypeError(f"stages >= 1 and registers >= 0, got {text!r}")
    return (rows, *ints)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cache", nargs="+", choices=sorted(CACHES), default=["fp8", "bf16"])
    p.add_argument(
        "--variants", nargs="+", type=variant_of, help="e.g. auto/64/4/auto/auto 1/32/8/2/0"
    )
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU, not timed")
    p.add_argument("--json")
    args = p.parse_args()
    start = time.perf_counter()
    results = sweep(args.cache, args.variants or VARIANTS, args.rounds, args.smoke)
    print(f"{len(results)} runs in {time.perf_counter() - start:.0f} s")
    if not args.smoke:
        print("\n".join(best(results)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
