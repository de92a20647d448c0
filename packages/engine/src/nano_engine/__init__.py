"""nano-engine: a small, fast LLM inference engine (LLM API, threaded engine, model runner with
CUDA graphs, sampler, tensor parallelism, CLI).

The names below are imported when first used, so that ``import nano_engine`` (and the command
line's help, version and argument errors) does not import torch."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from nano_engine._version import __version__

if TYPE_CHECKING:
    from nano_engine.config import EngineConfig
    from nano_engine.engine import LLMEngine
    from nano_engine.llm import LLM
    from nano_engine.outputs import CompletionOutput, Logprob, RequestOutput
    from nano_engine.streams import EngineDeadError, RequestStream
    from nano_scheduler import SamplingParams, StructuredOutputsParams

# name -> the module that defines it
_HOMES = {
    "EngineConfig": "nano_engine.config",
    "LLMEngine": "nano_engine.engine",
    "LLM": "nano_engine.llm",
    "CompletionOutput": "nano_engine.outputs",
    "Logprob": "nano_engine.outputs",
    "RequestOutput": "nano_engine.outputs",
    "EngineDeadError": "nano_engine.streams",
    "RequestStream": "nano_engine.streams",
    "SamplingParams": "nano_scheduler",
    "StructuredOutputsParams": "nano_scheduler",
}

__all__ = [
    "LLM",
    "CompletionOutput",
    "EngineConfig",
    "EngineDeadError",
    "LLMEngine",
    "Logprob",
    "RequestOutput",
    "RequestStream",
    "SamplingParams",
    "StructuredOutputsParams",
    "__version__",
]


def __getattr__(name: str) -> object:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'nano_engine' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value  # (the next lookup does not come here)
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_HOMES})
