"""The Triton paged attention kernels against the float64 reference, on random data (never
zeros) with poisoned outputs: ragged batches, block sizes 1 to 256, contexts 1 to 32k, GQA
ratios 1 to 8, prefill over a cached prefix and chunked prefill, fp16 and bf16.

GPU-marked; with TRITON_INTERPRET=1 the small cases also run on the CPU (Triton's interpreter).
"""

from __future__ import annotations

import os
import random

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from nano_kvcache.attention_reference import paged_attention_reference  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        DEVICE == "cpu" and not INTERPRET, reason="needs a CUDA GPU (or TRITON_INTERPRET=1)"
    ),
]
DTYPES = [torch.float16] if INTERPRET else [torch.float16, torch.bfloat16]
TOL = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def make_cache(num_blocks, kv_heads, block_size, head_dim, dtype, g):
    shape = (num_blocks, kv_heads, block_size, head_dim)
    k = torch.randn(shape, generator=g, device=DEVICE).to(dtype)
    v = torch.randn(shape, generator=g, device=DEVICE).to(dtype)
    return k, v


def tables_for(seq_lens, block_size, num_blocks, rng):
    free = list(range(num_blocks))
    rng.shuffle(free)
    return [[free.pop() for _ in range(-(-n // block_size))] for n in seq_lens]


def padded(tables):
    width = max(len(t) for t in tables)
    out = torch.full((len(tables), width), -1, dtype=torch.int32)
    for i, t in enumerate(tables):
        out[i, : len(t)] = torch.tensor(t, dtype=torch.int32)
    return out.to(DEVICE)


def new_kv(k_cache, v_cache, tables, chunks, heads):
    """The new tokens' K and V, taken from the cache into views of a qkv-shaped buffer (the
    layout the model hands over); their cache slots are then poisoned with NaN: the kernel
    must read them from k and v."""
    block_size, head_dim = k_cache.shape[2], k_cache.shape[3]
    kv_heads = k_cache.shape[1]
    spots = [(t[p // block_size], p % block_size) for t, (n, c) in zip(tables, chunks)
             for p in range(c, c + n)]  # fmt: skip
    pages = torch.tensor([page for page, _ in spots], device=DEVICE)
    slots = torch.tensor([slot for _, slot in spots], device=DEVICE)
    buf = torch.full(
        (len(spots), heads + 2 * kv_heads, head_dim), float("nan"), dtype=k_cache.dtype
    ).to(DEVICE)
    k, v = buf[:, heads : heads + kv_heads], buf[:, heads + kv_heads :]
    k.copy_(k_cache[pages, :, slots])
    v.copy_(v_cache[pages, :, slots])
    k_cache[pages, :, slots] = float("nan")
    v_cache[pages, :, slots] = float("nan")
    return k, v


def check(out, ref, dtype):
    assert not torch.isnan(out).any(), "an output was not written"
    err = (out.double() - ref).norm() / ref.norm()
    assert err < TOL[dtype], f"relative error {err:.2e}"


DECODE_CASES = [
    # (block size, heads, kv heads, head dim, context lengths)
    (16, 16, 8, 128, [1, 17, 300, 1024, 33]),
    (1, 8, 8, 64, [1, 5, 40]),
    (64, 32, 4, 128, [700, 65, 129]),
    (256, 16, 2, 64, [1000, 256, 3]),
    (16, 8, 1, 128, [513, 2]),
    (16, 12, 4, 64, [77, 300, 1]),  # (3 query heads a kv head: padded rows in every tile)
]
if not INTERPRET:
    DECODE_CASES += [(16, 16, 8, 128, [32768, 20000]), (16, 16, 8, 128, [1000] * 64)]


@pytest.mark.parametrize("rows", [16, 1], ids=["rows16", "group-rows"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size,heads,kv_heads,head_dim,lens", DECODE_CASES)
def test_paged_decode(dtype, block_size, heads, kv_heads, head_dim, lens, rows, monkeypatch):
    """Against the float64 reference, with each program's q tile padded to 16 rows or to its
    kv head's query heads alone (``GROUP_ROWS``, ``FP8_GROUP_ROWS``)."""
    from nano_kvcache.attention import decode, decode_splits, paged_decode

    monkeypatch.setattr(decode, "GROUP_ROWS", rows)
    monkeypatch.setattr(decode, "FP8_GROUP_ROWS", rows)

    rng = random.Random(block_size + heads)
    g = torch.Generator(device=DEVICE).manual_seed(len(lens))
    num_blocks = sum(-(-n // block_size) for n in lens) + 3
    k_cache, v_cache = make_cache(num_blocks, kv_heads, block_size, head_dim, dtype, g)
    tables = tables_for(lens, block_size, num_blocks, rng)
    q = torch.randn(len(lens), heads, head_dim, generator=g, device=DEVICE).to(dtype)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    ref = paged_attention_reference(
        q, k_cache, v_cache, tables, [1] * len(lens), lens, head_dim**-0.5
    )
    # The programs may take the sequences in any order (longest first in the engine).
    shuffled = list(range(len(lens)))
    rng.shuffle(shuffled)
    order = torch.tensor(shuffled, dtype=torch.int32, device=DEVICE)
    for splits in sorted({1, 4, decode_splits(len(lens), kv_heads)}):
        for seq_order in (None, order):
            out = torch.full_like(q, float("nan"))
            paged_decode(
                q,
                k_cache,
                v_cache,
                padded(tables),
                seq_lens,
                head_dim**-0.5,
                out=out,
                num_splits=splits,
                order=seq_order,
            )
            check(out, ref, dtype)


@pytest.mark.skipif(INTERPRET, reason="the prefetch is NVIDIA PTX (off in the interpreter)")
@pytest.mark.parametrize(
    "dtype,cache_dtype,head_dim",
    [
        (torch.bfloat16, torch.bfloat16, 96),  # rows of 192 bytes: not whole lines
        (torch.float16, torch.float16, 48),
        (torch.float32, torch.float32, 128),
        (torch.bfloat16, torch.float8_e4m3fn, 128),
        (torch.bfloat16, torch.float8_e4m3fn, 80),
    ],
)
def test_the_decode_prefetch_changes_nothing(monkeypatch, dtype, cache_dtype, head_dim):
    """The decode kernel asks L2 for its first tiles before its wait: the output is the
    same, bit for bit, with none, one or two tiles prefetched (block size 16, ragged)."""
    from nano_kvcache.attention import decode

    lens = [1, 17, 300, 1024, 33, 64]
    rng = random.Random(head_dim)
    g = torch.Generator(device=DEVICE).manual_seed(head_dim)
    num_blocks = sum(-(-n // 16) for n in lens) + 3
    k_cache, v_cache = make_cache(num_blocks, 4, 16, head_dim, dtype, g)
    scales = (1.0, 1.0)
    if cache_dtype == torch.float8_e4m3fn:
        k_cache, v_cache, scales = k_cache.to(cache_dtype), v_cache.to(cache_dtype), (0.5, 2.0)
    tables = padded(tables_for(lens, 16, num_blocks, rng))
    q = torch.randn(len(lens), 8, head_dim, generator=g, device=DEVICE).to(dtype)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    outs = []
    for tiles in (0, 1, 2):
        monkeypatch.setattr(decode, "EARLY_TILES", tiles)
        outs.append(
            decode.paged_decode(
                q,
                k_cache,
                v_cache,
                tables,
                seq_lens,
                head_dim**-0.5,
                num_splits=4,
                k_scale=scales[0],
                v_scale=scales[1],
            )
        )
    assert torch.isfinite(outs[0]).all()
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


PREFILL_CASES = [
    # (block size, heads, kv heads, head dim, (new tokens, cached tokens) per sequence)
    (16, 16, 8, 128, [(37, 0), (5, 100), (64, 64), (1, 30)]),
    (1, 8, 2, 64, [(20, 0), (7, 9)]),
    (64, 8, 1, 128, [(130, 70), (3, 0)]),
    (256, 4, 4, 64, [(100, 300)]),
    (16, 4, 2, 96, [(150, 70), (9, 0)]),  # head_dim below its power of two: masked loads
    (16, 16, 8, 128, [(37, 0), (100, 0), (1, 0), (64, 0)]),  # nothing cached
    (16, 4, 2, 64, [(300, 40), (260, 0)]),  # long chunks over a prefix: 128 x 64 tiles
]
if not INTERPRET:
    PREFILL_CASES += [
        (16, 16, 8, 128, [(2048, 0), (500, 6000), (1, 8191)]),
        (16, 32, 4, 128, [(1024, 31000)]),
        (16, 16, 8, 128, [(4100, 0), (37, 5000)]),  # a long prompt: the large tile
        (16, 16, 8, 128, [(1024, 0)] * 3 + [(4100, 0)]),
    ]


@pytest.mark.parametrize("tma", [False, True], ids=["pointers", "tma"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size,heads,kv_heads,head_dim,chunks", PREFILL_CASES)
def test_paged_prefill(dtype, block_size, heads, kv_heads, head_dim, chunks, tma):
    """The cached keys through the block table, the new ones from the step's K/V: through
    pointers, or TMA descriptors (Hopper on; Triton's interpreter runs them too), the caches'
    too where a block holds whole key tiles (block sizes 64 and 256). A batch with nothing
    cached runs the kernel without the cached-key path."""
    from nano_kvcache.attention import paged_prefill

    if tma and head_dim & (head_dim - 1):
        pytest.skip("TMA tiles need a power-of-two head_dim")
    if tma and DEVICE == "cuda" and torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("TMA needs Hopper or later")

    rng = random.Random(block_size * heads)
    g = torch.Generator(device=DEVICE).manual_seed(len(chunks))
    query_lens = [n for n, _ in chunks]
    lens = [n + c for n, c in chunks]
    num_blocks = sum(-(-n // block_size) for n in lens) + 3
    k_cache, v_cache = make_cache(num_blocks, kv_heads, block_size, head_dim, dtype, g)
    tables = tables_for(lens, block_size, num_blocks, rng)
    q = torch.randn(sum(query_lens), heads, head_dim, generator=g, device=DEVICE).to(dtype)
    qsl = torch.tensor(
        [0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE
    )
    ref = paged_attention_reference(q, k_cache, v_cache, tables, query_lens, lens, head_dim**-0.5)
    k, v = new_kv(k_cache, v_cache, tables, chunks, heads)
    out = torch.full_like(q, float("nan"))
    paged_prefill(
        q,
        k,
        v,
        k_cache,
        v_cache,
        padded(tables),
        torch.tensor(lens, dtype=torch.int32, device=DEVICE),
        qsl,
        max(query_lens),
        head_dim**-0.5,
        out=out,
        tma=tma,
        cached_prefix=any(c for _, c in chunks),
    )
    check(out, ref, dtype)


def query(tokens, heads, head_dim, k_scale, g):
    """Queries whose scores against the keys of ``fp8_caches`` (about k_scale * 100 each, times
    the softmax scale 0.1) spread by about 2: the softmax neither flat nor one-hot."""
    size = 2 / (0.1 * k_scale * 100 * head_dim**0.5)
    return torch.randn(tokens, heads, head_dim, generator=g, device=DEVICE) * size


def fp8_caches(num_blocks, kv_heads, block_size, head_dim, g, scales):
    """FP8 caches of random K and V (their magnitude about scale * 100: most values well
    inside e4m3's range) and the float32 values they stand for."""
    from nano_kvcache.ops import dequantize_fp8, quantize_fp8

    shape = (num_blocks, kv_heads, block_size, head_dim)
    out = []
    for scale in scales:
        x = torch.randn(shape, generator=g, device=DEVICE) * scale * 100
        cached = quantize_fp8(x, scale)
        out += [cached, dequantize_fp8(cached, scale, torch.float32)]
    return out


# (q's dtype, fp16_dots): under a bf16 q the kernel computes in fp16 or in bf16. (Triton 3.6's
# interpreter multiplies bf16 tensors as their bits, uint16: bf16 dots only on GPUs.)
FP8_DECODE_DOTS = [
    pytest.param(torch.float16, True, id="fp16"),
    pytest.param(torch.bfloat16, True, id="bf16-fp16-dots"),
]
if not INTERPRET:
    FP8_DECODE_DOTS.append(pytest.param(torch.bfloat16, False, id="bf16-bf16-dots"))


@pytest.mark.parametrize("rows", [16, 1], ids=["rows16", "group-rows"])
@pytest.mark.parametrize("dtype,fp16_dots", FP8_DECODE_DOTS)
@pytest.mark.parametrize("scales", [(1.0, 1.0), (0.02, 0.05)])
@pytest.mark.parametrize("block_size,heads,kv_heads,head_dim,lens", DECODE_CASES[:3])
def test_paged_decode_over_an_fp8_cache(
    block_size, heads, kv_heads, head_dim, lens, scales, dtype, fp16_dots, rows, monkeypatch
):
    """Each value read as it is stored, times its scale: the float64 attention over the
    dequantized cache (the kernel computes in fp16 or q's dtype; its q tile padded to 16 rows
    or not, ``FP8_GROUP_ROWS``)."""
    from nano_kvcache.attention import decode, paged_decode

    monkeypatch.setattr(decode, "GROUP_ROWS", rows)
    monkeypatch.setattr(decode, "FP8_GROUP_ROWS", rows)

    rng = random.Random(block_size)
    g = torch.Generator(device=DEVICE).manual_seed(7)
    num_blocks = sum(-(-n // block_size) for n in lens) + 3
    k8, k_real, v8, v_real = fp8_caches(num_blocks, kv_heads, block_size, head_dim, g, scales)
    tables = tables_for(lens, block_size, num_blocks, rng)
    q = query(len(lens), heads, head_dim, scales[0], g).to(dtype)
    ref = paged_attention_reference(q, k_real, v_real, tables, [1] * len(lens), lens, 0.1)
    wrong = paged_attention_reference(q, k_real * 2, v_real, tables, [1] * len(lens), lens, 0.1)
    assert (wrong - ref).norm() / ref.norm() > 5 * TOL[dtype]  # (the check sees k_scale)
    for splits in (1, 4):
        out = torch.full_like(q, float("nan"))
        paged_decode(
            q,
            k8,
            v8,
            padded(tables),
            torch.tensor(lens, dtype=torch.int32, device=DEVICE),
            0.1,
            out=out,
            num_splits=splits,
            k_scale=scales[0],
            v_scale=scales[1],
            fp16_dots=fp16_dots,
        )
        check(out, ref, dtype)


# (Triton 3.6's interpreter rounds to e4m3 wrongly just below a power of two, 127.97 -> 64:
# on the CPU, scales that keep the new tokens' K/V on the FP8 grid exactly)
PREFILL_SCALES = [(1.0, 1.0), (2**-5, 2**-4)] + ([(0.02, 0.05)] if DEVICE == "cuda" else [])


@pytest.mark.parametrize("tma", [False, True], ids=["pointers", "tma"])
@pytest.mark.parametrize("scales", PREFILL_SCALES)
@pytest.mark.parametrize("block_size,heads,kv_heads,head_dim,chunks", PREFILL_CASES[:4])
def test_paged_prefill_over_an_fp8_cache(
    block_size, heads, kv_heads, head_dim, chunks, tma, scales
):
    """The cached keys read from the FP8 cache, the new ones from the step's K/V rounded as
    the cache holds them (their slots poisoned): the same as attention over the whole
    dequantized cache."""
    from nano_kvcache.attention import paged_prefill

    if tma and DEVICE == "cuda" and torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("TMA needs Hopper or later")
    dtype = DTYPES[-1]
    rng = random.Random(block_size * heads)
    g = torch.Generator(device=DEVICE).manual_seed(3)
    query_lens = [n for n, _ in chunks]
    lens = [n + c for n, c in chunks]
    num_blocks = sum(-(-n // block_size) for n in lens) + 3
    k8, k_real, v8, v_real = fp8_caches(num_blocks, kv_heads, block_size, head_dim, g, scales)
    tables = tables_for(lens, block_size, num_blocks, rng)
    q = query(sum(query_lens), heads, head_dim, scales[0], g).to(dtype)
    qsl = torch.tensor(
        [0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE
    )
    ref = paged_attention_reference(q, k_real, v_real, tables, query_lens, lens, 0.1)
    wrong = paged_attention_reference(q, k_real * 2, v_real, tables, query_lens, lens, 0.1)
    assert (wrong - ref).norm() / ref.norm() > 5 * TOL[dtype]  # (the check sees k_scale)
    # The new tokens' K/V as the model computes them: the cached values' exact real values;
    # their slots in the FP8 caches then hold e4m3's NaN: the kernel must read them from k, v.
    k, v = new_kv(k_real.to(dtype), v_real.to(dtype), tables, chunks, heads)
    spots = [(t[p // block_size], p % block_size) for t, (n, c) in zip(tables, chunks)
             for p in range(c, c + n)]  # fmt: skip
    pages = torch.tensor([page for page, _ in spots], device=DEVICE)
    rows = torch.tensor([row for _, row in spots], device=DEVICE)
    for cache in (k8, v8):
        cache.view(torch.uint8)[pages, :, rows] = 0x7F
    out = torch.full_like(q, float("nan"))
    paged_prefill(
        q,
        k,
        v,
        k8,
        v8,
        padded(tables),
        torch.tensor(lens, dtype=torch.int32, device=DEVICE),
        qsl,
        max(query_lens),
        0.1,
        out=out,
        tma=tma,
        cached_prefix=any(c for _, c in chunks),
        k_scale=scales[0],
        v_scale=scales[1],
    )
    check(out, ref, dtype)


def test_the_kernels_refuse_caches_they_cannot_read():
    from nano_kvcache.attention import paged_decode

    q = torch.randn(2, 4, 32, device=DEVICE)
    cache = torch.zeros(4, 2, 16, 32, device=DEVICE)
    tables = torch.zeros(2, 1, dtype=torch.int32, device=DEVICE)
    lens = torch.ones(2, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="q's dtype"):
        paged_decode(q, cache.half(), cache.half(), tables, lens, 0.1)
    with pytest.raises(ValueError, match="are for FP8 caches"):
        paged_decode(q, cache, cache, tables, lens, 0.1, k_scale=0.5)
    fp8 = cache.to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="finite and > 0"):
        paged_decode(q, fp8, fp8, tables, lens, 0.1, k_scale=0.0)


def test_decode_in_a_cuda_graph_with_changing_lengths():
    if DEVICE != "cuda":
        pytest.skip("CUDA graphs need a GPU")
    from nano_kvcache.attention import paged_decode

    g = torch.Generator(device="cuda").manual_seed(0)
    k_cache, v_cache = make_cache(600, 8, 16, 128, torch.bfloat16, g)
    q = torch.randn(8, 16, 128, generator=g, device="cuda").to(torch.bfloat16)
    tables = torch.arange(8 * 64, dtype=torch.int32, device="cuda").view(8, 64)
    seq_lens = torch.ones(8, dtype=torch.int32, device="cuda")
    order = torch.arange(8, dtype=torch.int32, device="cuda")
    out = torch.empty_like(q)
    paged_decode(q, k_cache, v_cache, tables, seq_lens, 0.088, out=out, order=order)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        paged_decode(q, k_cache, v_cache, tables, seq_lens, 0.088, out=out, order=order)
    for lens in ([1, 2, 3, 4, 5, 6, 7, 8], [1000, 17, 300, 1024, 5, 999, 64, 65]):
        seq_lens.copy_(torch.tensor(lens))
        order.copy_(torch.tensor(sorted(range(8), key=lens.__getitem__, reverse=True)))
        out.fill_(float("nan"))
        graph.replay()
        ref = paged_attention_reference(q, k_cache, v_cache, tables.tolist(), [1] * 8, lens, 0.088)
        check(out, ref, torch.bfloat16)


@pytest.fixture
def compiled(monkeypatch):
    """The Triton kernels compiled (or loaded from disk) while the test runs."""
    if DEVICE != "cuda":
        pytest.skip("compilation happens on the GPU only")
    import triton

    if not hasattr(triton, "knobs"):
        pytest.skip("the compile hook needs Triton >= 3.4")
    names = []
    monkeypatch.setattr(
        triton.knobs.runtime, "jit_cache_hook", lambda *a, **k: names.append(k.get("repr"))
    )
    return names


def test_mixed_batch_slices_compile_nothing_new(compiled):
    """In a mixed batch the decodes' metadata are slices at any offset and the block-table
    width follows the batch; none of that may compile another kernel (0.3-0.8 s each)."""
    from nano_kvcache.attention import paged_decode, paged_prefill

    g = torch.Generator(device="cuda").manual_seed(1)
    k_cache, v_cache = make_cache(400, 8, 16, 128, torch.bfloat16, g)
    rng = random.Random(3)
    for step, (offset, width) in enumerate([(0, 16), (1, 17), (2, 19), (3, 16), (5, 33)]):
        lens = [rng.randint(1, 16 * 16) for _ in range(offset + 6)]
        tables = tables_for(lens, 16, 400, rng)
        table = torch.zeros(len(lens), width, dtype=torch.int32)
        for i, t in enumerate(tables):
            table[i, : len(t)] = torch.tensor(t, dtype=torch.int32)
        table, seq_lens = table.cuda(), torch.tensor(lens, dtype=torch.int32, device="cuda")
        q = torch.randn(len(lens) - offset, 16, 128, generator=g, device="cuda").to(torch.bfloat16)
        ref = paged_attention_reference(
            q, k_cache, v_cache, tables[offset:], [1] * len(q), lens[offset:], 0.088
        )
        # The decode order (longest first) is a slice of the same packed buffer.
        longest = sorted(range(len(q)), key=lens[offset:].__getitem__, reverse=True)
        order = torch.tensor([0] * offset + longest, dtype=torch.int32, device="cuda")
        for seq_order in (None, order[offset:]):
            out = torch.full_like(q, float("nan"))
            paged_decode(
                q,
                k_cache,
                v_cache,
                table[offset:],
                seq_lens[offset:],
                0.088,
                out=out,
                order=seq_order,
            )
            check(out, ref, torch.bfloat16)
        # One prefill token per sequence, with query_start_loc a slice at the offset too (the
        # engine packs all step metadata into one buffer).
        starts = torch.arange(len(q) + 1, dtype=torch.int32)
        qsl = torch.cat([torch.zeros(offset, dtype=torch.int32), starts]).cuda()
        out = torch.full_like(q, float("nan"))
        k, v = new_kv(
            k_cache.clone(),
            v_cache.clone(),
            tables[offset:],
            [(1, n - 1) for n in lens[offset:]],
            16,
        )
        paged_prefill(
            q,
            k,
            v,
            k_cache,
            v_cache,
            table[offset:],
            seq_lens[offset:],
            qsl[offset:],
            1,
            0.088,
            out=out,
        )
        check(out, ref, torch.bfloat16)
        if step == 0:
            compiled.clear()  # the first step compiles (or loads) each kernel once
    assert compiled == []


def test_prefill_token_counts_compile_nothing_new(compiled):
    """Each prefill step has its own number of tokens (the TMA descriptors' shape) and its own
    offsets of the new K/V: none of it may compile another kernel."""
    from nano_kvcache.attention import paged_prefill

    g = torch.Generator(device="cuda").manual_seed(2)
    rng = random.Random(4)
    for step, chunks in enumerate([[(40, 0), (3, 20)], [(129, 7)], [(1, 0), (17, 0), (300, 33)]]):
        lens = [n + c for n, c in chunks]
        query_lens = [n for n, _ in chunks]
        k_cache, v_cache = make_cache(64, 8, 16, 128, torch.bfloat16, g)
        tables = tables_for(lens, 16, 64, rng)
        q = torch.randn(sum(query_lens), 16, 128, generator=g, device="cuda").to(torch.bfloat16)
        ref = paged_attention_reference(q, k_cache, v_cache, tables, query_lens, lens, 0.088)
        k, v = new_kv(k_cache, v_cache, tables, chunks, 16)
        qsl = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
        out = torch.full_like(q, float("nan"))
        paged_prefill(
            q,
            k,
            v,
            k_cache,
            v_cache,
            padded(tables),
            torch.tensor(lens, dtype=torch.int32, device="cuda"),
            qsl.cuda(),
            max(query_lens),
            0.088,
            out=out,
        )
        check(out, ref, torch.bfloat16)
        if step == 0:
            compiled.clear()
    assert compiled == []


def test_prefill_rejects_bad_new_kv():
    from nano_kvcache.attention import paged_prefill

    q = torch.randn(5, 4, 64, device=DEVICE, dtype=torch.float16)
    k_cache = torch.randn(4, 2, 16, 64, device=DEVICE, dtype=torch.float16)
    tables = torch.zeros(1, 1, dtype=torch.int32, device=DEVICE)
    meta = (tables, torch.tensor([5], dtype=torch.int32, device=DEVICE))
    qsl = torch.tensor([0, 5], dtype=torch.int32, device=DEVICE)
    k = torch.randn(5, 4, 64, device=DEVICE, dtype=torch.float16)  # q's heads, not kv heads
    with pytest.raises(ValueError, match="k and v must be"):
        paged_prefill(q, k, k, k_cache, k_cache, *meta, qsl, 5, 0.1)
    k = torch.randn(5, 2, 64, device=DEVICE, dtype=torch.float16)
    with pytest.raises(ValueError, match="block_n"):
        paged_prefill(q, k, k, k_cache, k_cache, *meta, qsl, 5, 0.1, tile=(32, 64, 4, 2))
    with pytest.raises(ValueError, match="contiguous head_dim"):
        strided = k.transpose(1, 2).contiguous().transpose(1, 2)
        paged_prefill(q, strided, strided, k_cache, k_cache, *meta, qsl, 5, 0.1)
    k = torch.randn(5, 2, 72, device=DEVICE, dtype=torch.float16)[:, :, :64]  # 144-byte rows
    with pytest.raises(ValueError, match="tma=True"):
        paged_prefill(q, k, k, k_cache, k_cache, *meta, qsl, 5, 0.1, tma=True)


def test_decode_rejects_a_bad_order():
    from nano_kvcache.attention import paged_decode

    q = torch.randn(3, 4, 64, device=DEVICE, dtype=torch.float16)
    k_cache = torch.randn(4, 2, 16, 64, device=DEVICE, dtype=torch.float16)
    tables = torch.zeros(3, 1, dtype=torch.int32, device=DEVICE)
    lens = torch.ones(3, dtype=torch.int32, device=DEVICE)
    for order in (torch.arange(2, dtype=torch.int32), torch.arange(3, dtype=torch.int64)):
        with pytest.raises(ValueError, match="order must be int32"):
            paged_decode(q, k_cache, k_cache, tables, lens, 0.1, order=order.to(DEVICE))


@pytest.mark.parametrize("cache", ["16", "64", "fp8"])
@pytest.mark.parametrize("direct", [False, True], ids=["dispatched", "direct"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_step_s_launches_serve_every_layer(dtype, direct, cache, monkeypatch):
    """``PrefillLaunches`` and ``DecodeLaunches`` (one step's attention, launched layer after
    layer; with ``nano_kvcache.relaunch.DIRECT`` the later layers straight to the compiled
    kernels) against each layer's own ``paged_prefill`` / ``paged_decode``: bit for bit, layer
    after layer with other caches (FP8 ones with other scales) and other q, k, v, where a
    layer's q has other strides (the launch worked out again), through the caches' TMA path
    (blocks of 64), with one decode split and no order. Inside a CUDA graph too."""
    from nano_kvcache import relaunch
    from nano_kvcache.attention import (
        DecodeLaunches,
        PrefillLaunches,
        paged_decode,
        paged_prefill,
    )
    from nano_kvcache.attention import decode as decode_module
    from nano_kvcache.attention import prefill as prefill_module

    monkeypatch.setattr(relaunch, "DIRECT", direct)
    fp8 = cache == "fp8"
    if fp8 and dtype != torch.bfloat16:
        pytest.skip("FP8 caches: under bf16 (their other dtypes: the FP8 tests above)")
    block_size, heads, kv_heads, head_dim, layers = (16 if fp8 else int(cache)), 16, 8, 128, 3
    chunks = [(300, 0), (77, 500)]  # (new tokens, cached before them)
    decode_lens = [1, 640, 2000, 33]
    rng = random.Random(7)
    g = torch.Generator(device=DEVICE).manual_seed(7)
    lens = [n + c for n, c in chunks]
    num_blocks = sum(-(-n // block_size) for n in lens + decode_lens) + 3
    if fp8:  # (each layer's caches with scales of their own)
        scales = [(0.5, 2.0), (1.5, 0.25), (1.0, 1.0)]
        caches = []
        for k_scale, v_scale in scales:
            k8, _, v8, _ = fp8_caches(
                num_blocks, kv_heads, block_size, head_dim, g, (k_scale, v_scale)
            )
            caches.append((k8, v8))
    else:
        scales = [(1.0, 1.0)] * 3
        shape = (num_blocks, kv_heads, block_size, head_dim, dtype, g)
        caches = [make_cache(*shape) for _ in range(3)]
    tables = padded(tables_for(lens, block_size, num_blocks, rng))
    decode_tables = padded(tables_for(decode_lens, block_size, num_blocks, rng))
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    decode_seq_lens = torch.tensor(decode_lens, dtype=torch.int32, device=DEVICE)
    order = torch.tensor([2, 1, 3, 0], dtype=torch.int32, device=DEVICE)
    qsl = torch.tensor([0, 300, 377], dtype=torch.int32, device=DEVICE)
    tokens, scale = 377, head_dim**-0.5

    def layer_inputs():
        qkv = torch.randn(tokens, heads + 2 * kv_heads, head_dim, generator=g, device=DEVICE)
        qkv = (qkv * (10 if fp8 else 1)).to(dtype)
        return qkv[:, :heads], qkv[:, heads : heads + kv_heads], qkv[:, heads + kv_heads :]

    inputs = [layer_inputs() for _ in range(layers)]
    # the last layer's q contiguous, not a view of a qkv buffer: other strides
    inputs.append((inputs[0][0].contiguous(), *inputs[0][1:]))
    prefill_layers = list(zip(inputs, caches + caches[:1], scales + scales[:1]))
    decode_q = [torch.randn(4, heads, head_dim, generator=g, device=DEVICE).to(dtype)] * 2
    wider = torch.randn(4, heads + 8, head_dim, generator=g, device=DEVICE).to(dtype)
    decode_q.append(wider[:, :heads])  # (other strides)
    decode_layers = list(zip(decode_q, caches, scales))

    def each_alone():
        outs = []
        for (q, k, v), (kc, vc), (ks, vs) in prefill_layers:
            args = (q, k, v, kc, vc, tables, seq_lens, qsl, 300, scale)
            outs.append(paged_prefill(*args, k_scale=ks, v_scale=vs))
        for q, (kc, vc), (ks, vs) in decode_layers:
            args = (q, kc, vc, decode_tables, decode_seq_lens, scale)
            outs.append(paged_decode(*args, order=order, k_scale=ks, v_scale=vs))
        for q, (kc, vc), (ks, vs) in decode_layers[:2]:
            args = (q, kc, vc, decode_tables, decode_seq_lens, scale)
            outs.append(paged_decode(*args, num_splits=1, k_scale=ks, v_scale=vs))
        return outs

    def as_a_step(outs):
        prefill = PrefillLaunches(tables, seq_lens, qsl, 300)
        decode = DecodeLaunches(decode_tables, decode_seq_lens, order)
        one_split = DecodeLaunches(decode_tables, decode_seq_lens, num_splits=1)
        views = iter(outs)
        for (q, k, v), (kc, vc), (ks, vs) in prefill_layers:
            prefill(q, k, v, kc, vc, scale, next(views), ks, vs)
        for q, (kc, vc), (ks, vs) in decode_layers:
            decode(q, kc, vc, scale, next(views), ks, vs)
        for q, (kc, vc), (ks, vs) in decode_layers[:2]:
            one_split(q, kc, vc, scale, next(views), ks, vs)

    expected = each_alone()
    outs = [torch.full_like(x, float("nan")) for x in expected]
    dispatched = []
    kernels = (decode_module._decode_kernel, decode_module._merge_kernel)
    for kernel in (prefill_module._prefill_kernel, *kernels):
        run = kernel.run

        def counted(*args, run=run, name=kernel.__name__, **kwargs):
            dispatched.append(name)
            return run(*args, **kwargs)

        monkeypatch.setattr(kernel, "run", counted)
    as_a_step(outs)
    # Through Triton's dispatch: every launch (4 chunks' and 3 + 2 decodes', 3 merges);
    # direct: the first of each and those of the layer with other strides (worked out again).
    counts = {name: dispatched.count(name) for name in set(dispatched)}
    if direct and DEVICE == "cuda":
        assert counts == {"_prefill_kernel": 2, "_decode_kernel": 3, "_merge_kernel": 2}
    else:
        assert counts == {"_prefill_kernel": 4, "_decode_kernel": 5, "_merge_kernel": 3}
    for layer, (got, want) in enumerate(zip(outs, expected)):
        assert not torch.isnan(want).any()
        assert torch.equal(got, want), f"launch {layer} differs"
    if DEVICE == "cuda":
        for x in outs:
            x.fill_(float("nan"))
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            as_a_step(outs)
        graph.replay()
        torch.cuda.synchronize()
        for layer, (got, want) in enumerate(zip(outs, expected)):
            assert torch.equal(got, want), f"launch {layer} differs in a CUDA graph"
