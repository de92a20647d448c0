"""Scheduler budgets and policy knobs."""

from __future__ import annotations

from dataclasses import dataclass

POLICIES = ("decode_first", "prefill_first")


@dataclass(frozen=True)
class SchedulerConfig:
    """Budgets and policy of the scheduler.

    policy: ``decode_first`` (default) runs every decode first and fills the rest of the token
    budget with prefill chunks, so running requests never stall behind a long prompt;
    ``prefill_first`` is nano-vllm's offline order: a step runs prefills only, if any fit.
    admission_lookahead: how many waiting requests behind a head that does not fit (not enough
    free blocks) may be admitted past it; 0 is strict FCFS.
    watermark: fraction of the blocks kept free when admitting while others run, so running
    requests can grow before anything is preempted.
    """

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 4096
    enable_chunked_prefill: bool = True
    policy: str = "decode_first"
    admission_lookahead: int = 16
    watermark: float = 0.01
    eos_token_ids: frozenset[int] = frozenset()

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs "
                f"({self.max_num_seqs}): every running sequence needs a token each step"
            )
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"without chunked prefill, max_num_batched_tokens ({self.max_num_batched_tokens}) "
                f"must be >= max_model_len ({self.max_model_len}) so that every prompt fits a step"
            )
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        if (
            isinstance(self.admission_lookahead, bool)
            or not isinstance(self.admission_lookahead, int)
            or self.admission_lookahead < 0
        ):
            raise ValueError(
                f"admission_lookahead must be an integer >= 0, got {self.admission_lookahead!r}"
            )
        if not 0 <= self.watermark < 1:
            raise ValueError(f"watermark must be in [0, 1), got {self.watermark!r}")
        object.__setattr__(self, "eos_token_ids", frozenset(self.eos_token_ids))


def cuda_graph_sizes(max_num_seqs: int) -> list[int]:
    """The decode batch sizes the engine captures CUDA graphs for: 1, 2, 4, 8, then every
    multiple of 16, and max_num_seqs itself; a batch runs in the smallest that fits it."""
    sizes = {s for s in (1, 2, 4, 8) if s <= max_num_seqs}
    return sorted(sizes | set(range(16, max_num_seqs + 1, 16)) | {max_num_seqs})


def piecewise_graph_sizes(max_num_batched_tokens: int, per_octave: int = 8) -> list[int]:
    """The token counts the engine captures piecewise CUDA graphs for (steps whose attention
    runs outside a graph: prefill chunks, mixed steps): 16, 32, ..., 512, then ``per_octave``
    evenly spaced sizes per doubling (a step pads at most 1 / per_octave of its tokens), and
    max_num_batched_tokens itself; a step runs in the smallest that holds it."""
    sizes, size = set(), 16
    while size < max_num_batched_tokens:
        sizes.add(size)
        size += size if size < 512 else (1 << (size.bit_length() - 1)) // per_octave
    return sorted(sizes | {max_num_batched_tokens})
