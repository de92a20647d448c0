"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention, and in the sparse layers a
mixture of experts in place of the MLP (a router's top ``num_experts_per_tok`` of
``num_experts``, renormalized with ``norm_topk_prob``). A layer is sparse unless it is in
``mlp_only_layers`` or ``decoder_sparse_step`` skips it (as transformers decides)."""

from __future__ import annotations

import re

import torch
from torch import nn

from nano_models.config import ModelConfig
from nano_models.layers.moe import SparseMoeBlock, fused_available
from nano_models.models.decoder import DecoderMLP, DecoderSpec
from nano_models.models.qwen3 import Qwen3ForCausalLM
from nano_models.parallel import SINGLE, TensorParallel
from nano_models.quantization import Fp8Config
from nano_models.registry import register_model

# model.layers.{i}.mlp.experts.{e}.{gate,up,down}_proj.weight (the hub's checkpoints), and
# an FP8 checkpoint's .weight_scale_inv beside each
_EXPERT = re.compile(
    r"(?P<layer>.*\.mlp\.experts)\.(?P<e>\d+)\.(?P<proj>gate|up|down)_proj"
    r"\.(?P<kind>weight|weight_scale_inv)"
)
# a router's FP8 scale (routers stay in the model's dtype)
_ROUTER_SCALE = re.compile(r".*\.mlp\.gate\.weight_scale_inv")
# our experts' parameters loaded from those tensors
_EXPERT_PARAMS = ("w13_weight", "w2_weight", "w13_weight_scale_inv", "w2_weight_scale_inv")
_SETTINGS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size")


def moe_settings(cfg: ModelConfig) -> tuple[int, int, int, bool]:
    """(num_experts, num_experts_per_tok, moe_intermediate_size, norm_topk_prob) of a config;
    ValueError naming what is missing or wrong."""
    raw = dict(cfg.raw)
    if "num_experts" not in raw and "num_local_experts" in raw:  # (transformers 5's name)
        raw["num_experts"] = raw["num_local_experts"]
    missing = [k for k in _SETTINGS if k not in raw]
    if missing:
        raise ValueError(f"a Qwen3-MoE config needs {missing}")
    for name in _SETTINGS:
        value = raw[name]
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    experts, top_k, size = (raw[name] for name in _SETTINGS)
    return experts, top_k, size, bool(raw.get("norm_topk_prob", False))


def is_sparse(cfg: ModelConfig, layer: int) -> bool:
    """Whether ``layer`` has experts (transformers' rule)."""
    raw = cfg.raw
    step = raw.get("decoder_sparse_step", 1) or 1
    return layer not in (raw.get("mlp_only_layers") or []) and (layer + 1) % step == 0


@register_model("Qwen3MoeForCausalLM")
class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    @property
    def supports_cuda_graphs(self) -> bool:
        """On CUDA with the fused kernels (the torch experts' shapes follow the routing)."""
        return fused_available(next(self.parameters()).device)

    def __init__(self, cfg: ModelConfig, tp: TensorParallel = SINGLE) -> None:
        moe_settings(cfg)  # (checked before any layer is built)
        super().__init__(cfg, tp)

    @classmethod
    def make_mlp(
        cls, cfg: ModelConfig, spec: DecoderSpec, tp: TensorParallel, layer: int
    ) -> nn.Module:
        if not is_sparse(cfg, layer):
            return DecoderMLP(cfg, spec, tp)
        experts, top_k, size, renormalize = moe_settings(cfg)
        fp8 = Fp8Config.of(cfg, None)  # (an FP8 checkpoint's experts are made in e4m3)
        e4m3 = fp8 is not None and not fp8.keeps(f"model.layers.{layer}.mlp.experts")
        dtype = torch.float8_e4m3fn if e4m3 else None
        return SparseMoeBlock(cfg.hidden_size, size, experts, top_k, renormalize, tp, dtype)

    def checkpoint_target(self, name: str) -> tuple[str, object] | None:
        """Our parameter and shard of a checkpoint tensor, for the experts' (None: the
        others, mapped as in every decoder)."""
        m = _EXPERT.fullmatch(name)
        if m is None:
            if _ROUTER_SCALE.fullmatch(name):
                raise ValueError(
                    f"{name}: this checkpoint holds a router in FP8; routers are read in the "
                    "model's dtype only (as vLLM reads them)"
                )
            return None
        expert, kind = int(m["e"]), m["kind"]
        if m["proj"] == "down":
            return f"{m['layer']}.w2_{kind}", expert
        return f"{m['layer']}.w13_{kind}", (expert, 0 if m["proj"] == "gate" else 1)

    def param_shards(self, param_name: str) -> set | None:
        """The shards a parameter is loaded from (None: as in every decoder)."""
        layer, _, kind = param_name.rpartition(".")
        if layer.endswith(".experts") and kind in _EXPERT_PARAMS:
            return self.get_submodule(layer).shards(param_name)
        return None

    def checkpoint_name(self, param_name: str, shard) -> str | None:
        """The checkpoint tensor of an expert parameter's shard (None: not an expert's)."""
        layer, _, param = param_name.rpartition(".")
        if param not in _EXPERT_PARAMS:
            return None
        which, _, kind = param.partition("_")  # (w13 | w2, weight | weight_scale_inv)
        if which == "w13":
            expert, part = shard
            return f"{layer}.{expert}.{('gate', 'up')[part]}_proj.{kind}"
        return f"{layer}.{shard}.down_proj.{kind}"
