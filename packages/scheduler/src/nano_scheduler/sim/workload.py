"""Workloads for the simulator: the Azure LLM trace format, synthetic arrivals, shared prefixes.

A workload is a list of ``Request`` sorted by arrival time. Prompts carry lengths, not text; the
simulator gives them random token ids (deterministic for a seed) when they arrive, with the
tokens of a shared prefix identical across the requests of its group, so prefix caching works
as it would on real traffic.
"""

from __future__ import annotations

import csv
import math
import random
import re
from array import array
from dataclasses import dataclass, replace
from datetime import datetime
from pathlib import Path

VOCAB_SIZE = 1 << 16  # token ids are drawn below this (fold them into a model's vocabulary)


@dataclass(frozen=True)
class Request:
    arrival_time: float  # seconds from the start of the workload
    prompt_len: int
    output_len: int
    prefix_group: int = -1  # requests of one group share their first prefix_len tokens
    prefix_len: int = 0
    prompt_token_ids: tuple[int, ...] | None = None  # explicit tokens (else drawn at arrival)

    def __post_init__(self) -> None:
        if not 0 <= self.arrival_time < math.inf:  # (nan too)
            raise ValueError(f"arrival_time must be a finite number of seconds >= 0: {self}")
        if self.prompt_len < 1 or self.output_len < 1:
            raise ValueError(f"a request needs >= 1 prompt and output token: {self}")
        if not 0 <= self.prefix_len <= self.prompt_len:
            raise ValueError(f"prefix_len must be in [0, prompt_len]: {self}")

    def token_ids(self, index: int, seed: int) -> list[int]:
        """The prompt's token ids: the shared prefix of its group, then tokens of its own."""
        if self.prompt_token_ids is not None:
            return list(self.prompt_token_ids)
        tokens: list[int] = []
        if self.prefix_len:
            tokens = _draw(f"{seed}/prefix/{self.prefix_group}", self.prefix_len)
        return tokens + _draw(f"{seed}/request/{index}", self.prompt_len - self.prefix_len)


def _draw(seed: str, count: int) -> list[int]:
    """``count`` token ids below VOCAB_SIZE from a generator seeded with ``seed`` (16 random
    bits each, at C speed: a long trace draws millions)."""
    return list(array("H", random.Random(seed).randbytes(2 * count)))


def load_azure_trace(path: str | Path, limit: int | None = None) -> list[Request]:
    """Read a trace in the Azure LLM inference format (TIMESTAMP, ContextTokens,
    GeneratedTokens). Arrival times are relative to the first request; rows with zero tokens
    are dropped (a request needs a prompt and one output token; the public traces hold some).
    A value that is not a count of tokens >= 0 or a time is an error naming its line."""
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be >= 1 (or None for every request), got {limit}")
    rows = []
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        missing = {"TIMESTAMP", "ContextTokens", "GeneratedTokens"} - set(reader.fieldnames or ())
        if missing:
            raise ValueError(f"{path}: not an Azure trace, missing columns {sorted(missing)}")
        for row in reader:
            where = f"{path}:{reader.line_num}"
            prompt, output = (
                _count(row, name, where) for name in ("ContextTokens", "GeneratedTokens")
            )
            if prompt > 0 and output > 0:
                rows.append((_seconds(row["TIMESTAMP"], where), prompt, output))
            if limit is not None and len(rows) >= limit:
                break
    if not rows:
        raise ValueError(f"{path}: no requests")
    rows.sort()
    start = rows[0][0]
    return [Request(t - start, p, o) for t, p, o in rows]


def _count(row: dict, name: str, where: str) -> int:
    text = (row.get(name) or "").strip()
    try:
        value = int(text)
    except ValueError:
        raise ValueError(
            f"{where}: {name} must be a whole number of tokens, got {text!r}"
        ) from None
    if value < 0:
        raise ValueError(f"{where}: {name} must be >= 0, got {value}")
    return value


def _seconds(timestamp: str | None, where: str) -> float:
    """Seconds (a number) or a date and time; ``ValueError`` naming ``where`` otherwise."""
    try:
        return _parse_seconds(timestamp or "")
    except ValueError:
        raise ValueError(
            f"{where}: TIMESTAMP {timestamp!r} is neither seconds nor a date"
        ) from None


def _parse_seconds(timestamp: str) -> float:
    try:
        seconds = float(timestamp)
    except ValueError:
        pass
    else:
        if not math.isfinite(seconds) or seconds < 0:
            raise ValueError(timestamp)
        return seconds
    # "2023-11-16 18:15:46.6805900": more than 6 fractional digits is not ISO to Python; the
    # 2024 trace adds a UTC offset ("2024-05-10 00:00:00.009930+00:00").
    text, zone = timestamp.strip(), ""
    offset = re.search(r"(Z|[+-]\d\d:?\d\d)$", text)
    if offset:
        text, zone = text[: offset.start()], offset.group(1).replace("Z", "+00:00")
    date, _, fraction = text.partition(".")
    base = datetime.fromisoformat(date + zone).timestamp()
    return base + (float("0." + fraction) if fraction else 0.0)


def synthetic(
    num_requests: int,
    input_len: tuple[int, int] = (100, 1024),
    output_len: tuple[int, int] = (100, 1024),
    rate: float | None = None,
    seed: int = 0,
    num_prefixes: int = 0,
    prefix_len: int = 0,
) -> list[Request]:
    """Lengths uniform in the given inclusive ranges; all at t=0 (rate None) or Poisson
    arrivals at ``rate`` requests/s; with ``num_prefixes`` groups each sharing its first
    ``prefix_len`` prompt tokens (requests pick a group at random)."""
    if num_requests < 1:
        raise ValueError("num_requests must be >= 1")
    for name, (lo, hi) in (("input_len", input_len), ("output_len", output_len)):
        if not 1 <= lo <= hi:
            raise ValueError(f"{name} must be a range 1 <= lo <= hi, got {(lo, hi)}")
    if rate is not None and rate <= 0:
        raise ValueError(f"rate must be > 0 requests/s, got {rate}")
    if num_prefixes and not 0 < prefix_len <= input_len[0]:
        raise ValueError(f"prefix_len must be in [1, {input_len[0]}] (the shortest prompt)")
    rng = random.Random(seed)
    now, requests = 0.0, []
    for _ in range(num_requests):
        if rate is not None:
            now += rng.expovariate(rate)
        group = rng.randrange(num_prefixes) if num_prefixes else -1
        requests.append(
            Request(
                now,
                rng.randint(*input_len),
                rng.randint(*output_len),
                group,
                prefix_len if num_prefixes else 0,
            )
        )
    return requests


def nano_vllm_bench(
    num_requests: int = 256, max_input_len: int = 1024, max_output_len: int = 1024, seed: int = 0
) -> list[Request]:
    """nano-vllm's bench.py workload, drawn in the same order from the same generator: random
    prompts of 100..max_input_len token ids below 10,000, then output lengths 100..max_output_len,
    all arriving at t=0 (seed 0 gives 133,966 output tokens)."""
    rng = random.Random(seed)
    prompts = [
        tuple(rng.randint(0, 10_000) for _ in range(rng.randint(100, max_input_len)))
        for _ in range(num_requests)
    ]
    outputs = [rng.randint(100, max_output_len) for _ in range(num_requests)]
    return [Request(0.0, len(p), o, prompt_token_ids=p) for p, o in zip(prompts, outputs)]


def scale_arrivals(requests: list[Request], factor: float) -> list[Request]:
    """The same requests arriving ``factor`` times faster (factor 2 doubles the rate)."""
    if factor <= 0:
        raise ValueError(f"the rate factor must be > 0, got {factor}")
    return [replace(r, arrival_time=r.arrival_time / factor) for r in requests]
