"""What the engine returns: vLLM-style request outputs."""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field


class Logprob:
    """Log-probability of the sampled token, and of the top tokens (id, logprob), best first.

    Compact: the top tokens are kept in two typed arrays (int32 ids, float32 logprobs, as the
    sampler computed them), about 0.2 KB per token with 20 of them, not a list of tuples."""

    __slots__ = ("logprob", "rank", "token_id", "top_ids", "top_logprobs")

    def __init__(
        self, token_id: int, logprob: float, top: Iterable[tuple[int, float]] = ()
    ) -> None:
        pairs = list(top)
        self.token_id, self.logprob, self.rank = token_id, logprob, None
        self.top_ids = array("i", [t for t, _ in pairs])
        self.top_logprobs = array("f", [v for _, v in pairs])

    @classmethod
    def of(
        cls,
        token_id: int,
        logprob: float,
        top_ids: Sequence[int],
        top_logprobs: Sequence[float],
        rank: int | None = None,
    ) -> Logprob:
        """From the top ids and logprobs as two sequences (no pairs built); ``rank``: the
        token's rank in the whole distribution (1: the likeliest), where computed."""
        lp = cls.__new__(cls)
        lp.token_id, lp.logprob, lp.rank = token_id, logprob, rank
        lp.top_ids, lp.top_logprobs = array("i", top_ids), array("f", top_logprobs)
        return lp

    @property
    def top(self) -> list[tuple[int, float]]:
        return list(zip(self.top_ids, self.top_logprobs))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Logprob):
            return NotImplemented
        return (self.token_id, self.logprob, self.top_ids, self.top_logprobs) == (
            other.token_id,
            other.logprob,
            other.top_ids,
            other.top_logprobs,
        )

    def __repr__(self) -> str:
        return f"Logprob(token_id={self.token_id}, logprob={self.logprob}, top={self.top})"


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
    # with SamplingParams.prompt_logprobs: one per prompt token (None for the first), in the
    # first output once all are known
    prompt_logprobs: list[Logprob | None] | None = None


# A request's output on the wire, between a replica's engine and the front: (request id,
# finished, cached prompt tokens, its completions as tuples of CompletionOutput's fields in
# order, prompt logprobs, seconds from its first token to this output in the replica's clock
# or None before it). A request that failed there travels as (request id, why): two items.
# Plain tuples pickle several times faster than the dataclasses, and the replica's sender
# holds its step loop's interpreter lock meanwhile. ``Request.output`` builds it for a
# replica's streams (``RequestStream.wire``).
WireOutput = tuple[str, bool, int, list[tuple], list | None, float | None]


def is_last(out: RequestOutput | WireOutput) -> bool:
    """Whether a request's output, in either form, is its last."""
    return out[1] if type(out) is tuple else out.finished


def tokens_of(out: RequestOutput | WireOutput) -> int:
    """The token ids in a request's output, in either form."""
    if type(out) is tuple:
        return sum(len(c[2]) for c in out[3])
    return sum(len(o.token_ids) for o in out.outputs)
