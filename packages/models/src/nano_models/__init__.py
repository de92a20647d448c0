"""nano-models: Qwen3, Qwen3-MoE, Qwen2 and Llama for a paged KV cache, with tensor-parallel
layers and safetensors loading.

The names below are imported when first used: reading a model's config (``ModelConfig``) does
not import torch."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from nano_models._version import __version__

if TYPE_CHECKING:
    from nano_models.config import ModelConfig
    from nano_models.context import ForwardContext
    from nano_models.layers.attention import (
        ATTENTION_BACKENDS,
        AttentionBackend,
        get_attention_backend,
    )
    from nano_models.loader import LoadReport, load_model
    from nano_models.parallel import SINGLE, TensorParallel
    from nano_models.registry import MODELS, model_class, register_model

# name -> the module that defines it
_HOMES = {
    "ModelConfig": "nano_models.config",
    "ForwardContext": "nano_models.context",
    "ATTENTION_BACKENDS": "nano_models.layers.attention",
    "AttentionBackend": "nano_models.layers.attention",
    "get_attention_backend": "nano_models.layers.attention",
    "LoadReport": "nano_models.loader",
    "load_model": "nano_models.loader",
    "SINGLE": "nano_models.parallel",
    "TensorParallel": "nano_models.parallel",
    "MODELS": "nano_models.registry",
    "model_class": "nano_models.registry",
    "register_model": "nano_models.registry",
}

__all__ = [
    "ATTENTION_BACKENDS",
    "MODELS",
    "SINGLE",
    "AttentionBackend",
    "ForwardContext",
    "LoadReport",
    "ModelConfig",
    "TensorParallel",
    "__version__",
    "get_attention_backend",
    "load_model",
    "model_class",
    "register_model",
]


def __getattr__(name: str) -> object:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'nano_models' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value  # (the next lookup does not come here)
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_HOMES})
