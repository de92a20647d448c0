"""One request's state: tokens, status, KV bookkeeping and timestamps."""

from __future__ import annotations

from array import array
from enum import Enum

from nano_scheduler.sampling_params import SamplingParams


class SequenceStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


# (a module's global: an Enum's member read through its class costs ~70 ns in CPython 3.11,
# and the loop asks every sequence whether it finished several times a step)
_FINISHED = SequenceStatus.FINISHED


class FinishReason(str, Enum):
    STOP = "stop"  # eos, a stop token id or a stop string
    LENGTH = "length"  # max_tokens, max_model_len, or a KV pool too small to go on
    ABORT = "abort"

    def __str__(self) -> str:  # "stop", as vLLM's finish_reason prints (not FinishReason.STOP)
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


class Sequence:
    """A request moving WAITING -> RUNNING -> FINISHED (back to WAITING when preempted).

    ``token_ids`` holds the prompt followed by the output, as an int64 ``array`` (not a list: a
    list's items are walked by every full run of Python's cyclic collector, and a server holds
    hundreds of sequences of thousands of tokens; an array holds no Python objects, and its
    slices are block-hash bytes at once). ``num_computed_tokens`` counts the
    tokens whose KV is in the cache (prefix-cache hits included); the tokens after it are
    computed by the next steps, a chunk at a time. Times are seconds on the scheduler's clock.
    A pickled copy of a decoding sequence (what a worker process receives) has ``token_ids``
    None; ``num_tokens`` and ``last_token_id`` still answer.
    """

    def __init__(
        self,
        seq_id: int,
        prompt_token_ids: list[int],
        params: SamplingParams | None = None,
        arrival_time: float = 0.0,
    ) -> None:
        self.seq_id = seq_id
        self.token_ids: array | None = _token_array(prompt_token_ids)
        self.num_prompt_tokens = len(self.token_ids)
        self.params = params if params is not None else SamplingParams()
        self.status = SequenceStatus.WAITING
        self.finish_reason: FinishReason | None = None
        self.block_table: list[int] = []
        self.num_cached_tokens = 0
        self.num_prefix_cached_tokens = 0  # prefix-cache hits at the first admission
        self.num_computed_tokens = 0
        self.num_preemptions = 0
        # Set by the scheduler when the sequence is added: where it stops.
        self.max_num_tokens = 0
        self.stop_token_ids: frozenset[int] = frozenset()
        self.arrival_time = arrival_time
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.finish_time: float | None = None

    def __len__(self) -> int:
        return self.num_tokens

    @property
    def reads_prefix_cache(self) -> bool:
        """Whether the block manager may give it cached prefix blocks (not when its prompt's
        logprobs are asked for: every prompt token must be computed)."""
        return self.params.prompt_logprobs is None

    def __repr__(self) -> str:
        return (
            f"Sequence(id={self.seq_id}, {self.status.value}, prompt={self.num_prompt_tokens}, "
            f"output={self.num_output_tokens}, computed={self.num_computed_tokens})"
        )

    @property
    def num_tokens(self) -> int:
        return self._num_tokens if self.token_ids is None else len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens].tolist()

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :].tolist()

    @property
    def last_token_id(self) -> int:
        return self._last_token if self.token_ids is None else self.token_ids[-1]

    @property
    def is_finished(self) -> bool:
        return self.status is _FINISHED

    # Sent to a worker process, a decoding sequence (all but its last token computed) travels
    # without its token history: a step only needs its last token, length and block table.
    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        if self.token_ids is not None and 0 < self.num_computed_tokens == len(self.token_ids) - 1:
            state["_num_tokens"] = len(self.token_ids)
            state["_last_token"] = self.token_ids[-1]
            state["token_ids"] = None
        return state


def _token_array(token_ids) -> array | list:
    """The ids as an int64 array; as a list where one is not an int64 (the scheduler refuses
    the sequence, naming it)."""
    try:
        return array("q", token_ids)
    except (TypeError, OverflowError):
        return list(token_ids)
