"""The fused q/k norm + rotary kernel against float64 torch: Qwen3-like (norms) and Llama-like
(none) heads, head counts and head_dims that are not powers of two, fp32 and bf16, outputs
poisoned first. GPU-marked; with TRITON_INTERPRET=1 it also runs on the CPU."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")

from nano_models.layers.rotary import RotaryEmbedding
from nano_models.layers.rotary_triton import qk_norm_rope

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        DEVICE == "cpu" and not INTERPRET, reason="needs a CUDA GPU (or TRITON_INTERPRET=1)"
    ),
]


def reference(qkv, positions, cos_sin, heads, kv_heads, weights, eps):
    """float64: per-head RMSNorm (when weights are given), then neox rotary."""
    dim = cos_sin.shape[1]
    x = qkv.double()
    q = x[:, : heads * dim].view(-1, heads, dim)
    k = x[:, heads * dim : (heads + kv_heads) * dim].view(-1, kv_heads, dim)
    cos, sin = cos_sin.double()[positions].unsqueeze(1).chunk(2, dim=-1)

    def apply(t, w):
        if w is not None:
            t = t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + eps) * w.double()
        t1, t2 = t.chunk(2, dim=-1)
        return torch.cat([t1 * cos - t2 * sin, t2 * cos + t1 * sin], dim=-1)

    return apply(q, weights[0]), apply(k, weights[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("heads,kv_heads,dim", [(16, 8, 128), (28, 4, 64), (6, 2, 96)])
def test_matches_float64(dtype, norm, heads, kv_heads, dim):
    g = torch.Generator().manual_seed(heads * dim)
    tokens, eps = 37, 1e-6
    qkv = (torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=g) * 2).to(DEVICE, dtype)
    positions = torch.randint(0, 4096, (tokens,), generator=g).to(DEVICE)
    rotary = RotaryEmbedding(dim, 4096, 1_000_000.0).to(DEVICE)
    weights = (None, None)
    if norm:
        weights = tuple((torch.rand(dim, generator=g) + 0.5).to(DEVICE, dtype) for _ in range(2))
    q, k = qk_norm_rope(qkv, positions, rotary.cos_sin, heads, kv_heads, *weights, eps)
    want_q, want_k = reference(qkv, positions, rotary.cos_sin, heads, kv_heads, weights, eps)
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 4e-2, "rtol": 2e-2}
    assert q.dtype == k.dtype == dtype
    torch.testing.assert_close(q.double(), want_q, **tol)
    torch.testing.assert_close(k.double(), want_k, **tol)
    # Through the layer: the same as its eager path (split, norms, rotary).
    if norm:
        from nano_models.layers.norm import RMSNorm

        norms = [RMSNorm(dim, eps).to(DEVICE) for _ in range(2)]
        for n, w in zip(norms, weights):
            n.weight.data = w
    else:
        norms = []
    eager = rotary.split_qkv(positions, qkv, heads, kv_heads, *norms)
    rotary.fused = qk_norm_rope
    fused = rotary.split_qkv(positions, qkv, heads, kv_heads, *norms)
    for a, b in zip(fused, eager):
        torch.testing.assert_close(a, b, **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("heads,kv_heads,dim,block_size", [(16, 8, 128, 16), (6, 2, 96, 4)])
def test_stores_k_and_v_as_store_kvcache(dtype, norm, heads, kv_heads, dim, block_size):
    """Given the cache, the kernel also writes each token's rotated K and its V into its slot:
    the same cache as the eager path (rotary, then nano_kvcache's store). Padding slots (-1)
    and slots past the cache write nothing."""
    from nano_models.layers.norm import RMSNorm

    g = torch.Generator().manual_seed(dim + norm)
    tokens, num_blocks = 11, 5
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=g).to(DEVICE, dtype)
    positions = torch.randint(0, 512, (tokens,), generator=g).to(DEVICE)
    rotary = RotaryEmbedding(dim, 512, 10_000.0).to(DEVICE)
    norms = [RMSNorm(dim, 1e-6).to(DEVICE, dtype) for _ in range(2)] if norm else []
    for n in norms:
        n.weight.data = (torch.rand(dim, generator=g) + 0.5).to(DEVICE, dtype)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:tokens]
    slots[3], slots[7] = -1, num_blocks * block_size + 2
    slots = slots.to(DEVICE)

    def caches():
        shape = (num_blocks, kv_heads, block_size, dim)
        k_cache = torch.full(shape, 7.0, dtype=dtype, device=DEVICE)
        return k_cache, torch.full_like(k_cache, -7.0)

    want_k, want_v = caches()
    eager = rotary.split_qkv(
        positions, qkv, heads, kv_heads, *norms, kv_cache=(want_k, want_v, slots)
    )
    assert (want_k != 7.0).any() and (want_v != -7.0).any()
    rotary.fused = qk_norm_rope
    got_k, got_v = caches()
    fused = rotary.split_qkv(
        positions, qkv, heads, kv_heads, *norms, kv_cache=(got_k, got_v, slots)
    )
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 4e-2, "rtol": 2e-2}
    torch.testing.assert_close(got_k, want_k, **tol)
    assert torch.equal(got_v, want_v)
    for a, b in zip(fused, eager):
        torch.testing.assert_close(a, b, **tol)


@pytest.mark.skipif(INTERPRET, reason="Triton 3.6's interpreter rounds some values to e4m3 wrongly")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_stores_k_and_v_into_an_fp8_cache_as_store_kvcache(dtype):
    """Into an FP8 cache: K (normed, rotated, in the model's dtype) and V divided by their
    scales and rounded as nano_kvcache's store rounds them, bit for bit where the rotated K
    is the same, and within one e4m3 step where it differs by the last bit of the dtype."""
    heads, kv_heads, dim, block_size, tokens, num_blocks = 8, 2, 128, 16, 23, 4
    g = torch.Generator().manual_seed(5)
    qkv = (torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=g) * 30).to(DEVICE, dtype)
    positions = torch.randint(0, 512, (tokens,), generator=g).to(DEVICE)
    rotary = RotaryEmbedding(dim, 512, 10_000.0).to(DEVICE)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:tokens].to(DEVICE)
    shape = (num_blocks, kv_heads, block_size, dim)

    def caches():
        return (torch.zeros(shape, device=DEVICE).to(torch.float8_e4m3fn) for _ in range(2))

    want_k, want_v = caches()
    rotary.split_qkv(positions, qkv, heads, kv_heads, kv_cache=(want_k, want_v, slots, 0.1, 0.2))
    rotary.fused = qk_norm_rope
    got_k, got_v = caches()
    rotary.split_qkv(positions, qkv, heads, kv_heads, kv_cache=(got_k, got_v, slots, 0.1, 0.2))
    assert torch.equal(got_v.view(torch.uint8), want_v.view(torch.uint8))
    step = want_k.float().abs() * 2**-3 + 2**-9  # (one e4m3 step at these magnitudes)
    assert ((got_k.float() - want_k.float()).abs() <= step).all()


def test_bad_arguments():
    qkv = torch.randn(4, 10 * 64, device=DEVICE)
    cos_sin = RotaryEmbedding(64, 128, 10_000.0).cos_sin.to(DEVICE)
    positions = torch.arange(4, device=DEVICE)
    with pytest.raises(ValueError, match="heads"):
        qk_norm_rope(qkv, positions, cos_sin, 8, 4)
    with pytest.raises(ValueError, match="both norm weights"):
        qk_norm_rope(qkv, positions, cos_sin, 6, 2, torch.ones(64, device=DEVICE), None)
    cache = torch.zeros(3, 2, 16, 32, device=DEVICE)  # head_dim 32, not 64
    slots = torch.zeros(4, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match="does not hold"):
        qk_norm_rope(qkv, positions, cos_sin, 8, 1, kv_cache=(cache, cache, slots))
