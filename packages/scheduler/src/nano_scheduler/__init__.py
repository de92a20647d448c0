"""nano-scheduler: a torch-free continuous-batching scheduler, and a simulator that reuses it."""

from nano_scheduler._version import __version__
from nano_scheduler.config import SchedulerConfig, cuda_graph_sizes, piecewise_graph_sizes
from nano_scheduler.sampling_params import SamplingParams, StructuredOutputsParams
from nano_scheduler.scheduler import (
    PENDING_TOKEN,
    PendingStep,
    ScheduledChunk,
    Scheduler,
    SchedulerOutput,
    SchedulerStats,
)
from nano_scheduler.sequence import FinishReason, Sequence, SequenceStatus

__all__ = [
    "PENDING_TOKEN",
    "FinishReason",
    "PendingStep",
    "SamplingParams",
    "ScheduledChunk",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerOutput",
    "SchedulerStats",
    "Sequence",
    "SequenceStatus",
    "StructuredOutputsParams",
    "__version__",
    "cuda_graph_sizes",
    "piecewise_graph_sizes",
]
