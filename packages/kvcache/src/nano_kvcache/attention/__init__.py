"""Triton paged attention over the nano_kvcache layout ([blocks, kv_heads, block_size, head_dim]
per layer), for any block size: ``paged_decode`` (one query per sequence; ``decode``) and
``paged_prefill`` (new tokens over themselves and their cached context; ``prefill``), with their
``DecodeLaunches`` / ``PrefillLaunches`` for a step's layers. Both accumulate in fp32 with an
online softmax (base-2 exponentials); what they share is in ``tiles``."""

from nano_kvcache.attention.decode import DecodeLaunches, decode_splits, paged_decode
from nano_kvcache.attention.prefill import PrefillLaunches, paged_prefill, prefill_tile

__all__ = [
    "DecodeLaunches",
    "PrefillLaunches",
    "decode_splits",
    "paged_decode",
    "paged_prefill",
    "prefill_tile",
]
