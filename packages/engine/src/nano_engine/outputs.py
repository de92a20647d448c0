"""What the engine returns: vLLM-style request outputs."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    """Log-probability of the sampled token, and of the top tokens (id, logprob), best first."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop", "length", "abort"; None while running
    logprobs: list[Logprob] | None = None
    stop_reason: str | int | None = None  # the stop string or stop token id that matched


@dataclass
class RequestOutput:
    """A request's state. Streamed outputs carry only what is new since the previous one
    (``text``, ``token_ids`` and ``logprobs`` deltas); ``LLM.generate`` returns whole ones."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    num_cached_tokens: int = 0
    metrics: dict[str, float] = field(default_factory=dict)
