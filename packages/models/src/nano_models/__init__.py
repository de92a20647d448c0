"""nano-models: Qwen3, Qwen3-MoE, Qwen2 and Llama for a paged KV cache, with tensor-parallel
layers and safetensors loading."""

from nano_models._version import __version__
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
