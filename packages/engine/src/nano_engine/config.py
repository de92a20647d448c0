"""Engine configuration: nano-vllm's Config fields and more, validated."""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING

from nano_engine import hub
from nano_engine.reasoning import PARSERS
from nano_scheduler.router import ROUTERS

if TYPE_CHECKING:
    from nano_models import ModelConfig

log = logging.getLogger("nano_engine")

DTYPES = ("auto", "float32", "float16", "bfloat16")
DEVICES = ("auto", "cuda", "cpu")
LOAD_FORMATS = ("auto", "dummy")
DATA_PARALLEL_BACKENDS = ("ray", "mp")
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")  # (vLLM's names; fp8 is e4m3)
QUANTIZATIONS = ("fp8",)  # (nano_models.quantization's; named here for the command line)
# nano_models' attention backends (its BACKEND_NAMES; named here so that the command line's
# help does not import torch)
ATTENTION_BACKENDS = ("auto", "torch", "triton", "flash_attn")


@dataclass(frozen=True)
class EngineConfig:
    """Everything ``LLM(model, **config)`` accepts; an unknown keyword is an error.

    model: a local Hugging Face checkpoint directory (with load_format "dummy", its config.json
    alone, or the path of that file), or a hub id ("Qwen/Qwen3-0.6B": fetched into the Hugging
    Face cache, or found there offline; ``nano_engine.hub``) at ``revision`` (by
    ``from_kwargs``, which then holds the snapshot's directory). tokenizer: default the model's
    (a directory or a hub id). max_model_len: default and cap the model's
    max_position_embeddings, or the window of a sliding-window attention (not implemented: the
    same as full attention up to there). KV cache: on CUDA, sized from gpu_memory_utilization
    after a warm-up at the largest batch; on the CPU, kv_cache_memory_gb (default 1);
    num_kvcache_blocks overrides both. async_scheduling: schedule and launch each step while the
    previous one runs (its sampled tokens feed the next step on the device; with tensor
    parallelism rank 0 broadcasts them to the workers); default on.
    reasoning_parser (``qwen3``, ``deepseek_r1``): chat outputs split into reasoning and
    content, and a structured output's constraint applies once the reasoning has ended.
    kv_cache_dtype: ``auto`` (the model's dtype) or ``fp8`` (``fp8_e4m3``): the cache holds K
    and V in e4m3 with a scale per layer for each (the checkpoint's k_scale / v_scale, else 1),
    half the bytes of bf16 per token. quantization: ``fp8`` quantizes a bf16 or fp32
    checkpoint's linear layers to e4m3 as it loads (a scale per output channel; activations
    per token); a checkpoint in FP8 (its quantization_config) is read as such without it.
    quantize_lm_head: with FP8 weights, the LM head's weight in e4m3 too (a scale per
    vocabulary row; it stays in the model's dtype by default, as vLLM keeps it).
    data_parallel_size: engine replicas, each with its own device(s) (tensor_parallel_size
    GPUs), behind one front that routes each request by ``router`` (``nano_scheduler.router``:
    least_tokens, prefix_aware, round_robin); data_parallel_backend ``ray`` places them as Ray
    actors (on the Ray cluster at data_parallel_address, else one started here), ``mp`` as
    processes of this host.
    """

    model: str
    tokenizer: str | None = None
    skip_tokenizer_init: bool = False
    max_num_batched_tokens: int = 16384
    max_num_seqs: int = 256
    max_model_len: int | None = None
    gpu_memory_utilization: float = 0.9
    kv_cache_memory_gb: float | None = None
    tensor_parallel_size: int = 1
    enforce_eager: bool = False
    kvcache_block_size: int = 16
    num_kvcache_blocks: int | None = None
    dtype: str = "auto"
    seed: int = 0
    load_format: str = "auto"
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    scheduling_policy: str = "decode_first"
    attention_backend: str = "auto"
    device: str = "auto"
    async_scheduling: bool | None = None
    max_logprobs: int = 20
    reasoning_parser: str | None = None
    revision: str | None = None
    kv_cache_dtype: str = "auto"
    quantization: str | None = None
    quantize_lm_head: bool = False
    data_parallel_size: int = 1
    data_parallel_backend: str = "ray"
    data_parallel_address: str | None = None
    router: str = "least_tokens"

    def __post_init__(self) -> None:
        errors = list(self._errors())
        if errors:
            raise ValueError("invalid engine configuration: " + "; ".join(errors))

    def _errors(self):
        path = Path(self.model)
        if not path.exists():
            yield (
                f"model {self.model!r} does not exist (a local checkpoint directory, or a "
                "Hugging Face hub id such as Qwen/Qwen3-0.6B)"
            )
        elif path.is_dir() and not (path / "config.json").is_file():
            yield f"model directory {self.model!r} has no config.json"
        elif path.is_file() and self.load_format != "dummy":
            yield f"model {self.model!r} is a file: weights need a checkpoint directory"
        for name in (
            "max_num_batched_tokens",
            "max_num_seqs",
            "tensor_parallel_size",
            "kvcache_block_size",
            "data_parallel_size",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                yield f"{name} must be an integer >= 1, got {value!r}"
        for name in ("max_model_len", "num_kvcache_blocks"):
            value = getattr(self, name)
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int) or value < 1
            ):
                yield f"{name} must be an integer >= 1 or None, got {value!r}"
        if not 0 < self.gpu_memory_utilization <= 1:
            yield f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
        if self.kv_cache_memory_gb is not None and not self.kv_cache_memory_gb > 0:
            yield f"kv_cache_memory_gb must be > 0, got {self.kv_cache_memory_gb}"
        for name, allowed in (
            ("dtype", DTYPES),
            ("device", DEVICES),
            ("load_format", LOAD_FORMATS),
            ("attention_backend", ATTENTION_BACKENDS),
            ("data_parallel_backend", DATA_PARALLEL_BACKENDS),
            ("kv_cache_dtype", KV_CACHE_DTYPES),
            ("router", tuple(sorted(ROUTERS))),
        ):
            if getattr(self, name) not in allowed:
                yield f"{name} must be one of {allowed}, got {getattr(self, name)!r}"
        if not isinstance(self.seed, int):
            yield f"seed must be an integer, got {self.seed!r}"
        if (
            isinstance(self.max_logprobs, bool)
            or not isinstance(self.max_logprobs, int)
            or self.max_logprobs < 0
        ):
            yield f"max_logprobs must be an integer >= 0, got {self.max_logprobs!r}"
        if self.revision is not None and (not isinstance(self.revision, str) or not self.revision):
            yield f"revision must be a non-empty string or None, got {self.revision!r}"
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            yield f"quantization must be one of {QUANTIZATIONS} or None, got {self.quantization!r}"
        if self.data_parallel_address is not None and (
            not isinstance(self.data_parallel_address, str) or not self.data_parallel_address
        ):
            yield (
                "data_parallel_address must be a non-empty string or None, got "
                f"{self.data_parallel_address!r}"
            )
        elif self.data_parallel_address is not None and self.data_parallel_backend != "ray":
            yield "data_parallel_address is a Ray cluster's: it needs data_parallel_backend 'ray'"
        if self.reasoning_parser is not None and self.reasoning_parser not in PARSERS:
            yield (
                f"reasoning_parser must be one of {sorted(PARSERS)} or None, got "
                f"{self.reasoning_parser!r}"
            )

    @classmethod
    def from_kwargs(cls, model: str, **kwargs) -> EngineConfig:
        if not isinstance(model, (str, os.PathLike)):
            raise TypeError(f"model must be a checkpoint path (str), got {type(model).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValueError(f"unknown engine option(s) {unknown}; known: {sorted(known)}")
        # (a hub id becomes its snapshot's directory here: what the engine reads, and what
        # an engine started in another process is given, without the revision)
        kind = "config" if kwargs.get("load_format") == "dummy" else "model"
        model = hub.resolve(str(model), kwargs.pop("revision", None), kind)
        if isinstance(kwargs.get("tokenizer"), str):
            kwargs["tokenizer"] = hub.resolve(kwargs["tokenizer"], kind="tokenizer")
        return cls(model=model, **kwargs)

    @property
    def fp8_kv_cache(self) -> bool:
        return self.kv_cache_dtype in ("fp8", "fp8_e4m3")

    @property
    def use_async_scheduling(self) -> bool:
        return self.async_scheduling is None or bool(self.async_scheduling)

    def replace(self, **changes) -> EngineConfig:
        return dataclasses.replace(self, **changes)


def resolve_max_model_len(requested: int | None, mc: ModelConfig) -> int:
    """The engine's max_model_len: ``requested`` (at most the model's positions), else the
    longest context the model computes as its checkpoint's does (``ModelConfig.max_context``:
    its positions, or the window of a sliding-window attention, which ours is not)."""
    window = mc.sliding_window
    if requested is None:
        if window is not None:
            log.warning(
                "max_model_len %d: the model's attention slides over a window of %d tokens "
                "(not implemented; full attention is the same up to there)",
                window,
                window,
            )
        return mc.max_context
    if window is not None and requested > window:
        raise ValueError(
            f"max_model_len {requested} exceeds the model's sliding window ({window} tokens): "
            f"sliding-window attention is not supported; {window} or less computes the same"
        )
    if requested > mc.max_position_embeddings:
        raise ValueError(
            f"max_model_len {requested} exceeds the model's max_position_embeddings "
            f"({mc.max_position_embeddings})"
        )
    return requested
