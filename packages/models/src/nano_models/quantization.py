"""FP8 (e4m3) weights for the linear layers (embeddings and norms stay in the model's dtype, and
so does the LM head unless asked: ``fp8_lm_head``).

- ``block``: a checkpoint's (Qwen3-FP8's and DeepSeek's format: ``quantization_config`` with
  ``quant_method: fp8``, dynamic activations, ``weight_block_size: [bo, bi]``). A layer holds
  its weight in e4m3 and a float32 ``weight_scale_inv`` per (bo x bi) block: the weight is
  ``weight * scale`` (the checkpoint's name notwithstanding). Here the scales are kept per
  output row and input block, [out, ceil(in / bi)], so that merged layers (q/k/v, gate/up)
  whose parts do not end on a block boundary work too; a tensor-parallel shard that would
  split an input block is an error naming the layer.
- ``channel``: ``quantization="fp8"`` on a checkpoint in bf16 or fp32: each output row of a
  weight gets the scale max|w| / 448 when loaded, and activations are quantized per token as
  they come (max|x| / 448).

The products: with block scales, Triton kernels (``nano_models.layers.fp8_matmul``) that read
the e4m3 weight and its scales (half the weight bytes of bf16) and multiply, at few rows, in
the activations' dtype, at many, on FP8 tensor cores with the activations rounded to e4m3 per
token and block of columns (as the checkpoints' dynamic activation scales are); per channel,
``torch._scaled_mm`` (FP8 tensor cores, on GPUs of compute capability 8.9 and later) with the
activations rounded per token (one Triton launch, ``nano_models.layers.fp8_quant``) and the
weight's scales. At one or two rows on CUDA (a decode step of one or two sequences) both run
as ``nano_models.layers.gemv``: the e4m3 weight widened in registers and each block's or row's
sum scaled, the activations as they are, the layer's norm in its prologue, SiLU-and-mul in the
gate/up product's epilogue.
Elsewhere (the CPU) both compute in float32 from the dequantized weights, the block scheme
without rounding the activations: the reference the GPU paths are tested against.

A mixture of experts' experts take either scheme too (``ExpertsFp8``: scales a row and block
of input columns, or a row), their products in the MoE kernels with the weight widened in
registers and the activations as they are; its routers stay in the model's dtype.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from nano_models.config import ModelConfig
from nano_models.layers.linear import LinearBase
from nano_models.weights import WeightSource

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
QUANTIZATIONS = ("fp8",)  # the names a configuration may ask for


@dataclass(frozen=True)
class Fp8Config:
    scheme: str  # "block" (a checkpoint's) or "channel" (quantized when loaded)
    block: tuple[int, int] | None = None  # (rows, columns) of a scale block
    ignored: tuple[str, ...] = ()  # layers the checkpoint keeps in its dtype

    @classmethod
    def of(cls, cfg: ModelConfig, requested: str | None) -> Fp8Config | None:
        """The FP8 scheme of a model: its checkpoint's ``quantization_config``, else
        ``requested`` ("fp8": per-channel scales computed when loaded, or None)."""
        if requested is not None and requested not in QUANTIZATIONS:
            raise ValueError(
                f"quantization must be one of {QUANTIZATIONS} or None, got {requested!r}"
            )
        q = cfg.raw.get("quantization_config")
        if q is None:
            return cls("channel") if requested == "fp8" else None
        if not isinstance(q, dict) or q.get("quant_method") != "fp8":
            method = q.get("quant_method") if isinstance(q, dict) else q
            raise ValueError(
                f"the checkpoint's quantization_config has quant_method {method!r}: only fp8 "
                "checkpoints are read"
            )
        if q.get("fmt", "e4m3") != "e4m3":
            raise ValueError(f"FP8 checkpoints in {q.get('fmt')!r}: only e4m3 is read")
        if q.get("activation_scheme", "dynamic") != "dynamic":
            raise ValueError(
                f"activation_scheme {q.get('activation_scheme')!r}: only dynamic activation "
                "scales are read"
            )
        block = q.get("weight_block_size")
        if (
            not isinstance(block, list)
            or len(block) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)
        ):
            raise ValueError(
                f"weight_block_size must be two positive integers, got {block!r} (FP8 "
                "checkpoints with per-tensor scales are not read)"
            )
        if block[1] % 16:
            raise ValueError(
                f"weight_block_size {block}: the columns of a block must be a multiple of 16"
            )
        ignored = q.get("modules_to_not_convert") or q.get("ignored_layers") or ()
        return cls("block", (block[0], block[1]), tuple(ignored))

    def keeps(self, name: str) -> bool:
        """Whether the checkpoint keeps module ``name`` in its dtype (not FP8)."""
        return _ignored(name, self.ignored)

    def check_device(self, device: torch.device, dtype: torch.dtype) -> None:
        """FP8 weights on a GPU need FP8 conversions (compute capability 8.9: Ada, Hopper),
        Triton for block scales, and bf16 activations for per-channel ones (their products
        run on FP8 tensor cores): an error that says which, rather than a slow fallback."""
        if device.type != "cuda":
            return
        capability = torch.cuda.get_device_capability(device)
        if capability < (8, 9):
            raise ValueError(
                "FP8 weights need a GPU of compute capability 8.9 or later (Ada, Hopper); this "
                f"one is {capability[0]}.{capability[1]}"
            )
        if self.scheme == "block" and not _triton():
            raise ValueError("an FP8 checkpoint on the GPU needs Triton (pip install triton)")
        if self.scheme == "channel" and dtype != torch.bfloat16:
            raise ValueError(
                f"quantization fp8 computes in bfloat16 on the GPU, not {dtype}: set the dtype "
                "to bfloat16"
            )


def fp8_layers(model: nn.Module, config: Fp8Config) -> list[tuple[str, LinearBase]]:
    """The linear layers that take FP8 weights: all but those the checkpoint keeps in its
    dtype and the routers of mixtures of experts (kept in the model's dtype, as vLLM keeps
    them)."""
    from nano_models.layers.moe import SparseMoeBlock

    routers = {f"{n}.gate" for n, m in model.named_modules() if isinstance(m, SparseMoeBlock)}
    return [
        (name, module)
        for name, module in model.named_modules()
        if isinstance(module, LinearBase) and name not in routers and not config.keeps(name)
    ]


def fp8_experts(model: nn.Module, config: Fp8Config) -> list[tuple[str, nn.Module]]:
    """The experts (``FusedMoE``) that take FP8 weights."""
    from nano_models.layers.moe import FusedMoE

    return [
        (name, module)
        for name, module in model.named_modules()
        if isinstance(module, FusedMoE) and not config.keeps(name)
    ]


class ExpertsFp8:
    """A layer's experts in e4m3: ``w13_weight`` [E, 2I, H] and ``w2_weight`` [E, H, I] with
    float32 scales a row and block of input columns (``ExpertScales``): a block checkpoint's
    ``w13_weight_scale_inv`` / ``w2_weight_scale_inv`` (blocks of its columns), or
    ``quantization="fp8"``'s ``w13_weight_scale`` / ``w2_weight_scale`` (a scale a row). The
    products: the MoE kernels widen the weight in registers and keep the activations as they
    are (W8A16); on the CPU float32 products of the dequantized weights."""

    def __init__(self, suffix: str, w13_block: int, w2_block: int) -> None:
        self.suffix, self.w13_block, self.w2_block = suffix, w13_block, w2_block

    def scales(self, experts: nn.Module):
        """(w13's, w2's) ``ExpertScales``."""
        from nano_models.layers.moe import ExpertScales

        return (
            ExpertScales(getattr(experts, "w13_" + self.suffix), self.w13_block),
            ExpertScales(getattr(experts, "w2_" + self.suffix), self.w2_block),
        )


def _ignored(name: str, ignored: tuple[str, ...]) -> bool:
    return any(name == i or name.startswith(i + ".") or name.endswith("." + i) for i in ignored)


def prepare_block_fp8(model: nn.Module, config: Fp8Config) -> None:
    """Before a block-FP8 checkpoint loads: each layer's weight in e4m3, its scales beside."""
    for name, layer in fp8_layers(model, config):
        out_local, in_local = layer.weight.shape
        bi = config.block[1]
        if layer.tp_dim == 1 and layer.tp.size > 1 and in_local % bi:
            raise ValueError(
                f"{name}: its {layer.in_features} input columns split over "
                f"{layer.tp.size} tensor-parallel ranks ({in_local} each) would cut weight "
                f"blocks of {bi} columns: choose a tensor-parallel size that keeps blocks whole"
            )
        device = layer.weight.device
        layer.weight = nn.Parameter(
            torch.empty(out_local, in_local, dtype=FP8, device=device), requires_grad=False
        )
        layer.weight.weight_loader = _fp8_only(layer.weight_loader)
        scales = torch.empty(
            out_local, math.ceil(in_local / bi), dtype=torch.float32, device=device
        )
        layer.weight_scale_inv = nn.Parameter(scales, requires_grad=False)
        layer.weight_scale_inv.weight_loader = _block_scale_loader(layer, name, config.block)
        layer.quant = BlockFp8(bi)
    for name, experts in fp8_experts(model, config):
        bi = config.block[1]
        e, local, hidden = experts.num_experts, experts.local, experts.hidden_size
        if experts.tp.size > 1 and local % bi:
            raise ValueError(
                f"{name}: its experts' {experts.intermediate_size} intermediate columns split "
                f"over {experts.tp.size} tensor-parallel ranks ({local} each) would cut "
                f"weight blocks of {bi} columns: choose a tensor-parallel size that keeps "
                "blocks whole"
            )
        device = experts.w13_weight.device
        for attr, shape, scale_shape, loader, scale_loader in zip(
            ("w13", "w2"),
            ((e, 2 * local, hidden), (e, hidden, local)),
            ((e, 2 * local, math.ceil(hidden / bi)), (e, hidden, math.ceil(local / bi))),
            (experts.w13_loader, experts.w2_loader),
            experts.block_scale_loaders(config.block),
        ):
            weight = getattr(experts, f"{attr}_weight")
            if weight.dtype != FP8:  # (experts built in the model's dtype)
                weight = nn.Parameter(torch.empty(shape, dtype=FP8, device=device), False)
                setattr(experts, f"{attr}_weight", weight)
            weight.weight_loader = _fp8_only(loader)
            scales = torch.empty(scale_shape, dtype=torch.float32, device=device)
            setattr(experts, f"{attr}_weight_scale_inv", nn.Parameter(scales, False))
            getattr(experts, f"{attr}_weight_scale_inv").weight_loader = scale_loader
        experts.quant = ExpertsFp8("weight_scale_inv", bi, bi)


def quantize_channel_fp8(model: nn.Module, config: Fp8Config) -> None:
    """After a checkpoint in the model's dtype loaded: each layer's weight in e4m3 with a
    scale per output row (max|w| / 448)."""
    for _, layer in fp8_layers(model, config):
        if any(size % 16 for size in layer.weight.shape):
            continue  # (FP8 products take sizes in multiples of 16: this one stays as it is)
        quantized, scale = _per_row_e4m3(layer.weight.data)
        layer.weight = nn.Parameter(quantized, requires_grad=False)
        layer.weight_scale = nn.Parameter(scale, requires_grad=False)
        layer.quant = ChannelFp8()
    for _, experts in fp8_experts(model, config):
        for attr in ("w13", "w2"):
            quantized, scale = _per_row_e4m3(getattr(experts, f"{attr}_weight").data)
            setattr(experts, f"{attr}_weight", nn.Parameter(quantized, requires_grad=False))
            scale = nn.Parameter(scale[..., None], requires_grad=False)  # ([E, N, 1])
            setattr(experts, f"{attr}_weight_scale", scale)
        experts.quant = ExpertsFp8("weight_scale", experts.hidden_size, experts.local)


# Rows of a weight quantized at a time (a float32 copy of a few of them at once, not of the
# whole weight: Qwen3-8B's LM head is 2.5 GB in float32, a 30B-A3B layer's experts 1.2 GB).
_ROWS_AT_ONCE = 8192


def _per_row_e4m3(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., K] in e4m3 with a float32 scale a row [...] (max|w| / 448)."""
    flat = w.reshape(-1, w.shape[-1])
    quantized = torch.empty(flat.shape, dtype=FP8, device=w.device)
    scale = torch.empty(flat.shape[0], dtype=torch.float32, device=w.device)
    for first in range(0, flat.shape[0], _ROWS_AT_ONCE):
        rows = slice(first, first + _ROWS_AT_ONCE)
        part = flat[rows].float()
        scale[rows] = (part.abs().amax(dim=1) / FP8_MAX).clamp(min=1e-12)
        quantized[rows] = (part / scale[rows, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return quantized.view(w.shape), scale.view(w.shape[:-1])


def check_fp8_lm_head(
    fp8: Fp8Config | None, rows: int, columns: int, device: torch.device, dtype: torch.dtype
) -> None:
    """Before a model loads: an FP8 LM head of ``rows`` (this rank's vocabulary rows) x
    ``columns`` can be made, or an error that says why."""
    if fp8 is None:
        raise ValueError(
            "quantize_lm_head needs FP8 weights: quantization fp8, or an FP8 checkpoint"
        )
    if rows % 16 or columns % 16:
        raise ValueError(
            f"quantize_lm_head: the LM head's {rows} x {columns} weight (this rank's vocabulary "
            "rows x hidden size) is not in multiples of 16, which FP8 products need"
        )
    if device.type == "cuda" and dtype != torch.bfloat16:
        raise ValueError(
            f"quantize_lm_head computes in bfloat16 on the GPU, not {dtype}: set the dtype to "
            "bfloat16"
        )


def fp8_lm_head(model: nn.Module) -> None:
    """After the checkpoint loaded: the LM head's weight in e4m3 with a scale per vocabulary
    row (max|w| / 448), its products those of a per-channel layer (``ChannelFp8``; at one or
    two rows ``gemv``). Half the bytes a decode step reads for the head (for Qwen3-8B, 1.24 of
    ~9 GB of weights in FP8), for logits that carry the head's rounding as well. Its own copy
    when the head shares the embedding's weight (the embedding stays as it is)."""
    head = model.lm_head
    quantized, scale = _per_row_e4m3(head.weight.data)
    head.weight = nn.Parameter(quantized, requires_grad=False)
    head.weight_scale = nn.Parameter(scale, requires_grad=False)
    head.quant = ChannelFp8()


def _fp8_only(loader):
    def load(param: nn.Parameter, source: WeightSource, shard_id=None) -> None:
        if source.dtype != FP8:
            raise ValueError(
                f"{source.name} is {source.dtype}, not float8_e4m3fn (an FP8 checkpoint)"
            )
        loader(param, source, shard_id)

    return load


def _block_scale_loader(layer: LinearBase, name: str, block: tuple[int, int]):
    """The loader of a layer's ``weight_scale_inv``: the checkpoint's [ceil(rows / bo),
    ceil(columns / bi)] scales of a shard, spread to its rows and cut to this rank's columns."""
    bo, bi = block

    def load(param: nn.Parameter, source: WeightSource, shard_id=None) -> None:
        offset, size, start, full = layer.output_slice(shard_id)
        source.expect_shape((math.ceil(full / bo), math.ceil(layer.in_features / bi)))
        if not source.dtype.is_floating_point:
            raise ValueError(f"{source.name} is {source.dtype}, not floating point")
        scales = source.read().float()
        first, columns = layer.input_slice()
        rows = torch.arange(start, start + size) // bo
        cols = slice(first // bi, first // bi + math.ceil(columns / bi))
        param.data[offset : offset + size] = scales[rows][:, cols].to(param.device)

    return load


def dequantize(layer: nn.Module) -> torch.Tensor:
    """A layer's weight (a linear layer's or the LM head's) as its FP8 form stands for it,
    float32 [out, in]."""
    w = layer.weight.float()
    if isinstance(layer.quant, BlockFp8):
        bi = layer.quant.block
        scales = layer.weight_scale_inv.repeat_interleave(bi, dim=1)[:, : w.shape[1]]
        return w * scales
    return w * layer.weight_scale[:, None]


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] in e4m3 with a float32 scale per token [T, 1] (max|x| / 448): one Triton
    launch on CUDA, ``round_per_token`` elsewhere (the same values, bit for bit)."""
    if x.is_cuda and _triton():
        from nano_models.layers.fp8_quant import round_per_token as rounded_on_gpu

        return rounded_on_gpu(x)
    return round_per_token(x)


def round_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] in e4m3 with a float32 scale per token [T, 1] (max|x| / 448), in torch."""
    return round_per_token_group(x, max(x.shape[-1], 1))


def round_per_token_group(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] in e4m3 with a float32 scale per token and group of ``group`` columns
    [T, ceil(K / group)] (max|x| / 448 over the group, at least 1e-12; the last group may be
    short), in torch: the CPU path and the reference of the Triton kernels."""
    t, k = x.shape
    groups = -(-k // group)
    padded = F.pad(x.float(), (0, groups * group - k)).view(t, groups, group)
    amax = padded.abs().amax(dim=-1)
    # (a division by a tensor: torch's CUDA division by a Python number multiplies by its
    # reciprocal, which rounds differently from the kernel's correctly rounded division)
    scale = (amax / torch.full_like(amax, FP8_MAX)).clamp(min=1e-12)
    q = (padded / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q.view(t, groups * group)[:, :k].contiguous(), scale


class BlockFp8:
    """A block-scaled e4m3 weight: the Triton kernels on CUDA, float32 elsewhere."""

    def __init__(self, block: int) -> None:
        self.block = block  # input columns per scale

    def scales(self, layer: LinearBase) -> tuple[torch.Tensor, int]:
        """The weight's scales [out, ceil(in / block)] and the columns a scale covers."""
        return layer.weight_scale_inv, self.block

    def apply(self, layer: LinearBase, x: torch.Tensor, bias: torch.Tensor | None):
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if x.is_cuda and _triton():
            from nano_models.layers.fp8_matmul import block_fp8_matmul

            y = block_fp8_matmul(x2, layer.weight, layer.weight_scale_inv, self.block)
            if bias is not None:
                y = y + bias
        else:
            y = F.linear(x2.float(), dequantize(layer), None if bias is None else bias.float())
            y = y.to(x.dtype)
        return y.reshape(*shape[:-1], y.shape[-1])


# Up to this many rows a per-channel FP8 product on CUDA widens the weight in the block-FP8
# Triton kernel (one scale block of all columns) and keeps the activations as they are:
# measured on an H200 at 1 and 16 rows for Qwen3-8B's layers, 122 / 123 us against 146 / 143 us
# for the activations' rounding and torch._scaled_mm (bf16: 144 / 142 us); from 64 rows the
# FP8 tensor cores win (135 against 246 us).
WIDEN_ROWS = 16


class ChannelFp8:
    """A per-channel e4m3 weight times per-token e4m3 activations: torch._scaled_mm on GPUs
    with FP8 tensor cores (up to ``WIDEN_ROWS`` rows: the weight widened, the activations not
    rounded), the same arithmetic in float32 elsewhere. The layer: a linear layer or the LM
    head (its ``weight`` and ``weight_scale``)."""

    def scales(self, layer: nn.Module) -> tuple[torch.Tensor, int]:
        """The weight's scales [out, 1] (one a row) and the columns a scale covers (all)."""
        return layer.weight_scale[:, None], layer.weight.shape[1]

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None):
        shape = x.shape
        n, k = layer.weight.shape
        x2 = x.reshape(-1, shape[-1])
        if x.is_cuda and x2.shape[0] <= WIDEN_ROWS and _triton() and k % 16 == 0:
            # (a few rows: the weight widened in the Triton kernel, the activations kept)
            from nano_models.layers.fp8_matmul import block_fp8_matmul

            y = block_fp8_matmul(x2.contiguous(), layer.weight, layer.weight_scale[:, None], k)
            if bias is not None:
                y = y + bias
            return y.reshape(*shape[:-1], n)
        x8, x_scale = quantize_per_token(x2)
        # (row-wise scales: bf16 outputs, sizes in multiples of 16)
        if (
            x.is_cuda
            and x.dtype == torch.bfloat16
            and n % 16 == k % 16 == 0
            and _fp8_tensor_cores(x.device)
        ):
            y = torch._scaled_mm(
                x8,
                layer.weight.t(),
                scale_a=x_scale,
                scale_b=layer.weight_scale[None, :],
                out_dtype=x.dtype,
            )
            if bias is not None:
                y = y + bias
        else:
            y = (x8.float() * x_scale) @ dequantize(layer).t()
            if bias is not None:
                y = y + bias.float()
            y = y.to(x.dtype)
        return y.reshape(*shape[:-1], y.shape[-1])


def _triton() -> bool:
    import importlib.util

    return importlib.util.find_spec("triton") is not None


def _fp8_tensor_cores(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device) >= (8, 9)
