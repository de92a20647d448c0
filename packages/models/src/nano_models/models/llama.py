"""Llama 2 / 3 / 3.1 / 3.2 and Mistral-style configs (a sliding window up to its length:
``ModelConfig.max_context``)."""

from __future__ import annotations

from nano_models.config import ModelConfig
from nano_models.models.decoder import DecoderForCausalLM, DecoderSpec
from nano_models.registry import register_model


@register_model("LlamaForCausalLM")
@register_model("MistralForCausalLM")
class LlamaForCausalLM(DecoderForCausalLM):
    @classmethod
    def spec_for(cls, cfg: ModelConfig) -> DecoderSpec:
        return DecoderSpec(
            qkv_bias=cfg.attention_bias, o_bias=cfg.attention_bias, mlp_bias=cfg.mlp_bias
        )
