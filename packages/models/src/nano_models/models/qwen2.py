"""Qwen2 and Qwen2.5: bias on q, k and v."""

from __future__ import annotations

from nano_models.models.decoder import DecoderForCausalLM, DecoderSpec
from nano_models.registry import register_model


@register_model("Qwen2ForCausalLM")
class Qwen2ForCausalLM(DecoderForCausalLM):
    spec = DecoderSpec(qkv_bias=True)
