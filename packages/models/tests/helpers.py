"""Running our models over a paged cache, and transformers' models for reference."""

from __future__ import annotations

import random

import torch

from nano_kvcache.layout import KVCacheLayout
from nano_models import ForwardContext, get_attention_backend
from nano_models.loader import load_model

BLOCK_SIZE = 4


class PagedRunner:
    """Our model with a KV cache whose blocks are handed out in shuffled order."""

    def __init__(
        self,
        path,
        num_blocks: int = 256,
        tp=None,
        dtype=torch.float32,
        seed: int = 0,
        device: str = "cpu",
        backend: str = "torch",
    ):
        kwargs = {"tp": tp} if tp is not None else {}
        self.device = device
        self.model, self.report = load_model(path, dtype=dtype, device=device, **kwargs)
        cfg = self.model.config
        heads = self.model.model.layers[0].self_attn.num_kv_heads
        layout = KVCacheLayout(cfg.num_hidden_layers, heads, cfg.head_dim, BLOCK_SIZE, dtype)
        self.cache = layout.allocate(num_blocks, device)
        self.cache.fill_(float("nan"))  # poisoned: reading an unwritten slot shows
        self.model.bind_kv_cache(self.cache, get_attention_backend(backend))
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)
        self.tables: dict[int, list[int]] = {}

    def table(self, seq: int, length: int) -> list[int]:
        table = self.tables.setdefault(seq, [])
        while len(table) * BLOCK_SIZE < length:
            table.append(self.free.pop())
        return table

    @torch.no_grad()
    def step(self, chunks: list[tuple[int, list[int], int]], num_prefills: int) -> torch.Tensor:
        """chunks: (seq id, new token ids, tokens already cached) per sequence, prefills first.
        Returns the logits of each chunk's last token."""
        ids, positions, query_lens, seq_lens, tables = [], [], [], [], []
        for seq, tokens, cached in chunks:
            ids += tokens
            positions += range(cached, cached + len(tokens))
            query_lens.append(len(tokens))
            seq_lens.append(cached + len(tokens))
            tables.append(self.table(seq, cached + len(tokens)))
        ctx = ForwardContext.build(
            query_lens, seq_lens, tables, BLOCK_SIZE, num_prefills, device=self.device
        )
        hidden = self.model(
            torch.tensor(ids, device=self.device), torch.tensor(positions, device=self.device), ctx
        )
        logits = self.model.compute_logits(hidden, ctx)
        return None if logits is None else logits.cpu()


@torch.no_grad()
def reference_logits(hf_model, tokens: list[int]) -> torch.Tensor:
    """transformers' logits of the last token, recomputed over the whole sequence."""
    return hf_model(torch.tensor([tokens])).logits[0, -1].float()


def prompts(n: int, vocab: int, seed: int = 0, lengths=(1, 3, 7, 8, 9, 16, 21, 30)):
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(lengths[i % len(lengths)])] for i in range(n)]
