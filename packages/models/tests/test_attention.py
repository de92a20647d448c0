"""The torch attention backend against a float64 one-query-at-a-time reference, on random
caches with ragged batches: prefills, prefills over a cached prefix, chunks and decodes."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from nano_kvcache.attention_reference import paged_attention_reference
from nano_models import ForwardContext, get_attention_backend
from nano_models.layers.attention import choose_attention_backend

# (new tokens, cached tokens): a fresh prefill, one over a cached prefix, a middle chunk, then
# decodes with short and long contexts.
MIXED = [(9, 0), (5, 12), (7, 3), (1, 0), (1, 17), (1, 30)]


def random_batch(seed, heads, kv_heads, head_dim, block_size, dtype, device="cpu", shapes=MIXED):
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    num_blocks = 128
    k_cache = torch.randn(num_blocks, kv_heads, block_size, head_dim, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, kv_heads, block_size, head_dim, generator=g).to(dtype)
    free = list(range(num_blocks))
    rng.shuffle(free)
    query_lens = [n for n, _ in shapes]
    seq_lens = [n + c for n, c in shapes]
    tables = [[free.pop() for _ in range(-(-length // block_size))] for length in seq_lens]
    q = torch.randn(sum(query_lens), heads, head_dim, generator=g).to(dtype)
    ctx = ForwardContext.build(
        query_lens, seq_lens, tables, block_size, num_prefills=3, device=device
    )
    # The step's own K/V, as the layer hands them over: already in the caches at its slots.
    slots = ctx.slot_mapping.cpu()
    k = k_cache[slots // block_size, :, slots % block_size]
    v = v_cache[slots // block_size, :, slots % block_size]
    return q, k.to(device), v.to(device), k_cache.to(device), v_cache.to(device), ctx, tables


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (8, 1)])
@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param(
            "cuda",
            marks=[
                pytest.mark.gpu,
                pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
            ],
        ),
    ],
)
def test_torch_backend_matches_the_float64_reference(
    heads, kv_heads, block_size, dtype, tol, device
):
    q, k, v, k_cache, v_cache, ctx, tables = random_batch(
        heads + block_size, heads, kv_heads, 16, block_size, dtype, device
    )
    q = q.to(device)
    out = get_attention_backend("torch").forward(q, k, v, k_cache, v_cache, ctx, 0.25).cpu()
    q, k_cache, v_cache = q.cpu(), k_cache.cpu(), v_cache.cpu()
    ref = paged_attention_reference(
        q,
        k_cache,
        v_cache,
        tables,
        [b - a for a, b in zip(ctx.query_start_loc_cpu, ctx.query_start_loc_cpu[1:])],
        ctx.seq_lens_cpu,
        0.25,
    )
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)


def test_unknown_backend_lists_the_available_ones():
    with pytest.raises(
        ValueError,
        match=r"unknown attention backend 'flash'; available: "
        r"\['flash_attn', 'torch', 'triton'\]",
    ):
        get_attention_backend("flash")


def test_backend_choice():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert choose_attention_backend("auto", cpu, 16) == "torch"
    assert choose_attention_backend("torch", cuda, 16) == "torch"
    with pytest.raises(ValueError, match="needs a CUDA device"):
        choose_attention_backend("triton", cpu, 16)
    with pytest.raises(ValueError, match="multiple of 256"):
        choose_attention_backend("flash_attn", cuda, 16)
    with pytest.raises(ValueError, match=r"needs float16 or bfloat16, got torch\.float32"):
        choose_attention_backend("flash_attn", cuda, 256, torch.float32)


def test_a_missing_backend_package_is_named():
    if _importable("flash_attn"):
        pytest.skip("flash-attn imports here")
    with pytest.raises(ValueError, match="needs the flash_attn package, which does not import"):
        get_attention_backend("flash_attn")


def test_auto_takes_flash_attn_only_for_half_precision(monkeypatch):
    """(flash-attn is absent here: where it imports, auto weighs the dtype as well.)"""
    from nano_models.layers import attention

    monkeypatch.setattr(attention, "_load_optional", lambda name: True)
    cuda = torch.device("cuda")
    assert choose_attention_backend("auto", cuda, 256, torch.bfloat16) == "flash_attn"
    assert choose_attention_backend("auto", cuda, 256, torch.float32) == "triton"
    assert choose_attention_backend("auto", cuda, 16, torch.float16) == "triton"


def _importable(module: str) -> bool:
    try:
        __import__(module)
    except ImportError:
        return False
    return True


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize(
    "backend",
    [
        "triton",
        pytest.param(
            "flash_attn",
            marks=pytest.mark.skipif(
                not _importable("flash_attn"), reason="flash-attn is not installed"
            ),
        ),
    ],
)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_backends_match_the_reference(backend, dtype):
    """A mixed batch (prefills, a cached prefix, a chunk, decodes) with 256-token blocks."""
    # Then fresh prefills only (beside the decodes): the kernel without the cached-key path.
    for shapes in (MIXED, [(9, 0), (300, 0), (1, 0), (1, 0), (1, 17), (1, 30)]):
        q, k, v, k_cache, v_cache, ctx, tables = random_batch(
            7, 8, 2, 128, 256, dtype, "cuda", shapes
        )
        assert ctx.cached_prefix == (shapes is MIXED)
        q = q.cuda()
        out = get_attention_backend(backend).forward(q, k, v, k_cache, v_cache, ctx, 0.088)
        qsl = ctx.query_start_loc_cpu
        ref = paged_attention_reference(
            q,
            k_cache,
            v_cache,
            tables,
            [b - a for a, b in itertools.pairwise(qsl)],
            ctx.seq_lens_cpu,
            0.088,
        )
        err = (out.double() - ref).norm() / ref.norm()
        assert err < 2e-2, err


def test_context_knows_whether_a_prefill_follows_cached_tokens():
    tables = [[0], [1], [2]]
    fresh = ForwardContext.build([4, 3, 1], [4, 3, 7], tables, 16, num_prefills=2)
    assert not fresh.cached_prefix  # a decode's context does not count
    chunk = ForwardContext.build([4, 3, 1], [4, 10, 7], tables, 16, num_prefills=2)
    assert chunk.cached_prefix
    assert not ForwardContext.build([1, 1], [5, 7], tables[:2], 16, num_prefills=0).cached_prefix


@pytest.mark.parametrize(
    "args,message",
    [
        (([2, 1], [5, 7], [[0]], 16, 1), "one entry per sequence"),
        (([1, 2], [5, 7], [[0], [1]], 16, 1), "sequence 1 is a decode"),
        (([5], [3], [[0]], 16, 1), r"sequence 0: 5 new tokens, context 3"),
        (([0], [3], [[0]], 16, 1), "sequence 0: 0 new tokens"),
        (([1], [20], [[0]], 16, 1), "1 blocks of 16"),
        (([1], [3], [[0]], 16, 2), r"num_prefills must be in \[0, 1\]"),
    ],
)
def test_context_rejects_lists_that_describe_no_batch(args, message):
    with pytest.raises(ValueError, match=message):
        ForwardContext.build(*args[:4], num_prefills=args[4])


def test_context_lists_the_decodes_longest_first():
    ctx = ForwardContext.build(
        [4, 1, 1, 1, 1], [4, 7, 30, 7, 2], [[0], [1], [2, 3], [4], [5]], 16, num_prefills=1
    )
    assert ctx.decode_order.tolist() == [1, 0, 2, 3]  # ties keep their order
