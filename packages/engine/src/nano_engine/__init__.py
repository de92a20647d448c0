"""nano-engine: a small, fast LLM inference engine (LLM API, threaded engine, model runner with
CUDA graphs, sampler, tensor parallelism, CLI)."""

from nano_engine._version import __version__
from nano_engine.config import EngineConfig
from nano_engine.engine import LLMEngine
from nano_engine.llm import LLM
from nano_engine.outputs import CompletionOutput, Logprob, RequestOutput
from nano_engine.streams import EngineDeadError, RequestStream
from nano_scheduler import SamplingParams, StructuredOutputsParams

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
