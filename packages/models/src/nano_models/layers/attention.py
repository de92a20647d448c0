"""Attention over the paged KV cache, through a pluggable backend.

The new tokens' K and V reach the layer's cache with the rotary (``RotaryEmbedding.split_qkv``,
``cache(ctx)`` says where); the layer hands q, k, v, the caches and the ``ForwardContext`` to its
backend. Backends register by name;
``torch`` is the reference: correct on CPU and GPU for prefill, prefill over a cached prefix,
chunked prefill, decode and mixed batches.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from nano_kvcache.layout import is_fp8
from nano_kvcache.ops import dequantize_fp8
from nano_models.context import ForwardContext

ATTENTION_BACKENDS: dict[str, type[AttentionBackend]] = {}


class AttentionBackend(ABC):
    """Computes attention for a batch laid out as in ``ForwardContext``."""

    name: ClassVar[str]
    supports_cuda_graphs: ClassVar[bool] = False
    supports_fp8_cache: ClassVar[bool] = True  # reads float8_e4m3fn caches with their scales

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        if getattr(cls, "name", None):
            ATTENTION_BACKENDS[cls.name] = cls

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        ctx: ForwardContext,
        scale: float,
        out: torch.Tensor | None = None,
        kv_scales: tuple[float, float] = (1.0, 1.0),
    ) -> torch.Tensor:
        """q [T, heads, head_dim]; k, v [T, kv_heads, head_dim], the step's own K/V, already
        in the caches [num_blocks, kv_heads, block_size, head_dim] (a backend reads them from
        either). FP8 caches hold K / k_scale and V / v_scale (``kv_scales``): attention sees
        every key and value as the cache holds it, the step's own too. Returns [T, heads,
        head_dim]: ``out`` when given (any strides)."""


# Backends with optional dependencies: registered when their module imports.
_OPTIONAL = {
    "triton": "nano_models.layers.triton_attention",
    "flash_attn": "nano_models.layers.flash_attention",
}
# every name a configuration may give ("auto": choose_attention_backend picks)
BACKEND_NAMES = ("auto", "torch", *_OPTIONAL)


def _load_optional(name: str) -> bool:
    if name in ATTENTION_BACKENDS:
        return True
    try:
        importlib.import_module(_OPTIONAL[name])
    except ImportError:
        return False
    return True


def get_attention_backend(name: str) -> AttentionBackend:
    if name in _OPTIONAL and not _load_optional(name):
        raise ValueError(
            f"attention backend {name!r} needs the {name} package, which does not import here"
        )
    try:
        return ATTENTION_BACKENDS[name]()
    except KeyError:
        known = sorted(set(ATTENTION_BACKENDS) | set(_OPTIONAL))
        raise ValueError(f"unknown attention backend {name!r}; available: {known}") from None


def choose_attention_backend(
    name: str,
    device: torch.device,
    block_size: int,
    dtype: torch.dtype = torch.bfloat16,
    fp8_cache: bool = False,
) -> str:
    """``auto``: flash-attn if it imports, the block size is a multiple of 256, the dtype is
    fp16 or bf16 and the cache is not FP8 (all it takes), else Triton on CUDA, else torch. Any
    other name is checked against the device, block size, dtype and cache."""
    half = dtype in (torch.float16, torch.bfloat16)
    if name == "auto":
        if device.type == "cuda":
            if block_size % 256 == 0 and half and not fp8_cache and _load_optional("flash_attn"):
                return "flash_attn"
            if _load_optional("triton"):
                return "triton"
        return "torch"
    if name in _OPTIONAL and device.type != "cuda":
        raise ValueError(f"attention backend {name!r} needs a CUDA device")
    if name == "flash_attn" and block_size % 256:
        raise ValueError(
            f"the flash_attn backend needs a block size multiple of 256, got {block_size}"
        )
    if name == "flash_attn" and not half:
        raise ValueError(f"the flash_attn backend needs float16 or bfloat16, got {dtype}")
    if name == "flash_attn" and fp8_cache:
        raise ValueError(
            "the flash_attn backend does not read an FP8 KV cache: choose the triton (or "
            "torch) attention backend, or kv_cache_dtype auto"
        )
    return name


class TorchAttention(AttentionBackend):
    """Gathers each sequence's context from its blocks and runs SDPA with a causal mask offset
    by the cached prefix. Prefill chunks go one by one; decodes are batched over the whole
    width of ``ctx.block_tables`` and read lengths from the device, so a decode-only step can be
    captured in a CUDA graph."""

    name = "torch"
    supports_cuda_graphs = True

    def forward(self, q, k, v, k_cache, v_cache, ctx, scale, out=None, kv_scales=(1.0, 1.0)):
        out = torch.empty_like(q) if out is None else out
        qsl, block_size = ctx.query_start_loc_cpu, k_cache.shape[2]
        for b in range(ctx.num_prefills):
            start, end = qsl[b], qsl[b + 1]
            if end > start:
                width = -(-ctx.seq_lens_cpu[b] // block_size)
                out[start:end] = self._attend(
                    q[start:end],
                    k_cache,
                    v_cache,
                    ctx.block_tables[b : b + 1, :width],
                    ctx.seq_lens[b : b + 1],
                    scale,
                    kv_scales,
                )
        if ctx.num_decodes:
            first, seqs = ctx.num_prefill_tokens, slice(ctx.num_prefills, ctx.num_seqs)
            out[first : first + ctx.num_decodes] = self._attend(
                q[first : first + ctx.num_decodes],
                k_cache,
                v_cache,
                ctx.block_tables[seqs],
                ctx.seq_lens[seqs],
                scale,
                kv_scales,
            )
        return out

    @staticmethod
    def _attend(q, k_cache, v_cache, tables, lens, scale, kv_scales=(1.0, 1.0)):
        """One prefill chunk (one sequence, n queries) or a batch of decodes (one query each):
        query i of a sequence of context L with n queries sits at position L - n + i."""
        block_size = k_cache.shape[2]
        blocks = tables.long().clamp(min=0)  # [B, nb]; -1 padding is masked below
        batch, heads, dim = blocks.shape[0], k_cache.shape[1], k_cache.shape[3]

        def gather(cache, scale):  # [B, kv_heads, nb * block_size, head_dim] in q's dtype
            x = cache[blocks].permute(0, 2, 1, 3, 4).reshape(batch, heads, -1, dim)
            return dequantize_fp8(x, scale, q.dtype) if is_fp8(x.dtype) else x

        n = q.shape[0] // batch
        lens_t = lens.long()[:, None, None]  # [B, 1, 1]
        key_pos = torch.arange(blocks.shape[1] * block_size, device=q.device)[None, None, :]
        valid = key_pos < lens_t  # [B, 1, keys]
        # Slots past a sequence's end hold whatever was there (NaN included): zero them, since
        # a masked score times a NaN value is still NaN.
        keys = gather(k_cache, kv_scales[0]).masked_fill_(~valid[..., None], 0)
        values = gather(v_cache, kv_scales[1]).masked_fill_(~valid[..., None], 0)
        query_pos = lens_t - n + torch.arange(n, device=q.device)[None, :, None]
        mask = (key_pos <= query_pos) & valid  # [B, n, keys]
        queries = q.view(batch, n, *q.shape[1:]).transpose(1, 2)  # [B, heads, n, head_dim]
        o = F.scaled_dot_product_attention(
            queries, keys, values, attn_mask=mask.unsqueeze(1), scale=scale, enable_gqa=True
        )
        return o.transpose(1, 2).reshape(q.shape)


def _load_scale(param: nn.Parameter, source, shard_id=None) -> None:
    """A layer's K or V cache scale: one number (a scalar, or [1] as some quantizers write)."""
    if source.shape not in ((), (1,)):
        raise ValueError(
            f"{source.name} has shape {source.shape}: one scale per layer is read (per-head KV "
            "cache scales are not supported)"
        )
    param.data.copy_(source.read().reshape(()))


class Attention(nn.Module):
    """Attends through the backend over this layer's cache, which the new tokens' K/V reach
    first (``cache(ctx)``). ``bind`` gives it its cache views and backend (the runner does,
    once)."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim, self.scale = (
            num_heads,
            num_kv_heads,
            head_dim,
            scale,
        )
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None
        self.backend: AttentionBackend = TorchAttention()
        # An FP8 cache's scales of K and V: a checkpoint's (``k_scale``, ``v_scale``), else 1.
        self.k_scale = nn.Parameter(torch.ones((), dtype=torch.float32), requires_grad=False)
        self.v_scale = nn.Parameter(torch.ones((), dtype=torch.float32), requires_grad=False)
        for param in (self.k_scale, self.v_scale):
            param.optional = True  # (not in every checkpoint: the loader does not ask for it)
            param.weight_loader = _load_scale
        self.kv_scales = (1.0, 1.0)

    def bind(
        self, k_cache: torch.Tensor, v_cache: torch.Tensor, backend: AttentionBackend | None = None
    ) -> None:
        self.k_cache, self.v_cache = k_cache, v_cache
        if backend is not None:
            self.backend = backend
        self.kv_scales = (1.0, 1.0)
        if is_fp8(k_cache.dtype):
            if not self.backend.supports_fp8_cache:
                raise ValueError(f"attention backend {self.backend.name} cannot read an FP8 cache")
            scales = (float(self.k_scale), float(self.v_scale))  # (once: a sync on CUDA)
            if not all(0 < x < float("inf") for x in scales):
                raise ValueError(f"the KV cache scales must be finite and > 0, got {scales}")
            self.kv_scales = scales

    def cache(self, ctx: ForwardContext) -> tuple:
        """(k_cache, v_cache, slot_mapping, k_scale, v_scale): where this step's K and V go,
        and how an FP8 cache scales them."""
        if self.k_cache is None:
            raise RuntimeError("the attention layer has no KV cache: call model.bind_kv_cache")
        return self.k_cache, self.v_cache, ctx.slot_mapping, *self.kv_scales

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        ctx: ForwardContext,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attention of q over the cache, which already holds k and v (``cache(ctx)`` says
        where they go; ``RotaryEmbedding.split_qkv`` stores them there); into ``out`` [T,
        heads, head_dim] when given."""
        k_cache, v_cache = self.k_cache, self.v_cache
        if k_cache is None:
            raise RuntimeError("the attention layer has no KV cache: call model.bind_kv_cache")
        return self.backend.forward(
            q, k, v, k_cache, v_cache, ctx, self.scale, out, kv_scales=self.kv_scales
        )
