"""Linear layers, replicated or sharded over a tensor-parallel group.

Each parameter has a ``weight_loader(param, source, shard_id=None)`` that reads from a
checkpoint ``WeightSource`` only the slice this rank holds.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nano_models.layers.activation import SiluAndMul
from nano_models.layers.norm import RMSNorm
from nano_models.parallel import SINGLE, TensorParallel
from nano_models.weights import WeightSource

try:
    from nano_models.layers import gemv
except ImportError:  # (no Triton: a CPU install)
    gemv = None


class LinearBase(nn.Module):
    """y = x W^T + b with W [out_local, in_local]. ``tp_dim`` says which dim is sharded.
    ``quant``: an FP8 scheme (``nano_models.quantization``) that holds W in e4m3 with scales
    and computes the product (but for ``gemv``'s, which reads the scales itself); None: W in
    the model's dtype."""

    tp_dim: int | None = None
    quant = None

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        tp: TensorParallel = SINGLE,
        out_local: int | None = None,
    ):
        super().__init__()
        self.tp = tp
        self.in_features, self.out_features = in_features, out_features
        in_local = tp.split(in_features, "input size") if self.tp_dim == 1 else in_features
        if out_local is None:
            out_local = tp.split(out_features, "output size") if self.tp_dim == 0 else out_features
        self.weight = nn.Parameter(torch.empty(out_local, in_local), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(out_local), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def full_shape(self, param: nn.Parameter) -> tuple[int, ...]:
        return (self.out_features, self.in_features)[: param.dim()]

    def output_slice(self, shard_id=None) -> tuple[int, int, int, int]:
        """Where the checkpoint rows of shard ``shard_id`` go: (first row here, rows, first
        row in the checkpoint tensor, the tensor's rows)."""
        if self.tp_dim == 0:
            size = self.weight.shape[0]
            return 0, size, self.tp.rank * size, self.out_features
        return 0, self.out_features, 0, self.out_features

    def input_slice(self) -> tuple[int, int]:
        """(first checkpoint column this rank holds, columns)."""
        if self.tp_dim == 1:
            size = self.weight.shape[1]
            return self.tp.rank * size, size
        return 0, self.in_features

    def weight_loader(self, param: nn.Parameter, source: WeightSource, shard_id=None) -> None:
        source.expect_shape(self.full_shape(param))
        dim = self.tp_dim
        if dim is None or dim >= param.dim():
            param.data.copy_(source.read())
        else:
            size = param.shape[dim]
            param.data.copy_(source.narrow(dim, self.tp.rank * size, size))

    def takes_gemv(self, x: torch.Tensor) -> bool:
        """Whether the product of x runs as ``gemv`` (a decode step of a few sequences on a
        GPU), where the layer's input can be made in the product's prologue and its
        activation in the epilogue."""
        return gemv is not None and gemv.usable(x, self.weight, scaled=self.quant is not None)

    def gemv_scales(self):
        """An FP8 weight's scales as ``gemv`` takes them (None: a weight in the model's
        dtype)."""
        return None if self.quant is None else gemv.Scales(*self.quant.scales(self))

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x W^T + b."""
        if self.takes_gemv(x):
            return gemv.gemv(x, self.weight, bias, self.gemv_scales())
        if self.quant is not None:
            return self.quant.apply(self, x, bias)
        return F.linear(x, self.weight, bias)

    def forward(self, x: torch.Tensor, act: SiluAndMul | None = None) -> torch.Tensor:
        """x W^T + b; with ``act`` (a column-parallel gated MLP's [gate | up] product),
        act(x W^T + b), made in the product's epilogue where ``gemv`` takes it (SiLU-and-mul;
        another activation runs after the product)."""
        if isinstance(act, SiluAndMul) and self.takes_gemv(x):  # (row-parallel: own forward)
            return gemv.gemv(x, self.weight, self.bias, self.gemv_scales(), glu=True)
        y = self.matmul(x, self.bias)
        return y if act is None else act(y)

    def normed(
        self,
        norm: RMSNorm,
        x: torch.Tensor,
        residual: torch.Tensor | None = None,
        keep_normed: bool = False,
        act: SiluAndMul | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(self(h, act), s, h) with s = x + residual (x without one) and h = norm(s): the
        norm is the product's prologue where ``gemv`` takes it, and h is then kept (written)
        only when ``keep_normed`` (else None). For layers whose forward is their product
        (replicated, column-parallel). ``act`` as in ``forward`` (gemv makes SiLU-and-mul
        only)."""
        gemv_act = act is None or isinstance(act, SiluAndMul)
        if self.tp_dim != 1 and gemv_act and self.takes_gemv(x) and norm.weight.dtype == x.dtype:
            return gemv.normed_gemv(
                x,
                residual,
                norm.weight,
                norm.eps,
                self.weight,
                self.bias,
                keep_normed,
                self.gemv_scales(),
                glu=isinstance(act, SiluAndMul),
            )
        h, s = (norm(x), x) if residual is None else norm(x, residual)
        return self(h, act), s, h


class ReplicatedLinear(LinearBase):
    """The whole layer on every rank."""


class ColumnParallelLinear(LinearBase):
    """Output features split over ranks; each rank returns its slice of the output."""

    tp_dim = 0


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs in one matmul (gate and up of an MLP); the checkpoint
    holds them apart, shard_id says which one a tensor is."""

    def __init__(
        self, in_features: int, output_sizes: list[int], bias: bool, tp: TensorParallel = SINGLE
    ):
        self.output_sizes = output_sizes
        super().__init__(in_features, sum(output_sizes), bias, tp)

    def output_slice(self, shard_id=None) -> tuple[int, int, int, int]:
        full = self.output_sizes[shard_id]
        size = full // self.tp.size
        offset = sum(self.output_sizes[:shard_id]) // self.tp.size
        return offset, size, self.tp.rank * size, full

    def weight_loader(self, param: nn.Parameter, source: WeightSource, shard_id=None) -> None:
        if shard_id is None:
            raise ValueError(f"{source.name}: a merged layer loads one of its parts at a time")
        offset, size, start, full = self.output_slice(shard_id)
        source.expect_shape((full, self.in_features)[: param.dim()])
        param.data.narrow(0, offset, size).copy_(source.narrow(0, start, size))


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections in one matmul, heads split over ranks. With more ranks than kv
    heads, each kv head is replicated on tp_size / num_kv_heads ranks."""

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        bias: bool,
        tp: TensorParallel = SINGLE,
    ):
        self.head_dim = head_dim
        self.num_heads = tp.split(num_heads, "num_attention_heads")
        if tp.size >= num_kv_heads:
            if tp.size % num_kv_heads:
                raise ValueError(
                    f"tensor_parallel_size ({tp.size}) must be a multiple of "
                    f"num_key_value_heads ({num_kv_heads}) when larger"
                )
            self.num_kv_heads, self.kv_head_start = 1, tp.rank * num_kv_heads // tp.size
        else:
            self.num_kv_heads = tp.split(num_kv_heads, "num_key_value_heads")
            self.kv_head_start = tp.rank * self.num_kv_heads
        self.total_heads, self.total_kv_heads = num_heads, num_kv_heads
        self.output_sizes = [
            self.num_heads * head_dim,
            self.num_kv_heads * head_dim,
            self.num_kv_heads * head_dim,
        ]
        super().__init__(
            hidden_size,
            (num_heads + 2 * num_kv_heads) * head_dim,
            bias,
            tp,
            out_local=sum(self.output_sizes),
        )

    def output_slice(self, shard_id=None) -> tuple[int, int, int, int]:
        if shard_id not in ("q", "k", "v"):
            raise ValueError(f"the qkv layer loads q, k or v, got {shard_id!r}")
        heads = self.total_heads if shard_id == "q" else self.total_kv_heads
        if shard_id == "q":
            offset, size, start = 0, self.output_sizes[0], self.tp.rank * self.output_sizes[0]
        else:
            offset = self.output_sizes[0] + (self.output_sizes[1] if shard_id == "v" else 0)
            size, start = self.output_sizes[1], self.kv_head_start * self.head_dim
        return offset, size, start, heads * self.head_dim

    def weight_loader(self, param: nn.Parameter, source: WeightSource, shard_id=None) -> None:
        if shard_id not in ("q", "k", "v"):
            raise ValueError(f"{source.name}: the qkv layer loads q, k or v, got {shard_id!r}")
        offset, size, start, full = self.output_slice(shard_id)
        source.expect_shape((full, self.in_features)[: param.dim()])
        param.data.narrow(0, offset, size).copy_(source.narrow(0, start, size))


class RowParallelLinear(LinearBase):
    """Input features split over ranks; the partial products are summed by an all-reduce.
    The bias is added once, on rank 0, before the reduction."""

    tp_dim = 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.matmul(x, self.bias if self.tp.rank == 0 else None)
        return self.tp.all_reduce(y)
