"""The KV-store ops on the CPU: torch implementations against per-token loops, and validation."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from nano_kvcache import ops  # noqa: E402
from nano_kvcache.layout import KVCacheLayout  # noqa: E402


def loop_store(key, value, k_cache, v_cache, slots):
    block_size = k_cache.shape[2]
    for i, slot in enumerate(slots.tolist()):
        if 0 <= slot < k_cache.shape[0] * block_size:
            k_cache[slot // block_size, :, slot % block_size] = key[i]
            v_cache[slot // block_size, :, slot % block_size] = value[i]


def loop_slot_mapping(tables, qsl, start, block_size, num_tokens):
    slots, positions = [-1] * num_tokens, [0] * num_tokens
    for b in range(len(start)):
        for t in range(qsl[b], min(qsl[b + 1], num_tokens)):
            pos = start[b] + t - qsl[b]
            positions[t] = pos
            index = pos // block_size
            if index < len(tables[b]) and tables[b][index] >= 0:
                slots[t] = tables[b][index] * block_size + pos % block_size
    return slots, positions


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("heads,head_dim,block_size", [(2, 8, 4), (5, 96, 16), (3, 7, 1)])
def test_store_kvcache_matches_a_per_token_loop(dtype, heads, head_dim, block_size):
    g = torch.Generator().manual_seed(0)
    num_blocks, n = 12, 11
    # K and V as views into one fused qkv row per token: a strided token axis.
    qkv = torch.randn(n, 4 * heads * head_dim, generator=g).to(dtype)
    key = qkv[:, 2 * heads * head_dim : 3 * heads * head_dim].view(n, heads, head_dim)
    value = qkv[:, 3 * heads * head_dim :].view(n, heads, head_dim)
    assert not key.is_contiguous()
    slots = torch.randperm(num_blocks * block_size, generator=g)[:n]
    slots[3] = -1  # padding
    cache = torch.randn(2, num_blocks, heads, block_size, head_dim, generator=g).to(dtype)
    expected = cache.clone()
    ops.store_kvcache(key, value, cache[0], cache[1], slots)
    loop_store(key, value, expected[0], expected[1], slots)
    assert torch.equal(cache, expected)


def e4m3_values() -> torch.Tensor:
    """Every finite e4m3 value, from its bits (sign, 4 exponent bits biased by 7, 3 mantissa
    bits; exponent 0 subnormal; S.1111.111 the NaN): the grid an FP8 cache rounds to."""
    values = []
    for bits in range(256):
        sign, exponent, mantissa = bits >> 7, (bits >> 3) & 15, bits & 7
        if exponent == 15 and mantissa == 7:
            continue
        if exponent == 0:
            magnitude = mantissa / 8 * 2.0**-6
        else:
            magnitude = (1 + mantissa / 8) * 2.0 ** (exponent - 7)
        values.append(-magnitude if sign else magnitude)
    return torch.tensor(sorted(set(values)), dtype=torch.float64)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("scales", [(1.0, 1.0), (0.02, 0.37)])
def test_store_kvcache_into_fp8_rounds_each_value_to_the_nearest_e4m3(dtype, scales):
    """Each stored value is the e4m3 value nearest x / scale (by an independent table of the
    format, not torch's cast), saturated at +-448; the error bound of e4m3 holds."""
    g = torch.Generator().manual_seed(1)
    heads, head_dim, block_size, num_blocks, n = 3, 16, 4, 6, 9
    key = (torch.randn(n, heads, head_dim, generator=g) * 60 * scales[0]).to(dtype)
    value = (torch.randn(n, heads, head_dim, generator=g) * 60 * scales[1]).to(dtype)
    key[0, 0, :3] = torch.tensor([1e4, -1e4, 0.0])  # saturated, and zero
    slots = torch.randperm(num_blocks * block_size, generator=g)[:n]
    layout = KVCacheLayout(1, heads, head_dim, block_size, torch.float8_e4m3fn)
    assert layout.bytes_per_block == 2 * heads * head_dim * block_size
    cache = layout.allocate(num_blocks)
    ops.store_kvcache(key, value, cache[0, 0], cache[0, 1], slots, *scales)
    grid = e4m3_values()
    for x, stored, scale in ((key, cache[0, 0], scales[0]), (value, cache[0, 1], scales[1])):
        got = stored[slots // block_size, :, slots % block_size].double()
        target = (x.double() / scale).clamp(-448, 448)
        distance = (target[..., None] - grid).abs()
        nearest = distance.min(-1).values
        # (the stored value is a nearest grid point: ties may go either way)
        assert torch.equal((got - target).abs(), nearest)
        inside = target.abs() >= 2**-6  # (normal numbers: relative error <= 2^-4)
        assert ((got - target).abs()[inside] <= target.abs()[inside] * 2**-4).all()


def test_store_kvcache_validates_its_inputs():
    key = torch.randn(4, 2, 8)
    cache = torch.randn(3, 2, 4, 8)
    slots = torch.arange(4)
    cases = [
        ((key[:, :, :4], key[:, :, :4], cache, cache, slots), "does not hold"),
        ((key, key[:3], cache, cache, slots), "value"),
        ((key.half(), key.half(), cache, cache, slots), "key is torch.float16 but value"),
        ((key.double(), key.double(), cache.double(), cache.double(), slots), "dtype must be"),
        ((key, key, cache, cache, slots.float()), "slot_mapping must be int32/int64"),
        ((key, key, cache, cache, slots[:3]), r"slot_mapping must be int32/int64 \[4\]"),
        (
            (key.transpose(1, 2).contiguous().transpose(1, 2), key, cache, cache, slots),
            "contiguous last dim",
        ),
        (
            (key, key, cache.transpose(1, 2).contiguous().transpose(1, 2), cache, slots),
            "contiguous",
        ),
        ((key, key, cache, cache, slots.to("meta")), "must be on cpu"),
        ((key[0], key[0], cache, cache, slots), "key must be"),
        ((key, key, cache.to(torch.float8_e4m3fn), cache, slots), "both float8_e4m3fn"),
    ]
    for args, message in cases:
        before = cache.clone()
        with pytest.raises(ValueError, match=message):
            ops.store_kvcache(*args)
        assert torch.equal(cache, before)


def test_compute_slot_mapping_matches_a_loop():
    g = torch.Generator().manual_seed(1)
    block_size, num_seqs, max_blocks = 4, 5, 6
    tables = torch.randint(0, 50, (num_seqs, max_blocks), generator=g, dtype=torch.int32)
    tables[2, 3:] = -1
    lengths = [3, 0, 5, 1, 4]  # a sequence with no new token in the middle
    start = torch.tensor([0, 7, 9, 22, 13], dtype=torch.int32)  # seq 3 runs past its table
    qsl = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    num_tokens = int(qsl[-1]) + 3  # padded
    slots, positions = ops.compute_slot_mapping(tables, qsl, start, block_size, num_tokens)
    ref_slots, ref_pos = loop_slot_mapping(
        tables.tolist(), qsl.tolist(), start.tolist(), block_size, num_tokens
    )
    assert slots.dtype == positions.dtype == torch.int64
    assert slots.tolist() == ref_slots and positions.tolist() == ref_pos
    assert -1 in ref_slots[:-3]  # the test reaches the missing-block path
    # A table without blocks: every slot -1, positions still computed.
    empty = tables[:, :0]
    slots, positions = ops.compute_slot_mapping(empty, qsl, start, block_size, num_tokens)
    ref_slots, ref_pos = loop_slot_mapping(
        [[]] * num_seqs, qsl.tolist(), start.tolist(), block_size, num_tokens
    )
    assert slots.tolist() == ref_slots == [-1] * num_tokens and positions.tolist() == ref_pos


def test_compute_slot_mapping_validates_its_inputs():
    tables = torch.zeros(2, 3, dtype=torch.int32)
    qsl = torch.tensor([0, 1, 2], dtype=torch.int32)
    start = torch.zeros(2, dtype=torch.int32)
    with pytest.raises(ValueError, match="block_tables must be int32"):
        ops.compute_slot_mapping(tables.long(), qsl, start, 4, 2)
    with pytest.raises(ValueError, match=r"query_start_loc must be contiguous int32 \[3\]"):
        ops.compute_slot_mapping(tables, qsl[:2], start, 4, 2)
    with pytest.raises(ValueError, match="start_pos must be"):
        ops.compute_slot_mapping(tables, qsl, start.long(), 4, 2)
    with pytest.raises(ValueError, match="bad block_size"):
        ops.compute_slot_mapping(tables, qsl, start, 0, 2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_copy_blocks_copies_whole_blocks_in_every_layer(dtype):
    layout = KVCacheLayout(num_layers=3, num_kv_heads=2, head_dim=8, block_size=4, dtype=dtype)
    cache = layout.allocate(7)
    cache.copy_(torch.randn(cache.shape))
    expected = cache.clone()
    pairs = [(1, 4), (1, 5), (6, 0)]
    ops.copy_blocks(cache, pairs)
    for src, dst in pairs:
        expected[:, :, dst] = expected[:, :, src]
    assert torch.equal(cache, expected)


def test_copy_blocks_validates_its_inputs():
    cache = KVCacheLayout(2, 1, 4, 2, torch.float32).allocate(4)
    cache.zero_()
    with pytest.raises(ValueError, match=r"block ids must be in \[0, 4\)"):
        ops.copy_blocks(cache, [(0, 4)])
    with pytest.raises(ValueError, match="a dst block is also a src"):
        ops.copy_blocks(cache, [(0, 1), (1, 2)])
    with pytest.raises(ValueError, match="int64"):
        ops.copy_blocks(cache, torch.zeros(1, 2, dtype=torch.int32))
    with pytest.raises(ValueError, match="kv_cache must be"):
        ops.copy_blocks(cache[0], [(0, 1)])


def test_layout():
    layout = KVCacheLayout(num_layers=28, num_kv_heads=8, head_dim=128, block_size=16)
    assert layout.shape(10) == (28, 2, 10, 8, 16, 128)
    assert layout.bytes_per_block == 2 * 28 * 8 * 16 * 128 * 2
    assert layout.num_blocks_for_bytes(10 * layout.bytes_per_block + 5) == 10
    cache = KVCacheLayout(2, 1, 4, 2, torch.float16).allocate(3)
    assert cache.shape == (2, 2, 3, 1, 2, 4) and cache.dtype == torch.float16
    assert cache[1, 0, 2, 0].is_contiguous()  # one block of one head
    with pytest.raises(ValueError, match="head_dim must be an integer >= 1"):
        KVCacheLayout(2, 1, 0, 2)
    with pytest.raises(ValueError, match="dtype must be one of"):
        KVCacheLayout(2, 1, 4, 2, torch.int8)
    fp8 = KVCacheLayout(28, 8, 128, 16, torch.float8_e4m3fn)
    assert fp8.bytes_per_block * 2 == layout.bytes_per_block  # (half of bf16's)
