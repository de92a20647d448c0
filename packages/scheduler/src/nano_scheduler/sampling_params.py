"""Sampling parameters of one request, with vLLM's names and defaults."""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass

# As in vLLM: a temperature below GREEDY_BELOW is greedy, one below MIN_TEMPERATURE is raised to
# it (1 / temperature would overflow the logits).
GREEDY_BELOW = 1e-5
MIN_TEMPERATURE = 1e-2


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


_NUMBERS = (
    "temperature",
    "top_p",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
)


_KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """A constraint on a request's output (vLLM's names): exactly one of a JSON schema
    (``json``: a dict or its JSON text), any JSON object (``json_object=True``), a regular
    expression (``regex``, the whole output matches it), one of a few strings (``choice``) or
    an EBNF grammar (``grammar``, GBNF style, its start rule ``root``). ``disable_any_whitespace``:
    JSON without whitespace between its elements (else any whitespace, as in vLLM).

    Checked here for form only; whether the engine can compile the schema, the expression or
    the grammar, it tells when the request is made (a ValueError naming the problem). ``json``
    is kept as JSON text (its keys in their order: the output's properties follow it), so that
    params are hashable and equal schemas share a compiled grammar."""

    json: str | dict | bool | None = None
    regex: str | None = None
    choice: tuple[str, ...] | list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        errors = list(self._errors())
        if errors:
            raise ValueError("invalid structured outputs: " + "; ".join(errors))

    def _errors(self):
        given = [k for k in _KINDS if self._given(k)]
        if len(given) != 1:
            yield (
                f"give exactly one of {', '.join(_KINDS)}, got "
                f"{', '.join(given) if given else 'none'}"
            )
        schema = self.json
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as e:
                yield f"json is not valid JSON text: {e}"
                schema = None
            else:
                if not isinstance(schema, (dict, bool)):
                    yield f"json must be a JSON schema (an object), got {type(schema).__name__}"
        elif schema is not None and not isinstance(schema, (dict, bool)):
            yield f"json must be a JSON schema (a dict or its text), got {type(schema).__name__}"
        if isinstance(schema, (dict, bool)):
            object.__setattr__(self, "json", json.dumps(schema))
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                yield f"{name} must be a non-empty string, got {value!r}"
        if self.choice is not None:
            if not isinstance(self.choice, (list, tuple)) or not self.choice:
                yield f"choice must be a non-empty list of strings, got {self.choice!r}"
            elif any(not isinstance(c, str) or not c for c in self.choice):
                yield f"choice must hold non-empty strings, got {self.choice!r}"
            else:
                object.__setattr__(self, "choice", tuple(self.choice))
        for name in ("json_object", "disable_any_whitespace"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                yield f"{name} must be a bool, got {value!r}"

    def _given(self, kind: str) -> bool:
        value = getattr(self, kind)
        return value is True if kind == "json_object" else value is not None

    @property
    def kind(self) -> str:
        """Which constraint: json, regex, choice, grammar or json_object."""
        return next(k for k in _KINDS if self._given(k))


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request's output. Immutable once validated (``replace`` makes a
    validated copy), so that no caller can change a request the engine already holds.

    temperature 0 (or below 1e-5) means greedy; from 1e-5 to 1e-2 it is raised to 1e-2, as in
    vLLM. top_k 0 or -1 and top_p 1 turn those filters off. max_tokens None means until the
    model's maximum length. logprobs: how many top log-probabilities to return per output token
    besides the sampled one's (None: none); prompt_logprobs: the same per prompt token (from
    the second; such a request does not read the prefix cache: every prompt token is
    computed). ``stop`` and ``stop_token_ids`` are kept as tuples.
    ``structured_outputs``: a constraint the output meets (a JSON schema, a regex, ...).
    ``logit_bias`` adds to the logits of token ids (OpenAI's, [-100, 100]);
    ``allowed_token_ids`` restricts the output to those tokens; ``bad_words``: words the
    output never holds (their last token is banned where the output ends with the rest).
    """

    n: int = 1
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: tuple[str, ...] | list[str] | str | None = None
    stop_token_ids: tuple[int, ...] | list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    structured_outputs: StructuredOutputsParams | None = None
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: tuple[int, ...] | list[int] | None = None
    bad_words: tuple[str, ...] | list[str] | None = None

    def __post_init__(self) -> None:
        normal = object.__setattr__  # (frozen: only validation sets fields)
        if isinstance(self.stop, str):
            normal(self, "stop", (self.stop,))
        if self.stop is None or isinstance(self.stop, (list, tuple)):
            normal(self, "stop", tuple(self.stop or ()))
        if self.stop_token_ids is None or isinstance(self.stop_token_ids, (list, tuple)):
            normal(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        for name in ("allowed_token_ids", "bad_words"):
            if isinstance(getattr(self, name), list):
                normal(self, name, tuple(getattr(self, name)))
        if isinstance(self.logit_bias, dict):
            normal(self, "logit_bias", dict(self.logit_bias))  # (the caller's stays theirs)
        errors = list(self._errors())
        if errors:
            raise ValueError("invalid sampling parameters: " + "; ".join(errors))
        if self.top_k == -1:
            normal(self, "top_k", 0)
        if self.temperature < GREEDY_BELOW:
            normal(self, "temperature", 0.0)
        elif self.temperature < MIN_TEMPERATURE:
            normal(self, "temperature", MIN_TEMPERATURE)

    def replace(self, **changes) -> SamplingParams:
        """A validated copy with ``changes``."""
        return dataclasses.replace(self, **changes)

    def _errors(self):
        if not _is_int(self.n) or self.n < 1:
            yield f"n must be an integer >= 1, got {self.n!r}"
        numbers = set(_NUMBERS)  # those that are numbers: the range checks below need them
        for name in _NUMBERS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                yield f"{name} must be a number, got {value!r}"
                numbers.discard(name)
            elif not math.isfinite(value):
                yield f"{name} must be a finite number, got {value!r}"
                numbers.discard(name)
        if "temperature" in numbers and self.temperature < 0:
            yield f"temperature must be >= 0 (0 is greedy), got {self.temperature}"
        if not _is_int(self.top_k) or (self.top_k < 0 and self.top_k != -1):
            yield f"top_k must be an integer >= 0, or -1 (off), got {self.top_k!r}"
        if "top_p" in numbers and not 0 < self.top_p <= 1:
            yield f"top_p must be in (0, 1], got {self.top_p}"
        if "min_p" in numbers and not 0 <= self.min_p <= 1:
            yield f"min_p must be in [0, 1], got {self.min_p}"
        if "repetition_penalty" in numbers and self.repetition_penalty <= 0:
            yield f"repetition_penalty must be > 0 (1 is off), got {self.repetition_penalty}"
        for name in ("presence_penalty", "frequency_penalty"):
            if name in numbers and not -2 <= getattr(self, name) <= 2:
                yield f"{name} must be in [-2, 2], got {getattr(self, name)}"
        if self.seed is not None and (not _is_int(self.seed) or not -(2**63) <= self.seed < 2**64):
            yield f"seed must be a 64-bit integer or None, got {self.seed!r}"
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            yield f"max_tokens must be an integer >= 1, got {self.max_tokens!r}"
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            yield f"min_tokens must be an integer >= 0, got {self.min_tokens!r}"
        elif (
            self.max_tokens is not None
            and _is_int(self.max_tokens)
            and (self.min_tokens > self.max_tokens)
        ):
            yield f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})"
        if not isinstance(self.stop, tuple) or any(
            not isinstance(s, str) or not s for s in self.stop
        ):
            yield f"stop strings must be non-empty strings, got {self.stop!r}"
        if not isinstance(self.stop_token_ids, tuple) or any(
            not _is_int(t) or t < 0 for t in self.stop_token_ids
        ):
            yield f"stop_token_ids must be a list of token ids >= 0, got {self.stop_token_ids!r}"
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or value < 0):
                yield f"{name} must be an integer >= 0 or None, got {value!r}"
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                yield f"{name} must be a bool, got {getattr(self, name)!r}"
        if self.logit_bias is not None and (
            not isinstance(self.logit_bias, dict)
            or any(not _is_int(t) or t < 0 for t in self.logit_bias)
            or any(
                isinstance(b, bool) or not isinstance(b, (int, float)) or not -100 <= b <= 100
                for b in self.logit_bias.values()
            )
        ):
            yield (
                "logit_bias must map token ids >= 0 to biases in [-100, 100], got "
                f"{self.logit_bias!r}"
            )
        if self.allowed_token_ids is not None and (
            not isinstance(self.allowed_token_ids, tuple)
            or not self.allowed_token_ids
            or any(not _is_int(t) or t < 0 for t in self.allowed_token_ids)
        ):
            yield (
                "allowed_token_ids must be a non-empty list of token ids >= 0, got "
                f"{self.allowed_token_ids!r}"
            )
        if self.bad_words is not None and (
            not isinstance(self.bad_words, tuple)
            or any(not isinstance(w, str) or not w.strip() for w in self.bad_words)
        ):
            yield f"bad_words must be a list of non-blank strings, got {self.bad_words!r}"
        so = self.structured_outputs
        if so is not None and not isinstance(so, StructuredOutputsParams):
            yield f"structured_outputs must be a StructuredOutputsParams, got {type(so).__name__}"

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
