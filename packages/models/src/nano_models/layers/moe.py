"""Mixture-of-experts MLP: a router picks the top-k experts of each token, each expert is a
gated MLP (SiLU(x W_gate) * x W_up) W_down, and the token's output is their sum weighted by the
router's probabilities.

The experts' weights are held fused: ``w13`` [E, 2 I, H] (gate then up of each expert) and
``w2`` [E, H, I], loaded from the per-expert tensors of Hugging Face checkpoints. With tensor
parallelism each rank holds a slice of every expert's intermediate dimension I and the block
all-reduces its output, as a row-parallel layer does.

On CUDA (with Triton) the routing and the experts run in a few launches (``moe_triton``: the
routing with the pairs' alignment, ``moe_routing``, then two grouped GEMMs and a sum), whose
shapes depend on the number of tokens alone: decode steps run in CUDA graphs; up to a few
tokens ``moe_rows`` (routing, then each chosen expert's rows read straight from it).
``moe_torch`` is the CPU's path and the kernels' reference: it gathers each expert's tokens,
so its shapes depend on the routing.
"""

from __future__ import annotations

import functools
import importlib.util
import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from nano_models.layers.activation import silu_and_mul
from nano_models.layers.linear import ReplicatedLinear
from nano_models.layers.norm import RMSNorm
from nano_models.parallel import SINGLE, TensorParallel
from nano_models.weights import WeightSource


@functools.cache
def _triton() -> bool:
    return importlib.util.find_spec("triton") is not None


def fused_available(device: torch.device) -> bool:
    """Whether the experts run as the fused Triton kernels on ``device``."""
    return device.type == "cuda" and _triton()


def route(
    router_logits: torch.Tensor, top_k: int, renormalize: bool, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] in ``dtype``, expert ids [T, k]) of the top-k experts of each token by
    softmax probability (float32), renormalized to sum to 1 when ``renormalize``."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(dtype), ids


class ExpertScales(NamedTuple):
    """The scales of an e4m3 expert weight [E, N, K]: ``values`` float32 [E, N, ceil(K /
    block)]; the weight's element (e, n, k) stands for w[e, n, k] * values[e, n, k // block]
    (one column: a scale per row)."""

    values: torch.Tensor
    block: int

    def scaling(self, k: int, block_k: int) -> int:
        """How a kernel that reads the weight's K = ``k`` columns in tiles of ``block_k``
        applies these scales (its SCALING): 1, one a row (a block holds the whole row: the
        row's sum scaled once); 2, one a row and tile (blocks hold whole tiles); 3, one a
        value."""
        if self.block >= k:
            return 1
        return 2 if self.block % block_k == 0 else 3


def check_expert_scales(w: torch.Tensor, scales: ExpertScales | None) -> None:
    """ValueError unless an expert weight [E, N, K] in e4m3 comes with scales that fit it, and
    one in another dtype without."""
    if (scales is not None) != (w.dtype == torch.float8_e4m3fn):
        raise ValueError(
            f"experts of {w.dtype}: e4m3 experts come with their scales, others without"
        )
    if scales is not None and (
        scales.values.shape[:2] != w.shape[:2]
        or scales.values.shape[2] != -(-w.shape[2] // scales.block)
    ):
        raise ValueError(
            f"scales {tuple(scales.values.shape)} of blocks of {scales.block} do not fit "
            f"{tuple(w.shape)}"
        )


def dequantize_expert(
    w: torch.Tensor, scales: ExpertScales, e: int, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Expert ``e``'s e4m3 weight [N, K] as it stands for it, in ``dtype``."""
    k = w.shape[2]
    full = scales.values[e].to(dtype).repeat_interleave(scales.block, dim=1)[:, :k]
    return w[e].to(dtype) * full


def moe_torch(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    scales: tuple[ExpertScales, ExpertScales] | None = None,
) -> torch.Tensor:
    """sum_k weights[t, k] * expert_{ids[t, k]}(x[t]) for x [T, H], w13 [E, 2I, H], w2 [E, H, I]:
    [T, H] in x's dtype, each expert run once on the tokens that chose it. ``scales``: w13's
    and w2's when they are e4m3 (each expert's weights dequantized, its products in float32,
    float64 for float64 x, the activations as they are)."""
    out = torch.zeros_like(x)
    s13, s2 = scales or (None, None)
    wide = torch.promote_types(x.dtype, torch.float32)
    flat = ids.flatten()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=w13.shape[0]).tolist()
    tokens = order // ids.shape[1]  # (the token of each (token, slot) pair, by expert)
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        pairs = order[start : start + count]
        rows = tokens[start : start + count]
        start += count
        if scales is None:
            h = silu_and_mul(F.linear(x[rows], w13[expert]))
            y = F.linear(h, w2[expert]) * weights.flatten()[pairs, None]
        else:
            h = F.linear(x[rows].to(wide), dequantize_expert(w13, s13, expert, wide))
            y = F.linear(silu_and_mul(h), dequantize_expert(w2, s2, expert, wide))
            y = (y * weights.flatten()[pairs, None].to(wide)).to(x.dtype)
        out.index_add_(0, rows, y)
    return out


class FusedMoE(nn.Module):
    """The experts of one layer: ``forward(x, router_logits, top_k, renormalize)``. ``quant``:
    their weights in e4m3 (``nano_models.quantization.ExpertsFp8``), else None."""

    quant = None

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        tp: TensorParallel = SINGLE,
        weight_dtype: torch.dtype | None = None,
    ) -> None:
        """``weight_dtype``: the weights' (default: the model's), e4m3 for an FP8 checkpoint's
        experts (made so from the start: a mixture's experts are most of its bytes)."""
        super().__init__()
        self.tp = tp
        self.num_experts, self.hidden_size = num_experts, hidden_size
        self.intermediate_size = intermediate_size
        local = tp.split(intermediate_size, "moe_intermediate_size")
        self.local = local
        self.w13_weight = nn.Parameter(
            torch.empty(num_experts, 2 * local, hidden_size, dtype=weight_dtype),
            requires_grad=False,
        )
        self.w2_weight = nn.Parameter(
            torch.empty(num_experts, hidden_size, local, dtype=weight_dtype), requires_grad=False
        )
        self.w13_weight.weight_loader = self.w13_loader
        self.w2_weight.weight_loader = self.w2_loader

    def shards(self, param_name: str) -> set:
        """The checkpoint tensors a parameter is made of: (expert, 0 gate | 1 up) for w13,
        the expert for w2."""
        if param_name.rpartition(".")[2].startswith("w13_"):
            return {(e, j) for e in range(self.num_experts) for j in (0, 1)}
        return set(range(self.num_experts))

    def _expert(self, source: WeightSource, shard) -> int:
        expert = shard[0] if isinstance(shard, tuple) else shard
        if not isinstance(expert, int) or not 0 <= expert < self.num_experts:
            raise ValueError(
                f"{source.name}: expert {expert} of a layer with {self.num_experts} experts"
            )
        return expert

    def w13_loader(self, param: nn.Parameter, source: WeightSource, shard) -> None:
        expert, part = self._expert(source, shard), shard[1]
        source.expect_shape((self.intermediate_size, self.hidden_size))
        rows = source.narrow(0, self.tp.rank * self.local, self.local)
        param.data[expert].narrow(0, part * self.local, self.local).copy_(rows)

    def w2_loader(self, param: nn.Parameter, source: WeightSource, shard) -> None:
        expert = self._expert(source, shard)
        source.expect_shape((self.hidden_size, self.intermediate_size))
        param.data[expert].copy_(source.narrow(1, self.tp.rank * self.local, self.local))

    def block_scale_loaders(self, block: tuple[int, int]):
        """The loaders of an FP8 checkpoint's ``weight_scale_inv`` of each expert's gate, up
        and down projections ([ceil(rows / bo), ceil(columns / bi)] each) into the experts'
        scales a row and input block: (w13's, w2's)."""
        bo, bi = block
        first = self.tp.rank * self.local  # (this rank's first intermediate row / column)

        def read(source: WeightSource, shape: tuple[int, int]) -> torch.Tensor:
            source.expect_shape(shape)
            if not source.dtype.is_floating_point:
                raise ValueError(f"{source.name} is {source.dtype}, not floating point")
            return source.read().float()

        def w13(param: nn.Parameter, source: WeightSource, shard) -> None:
            expert, part = self._expert(source, shard), shard[1]
            scales = read(
                source,
                (math.ceil(self.intermediate_size / bo), math.ceil(self.hidden_size / bi)),
            )
            rows = torch.arange(first, first + self.local) // bo
            span = slice(part * self.local, (part + 1) * self.local)
            param.data[expert, span] = scales[rows].to(param.device)

        def w2(param: nn.Parameter, source: WeightSource, shard) -> None:
            expert = self._expert(source, shard)
            scales = read(
                source,
                (math.ceil(self.hidden_size / bo), math.ceil(self.intermediate_size / bi)),
            )
            rows = torch.arange(self.hidden_size) // bo
            cols = slice(first // bi, first // bi + math.ceil(self.local / bi))
            param.data[expert] = scales[rows][:, cols].to(param.device)

        return w13, w2

    def forward(
        self, x: torch.Tensor, router_logits: torch.Tensor, top_k: int, renormalize: bool
    ) -> torch.Tensor:
        """The experts of the router's top-k choice (``route`` of ``router_logits``)."""
        w13, w2 = self.w13_weight, self.w2_weight
        scales = None if self.quant is None else self.quant.scales(self)
        if fused_available(x.device):
            from nano_models.layers.moe_triton import routed_moe

            out = routed_moe(x, router_logits, w13, w2, top_k, renormalize, scales=scales)
        else:
            routing = route(router_logits, top_k, renormalize, x.dtype)
            out = moe_torch(x, w13, w2, *routing, scales=scales)
        return self.tp.all_reduce(out)


class SparseMoeBlock(nn.Module):
    """Router (a replicated linear layer to the experts' logits) and experts."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        num_experts: int,
        top_k: int,
        renormalize: bool,
        tp: TensorParallel = SINGLE,
        expert_dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok ({top_k}) must be in 1..{num_experts}")
        self.top_k, self.renormalize = top_k, renormalize
        self.gate = ReplicatedLinear(hidden_size, num_experts, False, tp)
        self.experts = FusedMoE(num_experts, hidden_size, intermediate_size, tp, expert_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts(x, self.gate(x), self.top_k, self.renormalize)

    def normed(
        self, norm: RMSNorm, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(self(norm(x + residual)), x + residual), the norm in the router's prologue where
        it can be (``LinearBase.normed``; the experts read the normed input it keeps)."""
        logits, residual, x = self.gate.normed(norm, x, residual, keep_normed=True)
        return self.experts(x, logits, self.top_k, self.renormalize), residual
