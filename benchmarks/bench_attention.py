"""Paged attention kernels on the GPU against the machine's own ceilings, in one run.

Qwen3-0.6B's attention shape (16 query heads, 8 KV heads, head_dim 128, bf16, block size 16):
- decode at batch 256 x context 1k and batch 16 x context 8k (and ragged batches of 256 and 64
  with contexts of 100-2,000, as in nano-vllm's benchmark): effective bandwidth (KV bytes read
  / time) against a device-to-device copy, the sequences taken longest first (as the engine
  does) and in batch order, and torch's flash attention (SDPA) over a contiguous cache at the
  uniform shapes (target: >= 3.2 TB/s); the same decodes over an FP8 (e4m3) cache, its bytes
  counted (target: >= 3.6 TB/s);
- prefill of 8k-token batches (8k tokens in 16 prompts of 512 up to one of 8k, and 4 x 512 new
  tokens over 1.5k cached, with 16- and 256-token blocks): attention FLOP/s against an 8k bf16
  matmul (target: >= 60% of it), with and without TMA loads, and where nothing is cached
  torch's varlen flash attention and cuDNN's fused attention over the dense equivalent.

    python benchmarks/bench_attention.py [--json out.json]
"""

from __future__ import annotations

import argparse
import inspect
import json
import random

import torch
from triton.testing import do_bench

from nano_kvcache.attention import paged_decode, paged_prefill

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 16, 8, 128, 16
DTYPE = torch.bfloat16


def ms(fn) -> float:
    return do_bench(fn, warmup=25, rep=200, return_mode="median")


def ceilings() -> dict:
    x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    copy = 2 * x.numel() / (ms(lambda: y.copy_(x)) * 1e-3)
    a = torch.randn(8192, 8192, device="cuda", dtype=DTYPE)
    b = torch.randn(8192, 8192, device="cuda", dtype=DTYPE)
    matmul = 2 * 8192**3 / (ms(lambda: a @ b) * 1e-3)
    return {"copy_tbps": copy / 1e12, "matmul_tflops": matmul / 1e12}


def paged_cache(num_tokens: int, block: int = BLOCK, dtype: torch.dtype = DTYPE):
    num_blocks = num_tokens // block + 8
    shape = (num_blocks, KV_HEADS, block, HEAD_DIM)
    k = torch.randn(shape, device="cuda", dtype=DTYPE).to(dtype)
    v = torch.randn(shape, device="cuda", dtype=DTYPE).to(dtype)
    return k, v, torch.randperm(num_blocks, device="cuda").int()


def decode(lens: list[int], cache_dtype: torch.dtype = DTYPE) -> dict:
    """Decode over contexts of these lengths: the sequences taken longest first (as the engine
    does) and in batch order; torch's flash attention over a contiguous cache where they are
    all the same length (bf16 caches only). An FP8 cache reads scales of 0.7 and 1.3."""
    batch, per_seq = len(lens), -(-max(lens) // BLOCK)
    k, v, perm = paged_cache(batch * per_seq * BLOCK, dtype=cache_dtype)
    fp8 = cache_dtype != DTYPE
    scales = {"k_scale": 0.7, "v_scale": 1.3} if fp8 else {}
    tables = perm[: batch * per_seq].view(batch, per_seq).contiguous()
    seq_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    longest_first = sorted(range(batch), key=lens.__getitem__, reverse=True)
    order = torch.tensor(longest_first, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, HEADS, HEAD_DIM, device="cuda", dtype=DTYPE)
    out = torch.empty_like(q)
    kv_bytes = 2 * sum(lens) * KV_HEADS * HEAD_DIM * k.element_size()
    result = {
        "cache": str(cache_dtype).split(".")[-1],
        "batch": batch,
        "context": f"{min(lens)}-{max(lens)}" if min(lens) < max(lens) else max(lens),
    }
    for name, o in (("triton", order), ("batch_order", None)):
        t = ms(
            lambda o=o: paged_decode(
                q, k, v, tables, seq_lens, HEAD_DIM**-0.5, out=out, order=o, **scales
            )
        )
        result[f"{name}_us"], result[f"{name}_tbps"] = t * 1e3, kv_bytes / (t * 1e-3) / 1e12
    if min(lens) == max(lens) and not fp8:  # torch's flash attention over a contiguous cache
        kc = torch.randn(batch, KV_HEADS, lens[0], HEAD_DIM, device="cuda", dtype=DTYPE)
        vc = torch.randn_like(kc)
        qc = q.unsqueeze(2)
        f = torch.nn.functional.scaled_dot_product_attention
        t = ms(lambda: f(qc, kc, vc, enable_gqa=True))
        result["sdpa_us"], result["sdpa_tbps"] = t * 1e3, kv_bytes / (t * 1e-3) / 1e12
    return result


# Prefill tiles tried: (block_m, block_n, num_warps, num_stages), block_n dividing block_m.
TILES = (
    (64, 64, 4, 2),
    (64, 64, 4, 3),
    (64, 32, 4, 3),
    (128, 64, 4, 2),
    (128, 64, 8, 3),
    (128, 128, 8, 3),
    (128, 32, 4, 3),
)


def prefill(chunks: list[tuple[int, int]], block: int = BLOCK) -> dict:
    """TFLOP/s of every prefill tile on these chunks ((new tokens, cached tokens) each), the
    default tile with pointer loads instead of TMA, and where nothing is cached torch's varlen
    flash attention and cuDNN's attention (SDPA) over the dense equivalent."""
    lens = [n + c for n, c in chunks]
    k_cache, v_cache, perm = paged_cache(sum(lens), block)
    width = max(-(-n // block) for n in lens)
    tables = perm[: len(chunks) * width].view(len(chunks), width).contiguous()
    query_lens = [n for n, _ in chunks]
    qsl = torch.tensor(
        [0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda"
    )
    seq_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    # q, k, v as the model hands them over: views of one qkv projection output.
    qkv = torch.randn(sum(query_lens), HEADS + 2 * KV_HEADS, HEAD_DIM, device="cuda", dtype=DTYPE)
    q, k, v = qkv.split([HEADS, KV_HEADS, KV_HEADS], dim=1)
    out = torch.empty_like(q)
    flops = 4 * HEADS * HEAD_DIM * sum(n * c + n * (n + 1) // 2 for n, c in chunks)
    result = {"chunks": chunks, "block": block, "tokens": sum(query_lens), "tiles": {}}
    cached = any(c for _, c in chunks)

    def run(tile=None, tma=None):
        args = (q, k, v, k_cache, v_cache, tables, seq_lens, qsl, max(query_lens), HEAD_DIM**-0.5)
        return lambda: paged_prefill(*args, out=out, tile=tile, tma=tma, cached_prefix=cached)

    for tile in TILES:
        try:
            t = ms(run(tile))
        except Exception as e:  # a tile that does not compile (shared memory): report it
            print(f"  prefill tile {tile}: {type(e).__name__}")
            continue
        result["tiles"][str(tile)] = flops / (t * 1e-3) / 1e12
    result["best_tile"], result["best_tflops"] = max(result["tiles"].items(), key=lambda x: x[1])
    result["triton_tflops"] = flops / (ms(run()) * 1e-3) / 1e12  # the default tile
    result["pointers_tflops"] = flops / (ms(run(tma=False)) * 1e-3) / 1e12
    if not cached:
        varlen = _torch_varlen(q, qsl, max(query_lens))
        if varlen is not None:
            result["torch_varlen_tflops"] = flops / (ms(varlen) * 1e-3) / 1e12
        result["cudnn_tflops"] = flops / (ms(_cudnn_dense(q, k, v, chunks)) * 1e-3) / 1e12
    return result


def _cudnn_dense(q, k, v, chunks):
    """cuDNN's fused attention through SDPA, causal, over the dense [B, heads, n, head_dim]
    equivalent of equal-length chunks (K/V heads repeated for GQA)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    batch, n = len(chunks), chunks[0][0]
    group = HEADS // KV_HEADS

    def dense(x, repeat=1):
        x = x.reshape(batch, n, x.shape[1], HEAD_DIM).transpose(1, 2)
        return x.repeat_interleave(repeat, dim=1).contiguous()

    qd, kd, vd = dense(q), dense(k, group), dense(v, group)

    def run():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(qd, kd, vd, is_causal=True)

    return run


def _torch_varlen(q, qsl, max_len):
    """torch.nn.attention.varlen.varlen_attn, causal, on fresh K/V (None where absent)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    if "is_causal" in params:
        causal = {"is_causal": True}
    elif "window_size" in params:
        causal = {"window_size": (-1, 0)}
    else:
        print(f"varlen_attn{inspect.signature(varlen_attn)}: no causal option; skipped")
        return None
    k = torch.randn(q.shape[0], KV_HEADS, HEAD_DIM, device="cuda", dtype=DTYPE)
    k = k.repeat_interleave(HEADS // KV_HEADS, dim=1)
    v = torch.randn_like(k)
    return lambda: varlen_attn(q, k, v, qsl, qsl, max_len, max_len, **causal)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json")
    args = parser.parse_args()
    limits = ceilings()
    ragged = random.Random(0)
    decodes = [
        decode([1024] * 256),
        decode([8192] * 16),
        decode([ragged.randint(100, 2000) for _ in range(256)]),
        decode([ragged.randint(100, 2000) for _ in range(64)]),
    ]
    fp8 = torch.float8_e4m3fn
    decodes += [decode([1024] * 256, fp8), decode([8192] * 16, fp8)]
    ragged = random.Random(0)
    decodes.append(decode([ragged.randint(100, 2000) for _ in range(256)], fp8))
    prefills = [prefill([(8192 // n, 0)] * n) for n in (16, 8, 4, 2, 1)]
    prefills.append(prefill([(512, 1536)] * 4))
    prefills.append(prefill([(512, 1536)] * 4, block=256))  # the cache through TMA
    print(
        f"attention kernels on {torch.cuda.get_device_name()}: copy "
        f"{limits['copy_tbps']:.2f} TB/s, bf16 matmul {limits['matmul_tflops']:.0f} TFLOP/s"
    )
    print(
        f"{'decode (batch x context, cache)':>31} {'triton TB/s':>12} {'of copy':>8} "
        f"{'in batch order':>15} {'sdpa TB/s':>10}"
    )
    for r in decodes:
        sdpa = f"{r['sdpa_tbps']:.2f}" if "sdpa_tbps" in r else "-"
        print(
            f"{r['batch']:>11} x {r['context']:>10} {r['cache']:>6} {r['triton_tbps']:12.2f} "
            f"{r['triton_tbps'] / limits['copy_tbps']:8.0%} {r['batch_order_tbps']:15.2f} "
            f"{sdpa:>10}"
        )
    print(
        f"{'prefill (new/cached)':>24} {'Triton TFLOP/s':>15} {'of matmul':>10} {'best tile':>18} "
        f"{'(TFLOP/s)':>10} {'no TMA':>7} {'torch varlen':>13} {'cuDNN dense':>12}"
    )
    for r in prefills:
        name = f"{len(r['chunks'])} x " + "+".join(f"{n}/{c}" for n, c in sorted(set(r["chunks"])))
        name += f" b{r['block']}" if r["block"] != BLOCK else ""
        others = [r.get("torch_varlen_tflops"), r.get("cudnn_tflops")]
        print(
            f"{name:>24} {r['triton_tflops']:15.0f} "
            f"{r['triton_tflops'] / limits['matmul_tflops']:10.0%} {r['best_tile']:>18} "
            f"{r['best_tflops']:10.0f} {r['pointers_tflops']:7.0f} "
            + " ".join(f"{f'{x:.0f}' if x else '-':>{w}}" for x, w in zip(others, (13, 12)))
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"ceilings": limits, "decode": decodes, "prefill": prefills}, f, indent=2)


if __name__ == "__main__":
    main()
