"""Vocabulary-parallel token embedding and LM head."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nano_models.parallel import SINGLE, TensorParallel
from nano_models.weights import WeightSource

try:
    from nano_models.layers import gemv
except ImportError:  # (no Triton: a CPU install)
    gemv = None


class VocabParallelEmbedding(nn.Module):
    """Rows of the vocabulary split over ranks (the last shard padded); each rank embeds the
    ids in its range and an all-reduce sums the shards."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallel = SINGLE):
        super().__init__()
        self.tp, self.vocab_size, self.hidden_size = tp, vocab_size, hidden_size
        self.shard_size = -(-vocab_size // tp.size)
        self.start = tp.rank * self.shard_size
        self.end = min(self.start + self.shard_size, vocab_size)
        self.weight = nn.Parameter(torch.empty(self.shard_size, hidden_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, source: WeightSource, shard_id=None) -> None:
        source.expect_shape((self.vocab_size, self.hidden_size))
        rows = self.end - self.start
        param.data[:rows].copy_(source.narrow(0, self.start, rows))
        param.data[rows:].zero_()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        mask = (ids >= self.start) & (ids < self.end)
        y = F.embedding((ids - self.start) * mask, self.weight) * mask.unsqueeze(-1)
        return self.tp.all_reduce(y)


class ParallelLMHead(VocabParallelEmbedding):
    """hidden -> logits: each rank computes its vocabulary shard; rank 0 gathers the full
    logits (other ranks get None). ``quant``: the weight in e4m3 with a scale a row
    (``nano_models.quantization.fp8_lm_head``), else None."""

    quant = None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor | None:
        logits = self.matmul(hidden)
        logits = self.tp.gather(logits)
        return None if logits is None else logits[..., : self.vocab_size]

    def matmul(self, hidden: torch.Tensor) -> torch.Tensor:
        """This rank's logits [R, shard_size]."""
        if self.quant is None:
            return F.linear(hidden, self.weight)
        if gemv is not None and gemv.usable(hidden, self.weight, scaled=True):
            return gemv.gemv(hidden, self.weight, None, gemv.Scales(*self.quant.scales(self)))
        return self.quant.apply(self, hidden, None)
