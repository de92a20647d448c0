"""The model configuration read from a Hugging Face config.json (no transformers needed)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# the weights' dtypes a config.json may name (torch's names; torch is imported when a model is
# made, not when its config is read: the server's front reads configs and needs no torch)
DTYPES = ("float32", "float16", "bfloat16")
# Architectures whose configs leave sliding-window attention off unless use_sliding_window says
# so (transformers' defaults; Mistral's has no such switch: its window is on when it is set).
_WINDOW_OFF_BY_DEFAULT = ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM")


@dataclass(frozen=True)
class ModelConfig:
    """The fields of a decoder-only transformer's config.json that our models use."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    hidden_act: str = "silu"
    dtype_name: str = "bfloat16"  # (one of DTYPES)
    eos_token_ids: tuple[int, ...] = ()
    raw: dict = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_dict(cls, config: dict) -> ModelConfig:
        architectures = config.get("architectures") or []
        if len(architectures) != 1:
            raise ValueError(f"config.json must name one architecture, got {architectures!r}")
        required = (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
        )
        missing = [k for k in required if k not in config]
        if missing:
            raise ValueError(f"config.json lacks {missing}")
        heads = config["num_attention_heads"]
        # transformers >= 5 writes rope_parameters (theta inside); older configs rope_theta and
        # rope_scaling. Where both are given, rope_scaling wins, as in transformers (a model card
        # that enables YaRN adds rope_scaling to a config that has rope_parameters already).
        params = config.get("rope_parameters") or {}
        rope = dict(config.get("rope_scaling") or params)
        theta = rope.pop("rope_theta", params.get("rope_theta", config.get("rope_theta", 10000.0)))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        eos = config.get("eos_token_id")
        dtype_name = config.get("torch_dtype") or config.get("dtype") or "bfloat16"
        if dtype_name not in DTYPES:
            raise ValueError(f"unsupported dtype {dtype_name!r} in config.json")
        return cls(
            architecture=architectures[0],
            vocab_size=config["vocab_size"],
            hidden_size=config["hidden_size"],
            intermediate_size=config["intermediate_size"],
            num_hidden_layers=config["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=config.get("num_key_value_heads") or heads,
            head_dim=config.get("head_dim") or config["hidden_size"] // heads,
            max_position_embeddings=config.get("max_position_embeddings", 4096),
            rms_norm_eps=config.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling=rope if rope_type != "default" else None,
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            attention_bias=bool(config.get("attention_bias", False)),
            mlp_bias=bool(config.get("mlp_bias", False)),
            hidden_act=config.get("hidden_act", "silu"),
            dtype_name=dtype_name,
            eos_token_ids=tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,)),
            raw=config,
        )

    def __post_init__(self) -> None:
        if self.dtype_name not in DTYPES:
            raise ValueError(f"dtype_name must be one of {DTYPES}, got {self.dtype_name!r}")

    @property
    def dtype(self) -> torch.dtype:
        """The weights' dtype, as config.json names it."""
        import torch

        return getattr(torch, self.dtype_name)

    @property
    def sliding_window(self) -> int | None:
        """The window of sliding-window attention where some layer slides and the window is
        shorter than the model's positions (a token then attends to the last ``sliding_window``
        tokens, itself included), else None. As transformers reads it: ``layer_types`` where
        given, else where ``use_sliding_window`` (default on but for the Qwen models), and then
        in the layers from ``max_window_layers`` on. Our attention is full: up to the window's
        length the two are the same."""
        raw = self.raw
        window = raw.get("sliding_window")
        if window is None or window >= self.max_position_embeddings:
            return None
        types = raw.get("layer_types")
        if types is not None:
            return window if "sliding_attention" in types else None
        first = raw.get("max_window_layers", 0)
        on = raw.get("use_sliding_window", self.architecture not in _WINDOW_OFF_BY_DEFAULT)
        return window if on and first < self.num_hidden_layers else None

    @property
    def max_context(self) -> int:
        """The longest context computed as the checkpoint's model computes it: its positions, or
        a sliding window's length (full attention is windowed attention up to there)."""
        return self.sliding_window or self.max_position_embeddings

    @classmethod
    def from_pretrained(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        file = path / "config.json" if path.is_dir() else path
        if not file.is_file():
            raise FileNotFoundError(f"no config.json in {path}")
        try:
            data = json.loads(file.read_text())
        except ValueError as e:  # (JSONDecodeError, UnicodeDecodeError)
            raise ValueError(f"{file} is not valid JSON: {e}") from e
        if not isinstance(data, dict):
            raise ValueError(f"{file} must hold a JSON object, got {type(data).__name__}")
        return cls.from_dict(data)
