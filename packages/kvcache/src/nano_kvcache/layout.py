"""Layout of the paged KV cache, and its allocation.

All layers live in one tensor::

    kv_cache: [num_layers, 2, num_blocks, num_kv_heads, block_size, head_dim]   (2 = key, value)

so ``kv_cache[layer, 0]`` is that layer's key cache ``[num_blocks, num_kv_heads, block_size,
head_dim]``. One block of one head (``block_size x head_dim``) is contiguous: a paged attention
kernel reads the tile of a (block, kv head) pair with one contiguous load, for all the query heads
of that kv head. Token slot ``s`` is row ``s % block_size`` of block ``s // block_size``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported when a layout is made, not with the package
    import torch


def supported_dtypes() -> tuple[torch.dtype, ...]:
    """The dtypes of K and V as a model computes them."""
    import torch

    return (torch.float16, torch.bfloat16, torch.float32)


def cache_dtypes() -> tuple[torch.dtype, ...]:
    """The dtypes a cache may hold: the model's, or FP8 (e4m3) with a scale per layer for K
    and for V (a stored value is round(x / scale), clamped to +-448; ``ops.quantize_fp8``)."""
    import torch

    return (*supported_dtypes(), torch.float8_e4m3fn)


def is_fp8(dtype: torch.dtype) -> bool:
    import torch

    return dtype == torch.float8_e4m3fn


@dataclass(frozen=True)
class KVCacheLayout:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype | None = None  # default bfloat16

    def __post_init__(self) -> None:
        import torch

        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.dtype is None:
            object.__setattr__(self, "dtype", torch.bfloat16)
        if self.dtype not in cache_dtypes():
            raise ValueError(f"dtype must be one of {cache_dtypes()}, got {self.dtype}")

    def shape(self, num_blocks: int) -> tuple[int, ...]:
        return (self.num_layers, 2, num_blocks, self.num_kv_heads, self.block_size, self.head_dim)

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one block across all layers, keys and values."""
        elem = self.dtype.itemsize
        return 2 * self.num_layers * self.num_kv_heads * self.block_size * self.head_dim * elem

    def num_blocks_for_bytes(self, num_bytes: int) -> int:
        return num_bytes // self.bytes_per_block

    def allocate(self, num_blocks: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """An uninitialized cache of ``num_blocks`` blocks on ``device``."""
        import torch

        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        return torch.empty(self.shape(num_blocks), dtype=self.dtype, device=device)
