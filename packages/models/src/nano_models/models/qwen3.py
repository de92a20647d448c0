"""Qwen3: per-head RMSNorm of q and k before rotary."""

from __future__ import annotations

from nano_models.config import ModelConfig
from nano_models.models.decoder import DecoderForCausalLM, DecoderSpec
from nano_models.registry import register_model


@register_model("Qwen3ForCausalLM")
class Qwen3ForCausalLM(DecoderForCausalLM):
    @classmethod
    def spec_for(cls, cfg: ModelConfig) -> DecoderSpec:
        return DecoderSpec(qkv_bias=cfg.attention_bias, o_bias=cfg.attention_bias, qk_norm=True)
