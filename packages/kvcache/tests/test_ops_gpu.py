"""The CUDA kernels against the torch implementations, on random data with poisoned outputs."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from nano_kvcache import ops  # noqa: E402
from nano_kvcache.layout import KVCacheLayout  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
DTYPES = [torch.float16, torch.bfloat16, torch.float32]


@pytest.fixture(autouse=True, scope="module")
def _needs_extension():
    if not ops.extension_available():
        pytest.fail("the CUDA extension is not built: these tests would only test the fallback")


def poisoned(shape, dtype, generator):
    """A cache full of random values far from the data's range (never zeros)."""
    return (torch.rand(shape, generator=generator, device="cuda") * 100 + 1000).to(dtype)


def kv_views(n, heads, head_dim, dtype, generator, contiguous):
    if contiguous:
        key = torch.randn(n, heads, head_dim, generator=generator, device="cuda").to(dtype)
        value = torch.randn(n, heads, head_dim, generator=generator, device="cuda").to(dtype)
        return key, value
    # K and V sliced out of a fused qkv projection: token stride 4 * heads * head_dim.
    qkv = torch.randn(n, 4 * heads * head_dim, generator=generator, device="cuda").to(dtype)
    size = heads * head_dim
    return (
        qkv[:, 2 * size : 3 * size].view(n, heads, head_dim),
        qkv[:, 3 * size :].view(n, heads, head_dim),
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "heads,head_dim,block_size",
    [(8, 128, 16), (5, 96, 16), (1, 64, 1), (3, 7, 5), (2, 256, 256)],
)
@pytest.mark.parametrize("contiguous", [True, False])
@pytest.mark.parametrize("slot_dtype", [torch.int64, torch.int32])
def test_store_kvcache(dtype, heads, head_dim, block_size, contiguous, slot_dtype):
    g = torch.Generator(device="cuda").manual_seed(heads * 1000 + head_dim)
    num_blocks = 64
    n = min(300, num_blocks * block_size - 1)
    key, value = kv_views(n, heads, head_dim, dtype, g, contiguous)
    slots = torch.randperm(num_blocks * block_size, generator=g, device="cuda")[:n]
    slots[::7] = -1  # padding
    slots = slots.to(slot_dtype)
    k_cache = poisoned((num_blocks, heads, block_size, head_dim), dtype, g)
    v_cache = poisoned((num_blocks, heads, block_size, head_dim), dtype, g)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    ops.store_kvcache(key, value, k_cache, v_cache, slots)
    ops.store_kvcache_torch(key, value, k_ref, v_ref, slots)
    torch.cuda.synchronize()
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)
    written = slots[slots >= 0].long()
    blocks, rows = written // block_size, written % block_size
    assert torch.equal(k_cache[blocks, :, rows], key[slots >= 0])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,head_dim,block_size", [(8, 128, 16), (3, 7, 5), (2, 256, 256)])
@pytest.mark.parametrize("contiguous", [True, False])
def test_store_kvcache_into_fp8(dtype, heads, head_dim, block_size, contiguous):
    """The quantizing kernel stores what the torch path stores, bit for bit (both round to
    nearest, ties to even, and saturate), K and V with their own scales."""
    g = torch.Generator(device="cuda").manual_seed(heads * 1000 + head_dim)
    num_blocks = 64
    n = min(300, num_blocks * block_size - 1)
    key, value = kv_views(n, heads, head_dim, dtype, g, contiguous)
    key.mul_(50), value.mul_(900)  # (in place: views keep their strides; some saturate)
    slots = torch.randperm(num_blocks * block_size, generator=g, device="cuda")[:n]
    slots[::7] = -1
    shape = (num_blocks, heads, block_size, head_dim)
    k_cache = poisoned(shape, torch.float32, g).to(torch.float8_e4m3fn)
    v_cache = poisoned(shape, torch.float32, g).to(torch.float8_e4m3fn)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    ops.store_kvcache(key, value, k_cache, v_cache, slots, 0.3, 1.7)
    ops.store_kvcache_torch(key, value, k_ref, v_ref, slots, 0.3, 1.7)
    torch.cuda.synchronize()
    assert torch.equal(k_cache.view(torch.uint8), k_ref.view(torch.uint8))
    assert torch.equal(v_cache.view(torch.uint8), v_ref.view(torch.uint8))


def test_store_kvcache_on_a_side_stream_and_in_a_cuda_graph():
    g = torch.Generator(device="cuda").manual_seed(7)
    n, heads, head_dim, block_size, num_blocks = 40, 8, 128, 16, 16
    key = torch.empty(n, heads, head_dim, device="cuda", dtype=torch.bfloat16)
    value = torch.empty_like(key)
    slots = torch.empty(n, device="cuda", dtype=torch.int64)
    k_cache = poisoned((num_blocks, heads, block_size, head_dim), torch.bfloat16, g)
    v_cache = poisoned((num_blocks, heads, block_size, head_dim), torch.bfloat16, g)

    def fill():
        key.copy_(torch.randn(key.shape, generator=g, device="cuda"))
        value.copy_(torch.randn(key.shape, generator=g, device="cuda"))
        slots.copy_(torch.randperm(num_blocks * block_size, generator=g, device="cuda")[:n])

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        ops.store_kvcache(key, value, k_cache, v_cache, slots)  # warm-up on a side stream
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ops.store_kvcache(key, value, k_cache, v_cache, slots)
    for _ in range(3):
        fill()
        k_ref, v_ref = k_cache.clone(), v_cache.clone()
        ops.store_kvcache_torch(key, value, k_ref, v_ref, slots)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)


@pytest.mark.parametrize("block_size", [1, 16, 256])
def test_compute_slot_mapping(block_size):
    g = torch.Generator().manual_seed(block_size)
    num_seqs, max_blocks = 37, 20
    tables = torch.randint(0, 10_000, (num_seqs, max_blocks), generator=g, dtype=torch.int32)
    tables[5, 4:] = -1
    lengths = torch.randint(0, 40, (num_seqs,), generator=g)
    lengths[::9] = 1  # decodes
    start = torch.randint(0, max_blocks * block_size, (num_seqs,), generator=g, dtype=torch.int32)
    start[5], lengths[5] = 4 * block_size - 1, 3  # reaches the -1 entries of its table
    start[7], lengths[7] = max_blocks * block_size - 1, 3  # runs past the end of its table
    qsl = torch.zeros(num_seqs + 1, dtype=torch.int32)
    qsl[1:] = lengths.cumsum(0)
    num_tokens = int(qsl[-1]) + 13
    args = [t.cuda() for t in (tables, qsl, start)]
    slots, positions = ops.compute_slot_mapping(*args, block_size, num_tokens)
    ref_slots, ref_pos = ops.compute_slot_mapping_torch(tables, qsl, start, block_size, num_tokens)
    assert torch.equal(slots.cpu(), ref_slots) and torch.equal(positions.cpu(), ref_pos)
    assert (ref_slots[: int(qsl[-1])] == -1).any() and (ref_slots[: int(qsl[-1])] >= 0).any()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,head_dim,block_size", [(8, 128, 16), (5, 96, 16), (3, 7, 3)])
def test_copy_blocks(dtype, heads, head_dim, block_size):
    g = torch.Generator(device="cuda").manual_seed(3)
    layout = KVCacheLayout(
        num_layers=4, num_kv_heads=heads, head_dim=head_dim, block_size=block_size, dtype=dtype
    )
    cache = layout.allocate(32, "cuda")
    cache.copy_(poisoned(cache.shape, dtype, g))
    ref = cache.clone()
    perm = torch.randperm(32, generator=torch.Generator().manual_seed(5))
    mapping = torch.stack([perm[:10], perm[10:20]], dim=1)
    ops.copy_blocks(cache, mapping)
    ops.copy_blocks_torch(ref, mapping.cuda())
    torch.cuda.synchronize()
    assert torch.equal(cache, ref)
    assert torch.equal(cache[:, :, perm[10:20]], cache[:, :, perm[:10]])


def test_extension_errors_surface_as_exceptions():
    key = torch.randn(4, 2, 8, device="cuda")
    cache = torch.randn(3, 2, 4, 8, device="cuda")
    with pytest.raises(ValueError, match="must be on cuda"):
        ops.store_kvcache(key, key, cache, cache, torch.arange(4))
