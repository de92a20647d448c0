"""KV-store ops: validated wrappers over the CUDA extension, with torch implementations.

CUDA tensors go to the compiled extension when it is built; CPU tensors, or any tensors when it is
not, go to the torch implementations (``*_torch``), which are also the reference of the GPU tests.
Every wrapper raises ``ValueError`` on a dtype, device, shape or contiguity mismatch. The cache
layout is described in ``nano_kvcache.layout``.
"""

from __future__ import annotations

from collections.abc import Sequence

try:
    import torch
except ModuleNotFoundError as e:
    if e.name != "torch":
        raise
    raise ModuleNotFoundError(
        "nano_kvcache.ops needs torch (the block manager does not): "
        "pip install 'nano-kvcache[torch]'",
        name="torch",
    ) from None

from nano_kvcache import __version__
from nano_kvcache.layout import is_fp8, supported_dtypes

SUPPORTED_DTYPES = supported_dtypes()
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite e4m3 value
# (the extension's code of each K/V dtype, for the quantizing store)
_DTYPE_CODES = {torch.float16: 0, torch.bfloat16: 1, torch.float32: 2}

_SLOT_DTYPES = (torch.int32, torch.int64)


def _load_extension():
    try:
        from nano_kvcache import _C
    except ImportError:
        return None
    if _C.__version__ != __version__:
        raise ImportError(
            f"nano_kvcache's compiled extension is version {_C.__version__} but the package is "
            f"{__version__}; reinstall nano-kvcache so that both come from one build"
        )
    return _C


_C = _load_extension()


def extension_available() -> bool:
    """Whether the compiled CUDA extension is installed (it runs only on CUDA tensors)."""
    return _C is not None


def _use_extension(tensor: torch.Tensor) -> bool:
    return _C is not None and tensor.is_cuda


def _stream(device: torch.device) -> int:
    return torch._C._cuda_getCurrentRawStream(device.index)


def _check_same_device(*tensors: torch.Tensor) -> None:
    device = tensors[0].device
    for t in tensors[1:]:
        if t.device != device:
            raise ValueError(f"all tensors must be on {device}, found one on {t.device}")


# ---- store_kvcache -------------------------------------------------------------------------------


def store_kvcache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Write the K and V of N new tokens into one layer's paged cache.

    key, value: [N, num_kv_heads, head_dim], fp16/bf16/fp32, last dim contiguous, any token and
    head strides. k_cache, v_cache: [num_blocks, num_kv_heads, block_size, head_dim], contiguous,
    key's dtype, or float8_e4m3fn: then each value is stored as round(x / scale) clamped to
    +-448 (``quantize_fp8``), ``k_scale`` for the keys and ``v_scale`` for the values.
    slot_mapping: int32/int64 [N]; token i goes to slot ``slot_mapping[i]``; slots < 0 are
    padding and skipped (the CUDA kernel also skips slots past the cache).
    """
    num_tokens, num_heads, head_dim = check_store_args(key, value, k_cache, v_cache, slot_mapping)
    if not _use_extension(key):
        store_kvcache_torch(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)
        return
    elem = key.element_size()
    pointers = (key, value, k_cache, v_cache, slot_mapping)
    # (the arguments both kernels take, up to the row's size)
    head = (*(t.data_ptr() for t in pointers), slot_mapping.element_size(), num_tokens)
    head += (k_cache.shape[0] * k_cache.shape[2], num_heads)
    layout = (key.stride(0) * elem, key.stride(1) * elem, value.stride(0) * elem)
    layout += (value.stride(1) * elem, k_cache.shape[2])  # (byte strides, block size)
    device = (key.device.index, _stream(key.device))
    if is_fp8(k_cache.dtype):
        codes = (_DTYPE_CODES[key.dtype], 1.0 / k_scale, 1.0 / v_scale)
        _C.store_kvcache_fp8(*head, head_dim, *layout, *codes, *device)
    else:
        _C.store_kvcache(*head, head_dim * elem, *layout, *device)


def quantize_fp8(x: torch.Tensor, scale: float) -> torch.Tensor:
    """x as the cache stores it in FP8: x / scale (as x times the float32 inverse, the kernels'
    arithmetic), clamped to +-448, rounded to e4m3 (to nearest, ties to even)."""
    return (x.float() * (1.0 / scale)).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def dequantize_fp8(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """What a cached FP8 value stands for: x * scale, in ``dtype``."""
    return (x.float() * scale).to(dtype)


def check_store_args(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> tuple[int, int, int]:
    """Raise ValueError unless ``store_kvcache`` can take these; returns (tokens, kv heads,
    head_dim). (Also for kernels that store K/V themselves.)"""
    # Messages are formatted only on failure: this runs once per layer and step.
    if key.dim() != 3:
        raise ValueError(f"key must be [N, num_kv_heads, head_dim], got {tuple(key.shape)}")
    if value.shape != key.shape:
        raise ValueError(f"value {tuple(value.shape)} != key {tuple(key.shape)}")
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(
            "k_cache and v_cache must both be [num_blocks, num_kv_heads, block_size, head_dim], "
            f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    num_tokens, num_heads, head_dim = key.shape
    if k_cache.shape[1] != num_heads or k_cache.shape[3] != head_dim:
        raise ValueError(f"cache {tuple(k_cache.shape)} does not hold {num_heads} x {head_dim}")
    dtype = key.dtype
    if dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"dtype must be one of {SUPPORTED_DTYPES}, got {dtype}")
    cached = FP8 if k_cache.dtype == FP8 else dtype
    if value.dtype != dtype or k_cache.dtype != cached or v_cache.dtype != cached:
        raise ValueError(
            f"key is {dtype} but value, k_cache, v_cache are "
            f"{value.dtype}, {k_cache.dtype}, {v_cache.dtype} (caches: the key's dtype, or "
            "both float8_e4m3fn)"
        )
    if slot_mapping.shape != (num_tokens,) or slot_mapping.dtype not in _SLOT_DTYPES:
        raise ValueError(
            f"slot_mapping must be int32/int64 [{num_tokens}], "
            f"got {slot_mapping.dtype} {tuple(slot_mapping.shape)}"
        )
    _check_same_device(key, value, k_cache, v_cache, slot_mapping)
    if key.stride(-1) != 1 or value.stride(-1) != 1:
        raise ValueError("key and value need a contiguous last dim")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("the caches must be contiguous")
    if not slot_mapping.is_contiguous():
        raise ValueError("slot_mapping must be contiguous")
    return num_tokens, num_heads, head_dim


def store_kvcache_torch(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Torch implementation of ``store_kvcache`` (no validation)."""
    block_size = k_cache.shape[2]
    slots = slot_mapping.long()
    keep = (slots >= 0) & (slots < k_cache.shape[0] * block_size)
    slots, key, value = slots[keep], key[keep], value[keep]
    if is_fp8(k_cache.dtype):
        key, value = quantize_fp8(key, k_scale), quantize_fp8(value, v_scale)
    blocks, rows = slots // block_size, slots % block_size
    k_cache[blocks, :, rows] = key
    v_cache[blocks, :, rows] = value


# ---- slot mapping --------------------------------------------------------------------------------


def compute_slot_mapping(
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    start_pos: torch.Tensor,
    block_size: int,
    num_tokens: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Slot and position of every new token, computed on the tensors' device.

    block_tables: int32 [B, max_blocks], rows contiguous, -1 for no block. query_start_loc: int32
    [B + 1], nondecreasing: sequence b's new tokens are ``query_start_loc[b]:query_start_loc[b+1]``.
    start_pos: int32 [B], the position of each sequence's first new token. num_tokens: the length
    of the outputs (>= query_start_loc[B]; the tokens past it are padding).
    Returns (slot_mapping int64 [num_tokens], positions int64 [num_tokens]): slot =
    block_tables[b, pos // block_size] * block_size + pos % block_size, or -1 for padding and for
    positions without a block; positions are 0 for padding.
    """
    if block_tables.dim() != 2 or block_tables.dtype != torch.int32:
        raise ValueError(
            f"block_tables must be int32 [B, max_blocks], got {block_tables.dtype} "
            f"{tuple(block_tables.shape)}"
        )
    num_seqs = block_tables.shape[0]
    for name, t, n in (
        ("query_start_loc", query_start_loc, num_seqs + 1),
        ("start_pos", start_pos, num_seqs),
    ):
        if t.shape != (n,) or t.dtype != torch.int32 or not t.is_contiguous():
            raise ValueError(
                f"{name} must be contiguous int32 [{n}], got {t.dtype} {tuple(t.shape)}"
            )
    if block_tables.stride(-1) != 1:
        raise ValueError("block_tables rows must be contiguous")
    if not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"bad block_size {block_size!r}")
    if not isinstance(num_tokens, int) or num_tokens < 0:
        raise ValueError(f"bad num_tokens {num_tokens!r}")
    _check_same_device(block_tables, query_start_loc, start_pos)
    if not _use_extension(block_tables):
        return compute_slot_mapping_torch(
            block_tables, query_start_loc, start_pos, block_size, num_tokens
        )
    device = block_tables.device
    slots = torch.empty(num_tokens, dtype=torch.int64, device=device)
    positions = torch.empty(num_tokens, dtype=torch.int64, device=device)
    _C.compute_slot_mapping(
        block_tables.data_ptr(),
        block_tables.stride(0),
        block_tables.shape[1],
        query_start_loc.data_ptr(),
        start_pos.data_ptr(),
        num_seqs,
        block_size,
        slots.data_ptr(),
        positions.data_ptr(),
        num_tokens,
        device.index,
        _stream(device),
    )
    return slots, positions


def compute_slot_mapping_torch(
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    start_pos: torch.Tensor,
    block_size: int,
    num_tokens: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch implementation of ``compute_slot_mapping`` (no validation; syncs on CUDA)."""
    device = block_tables.device
    slots = torch.full((num_tokens,), -1, dtype=torch.int64, device=device)
    positions = torch.zeros(num_tokens, dtype=torch.int64, device=device)
    num_seqs, max_blocks = block_tables.shape
    if num_seqs == 0:
        return slots, positions
    qsl = query_start_loc.long()
    first, end = int(qsl[0]), min(int(qsl[-1]), num_tokens)
    if end <= first:
        return slots, positions
    tokens = torch.arange(first, end, device=device)
    seq = torch.searchsorted(qsl, tokens, right=True) - 1
    pos = start_pos.long()[seq] + tokens - qsl[seq]
    positions[first:end] = pos
    if max_blocks == 0:  # no blocks at all: every slot -1
        return slots, positions
    index = pos // block_size
    valid = (pos >= 0) & (index < max_blocks)
    blocks = block_tables.long()[seq, index.clamp(0, max_blocks - 1)]
    valid &= blocks >= 0
    slots[first:end] = torch.where(valid, blocks * block_size + pos % block_size, -1)
    return slots, positions


# ---- copy_blocks ---------------------------------------------------------------------------------


def copy_blocks(
    kv_cache: torch.Tensor, block_mapping: torch.Tensor | Sequence[tuple[int, int]]
) -> None:
    """Copy whole blocks src -> dst in every layer, keys and values (copy-on-write).

    kv_cache: the contiguous [num_layers, 2, num_blocks, num_kv_heads, block_size, head_dim] cache
    of ``KVCacheLayout.allocate``. block_mapping: int64 [P, 2] (src, dst) pairs, or a sequence of
    pairs; no dst may also be a src. A mapping on the CPU is range-checked; one already on the
    GPU is not (the kernel skips out-of-range pairs).
    """
    if kv_cache.dim() != 6 or kv_cache.shape[1] != 2:
        raise ValueError(
            "kv_cache must be [num_layers, 2, num_blocks, heads, block_size, head_dim], "
            f"got {tuple(kv_cache.shape)}"
        )
    if not kv_cache.is_contiguous():
        raise ValueError("kv_cache must be contiguous")
    if not isinstance(block_mapping, torch.Tensor):
        block_mapping = torch.tensor(list(block_mapping), dtype=torch.int64).reshape(-1, 2)
    if (
        block_mapping.dim() != 2
        or block_mapping.shape[1] != 2
        or block_mapping.dtype != torch.int64
    ):
        raise ValueError(
            f"block_mapping must be int64 [P, 2], got {block_mapping.dtype} "
            f"{tuple(block_mapping.shape)}"
        )
    num_blocks = kv_cache.shape[2]
    if block_mapping.device.type == "cpu" and block_mapping.numel():
        low, high = int(block_mapping.min()), int(block_mapping.max())
        if low < 0 or high >= num_blocks:
            raise ValueError(f"block ids must be in [0, {num_blocks}), got [{low}, {high}]")
        if set(block_mapping[:, 1].tolist()) & set(block_mapping[:, 0].tolist()):
            raise ValueError("a dst block is also a src block")
    block_mapping = block_mapping.to(kv_cache.device, non_blocking=True).contiguous()
    if not _use_extension(kv_cache):
        copy_blocks_torch(kv_cache, block_mapping)
        return
    _C.copy_blocks(
        kv_cache.data_ptr(),
        kv_cache.shape[0] * 2,
        num_blocks,
        kv_cache[0, 0, 0].numel() * kv_cache.element_size(),
        block_mapping.data_ptr(),
        block_mapping.shape[0],
        kv_cache.device.index,
        _stream(kv_cache.device),
    )


def copy_blocks_torch(kv_cache: torch.Tensor, block_mapping: torch.Tensor) -> None:
    """Torch implementation of ``copy_blocks`` (no validation)."""
    src, dst = block_mapping[:, 0], block_mapping[:, 1]
    num_blocks = kv_cache.shape[2]
    keep = (src >= 0) & (src < num_blocks) & (dst >= 0) & (dst < num_blocks)
    kv_cache[:, :, dst[keep]] = kv_cache[:, :, src[keep]]
