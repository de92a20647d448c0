"""Structured outputs on xgrammar: a request's constraint compiled into a grammar over the
tokenizer's vocabulary (on the caller's thread, once per distinct constraint: xgrammar caches
them), a matcher per sequence that follows its sampled tokens, and for each step the bitmask of
the tokens each constrained row may take, filled on the host and applied to the logits before
sampling. xgrammar is an optional dependency (``nano-engine[structured]``), imported when the
first constrained request comes; torch when a bitmask is made (or xgrammar, which imports it),
not when this module is: the server's front imports it and serves the rest without torch."""

from __future__ import annotations

import os
import re
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

from nano_scheduler import StructuredOutputsParams

# xgrammar (0.2.8) lets a JSON string with a length bound hold raw control characters, which
# JSON forbids (json.loads refuses them), and any string hold UTF-8-encoded surrogates, which
# are no characters (decoded, one becomes three U+FFFD: past a maxLength): its character
# classes of JSON strings, and ours without those.
_STRING_CHARS = {
    r"[^\"\\\r\n]": r"[^\0-\x1f\"\\\ud800-\udfff]",
    r"[^\0-\x1f\"\\\r\n]": r"[^\0-\x1f\"\\\r\n\ud800-\udfff]",
}
_LOCATION = re.compile(r"^\s*\[[\d:]+\]\s*\S+:\d+:\s*")  # xgrammar's "[time] file.cc:line: "


# the compiled grammars xgrammar keeps for reuse (as vLLM's default)
CACHE_LIMIT_BYTES = 512 << 20
# xgrammar's threads for a bitmask (it starts them for each fill): on the H200 host (16 cores),
# 64 sequences inside JSON strings, 4 gave the best constrained decoding of 4, 8 (its default,
# half the cores) and 12 (benchmarks/RESULTS.md, issue 21); more threads slowed the loop beside.
FILL_THREADS = max(1, min(4, (os.cpu_count() or 2) // 2))


class StructuredOutputsUnavailable(ValueError):
    """xgrammar is not installed: the engine's setup, not the request, is at fault."""


def _xgrammar():
    try:
        import xgrammar
    except ImportError:
        raise StructuredOutputsUnavailable(
            "structured outputs need xgrammar: pip install 'nano-engine[structured]'"
        ) from None
    return xgrammar


class GrammarCompiler:
    """Compiles constraints for one tokenizer; thread-safe (requests are made on any thread)."""

    def __init__(self, tokenizer: object, vocab_size: int, stop_token_ids: list[int]) -> None:
        """``vocab_size``: the width of the model's logits (may exceed the tokenizer's);
        ``stop_token_ids``: the tokens that end a sequence whose grammar is complete."""
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self.stop_token_ids = list(stop_token_ids)
        self._compiler = None
        self._lock = threading.Lock()

    def _get(self):
        with self._lock:
            if self._compiler is None:
                if self.tokenizer is None:
                    raise ValueError(
                        "structured outputs need the tokenizer (the engine runs without one)"
                    )
                xgr = _xgrammar()
                info = xgr.TokenizerInfo.from_huggingface(
                    self.tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids
                )
                self._compiler = xgr.GrammarCompiler(info, cache_limit_bytes=CACHE_LIMIT_BYTES)
            return self._compiler

    def compile(self, so: StructuredOutputsParams) -> object:
        """The compiled grammar of a constraint; ValueError naming what xgrammar refused."""
        compiler = self._get()
        kind = so.kind
        try:
            if kind in ("json", "json_object"):
                schema = so.json if kind == "json" else '{"type": "object"}'
                grammar = _xgrammar().Grammar.from_json_schema(
                    schema,
                    any_whitespace=not so.disable_any_whitespace,
                    strict_mode=kind == "json",
                )
                text = str(grammar)
                for theirs, ours in _STRING_CHARS.items():
                    text = text.replace(theirs, ours)
                return compiler.compile_grammar(text)
            if kind == "regex":
                return compiler.compile_regex(so.regex)
            if kind == "choice":
                return compiler.compile_grammar(choice_grammar(so.choice))
            return compiler.compile_grammar(so.grammar)
        except (RuntimeError, ValueError, TypeError) as e:
            message = _LOCATION.sub("", str(e)).strip()
            raise ValueError(
                f"structured outputs: xgrammar cannot compile the {kind}: {message}"
            ) from None

    def matcher(self, grammar: object) -> object:
        """A new matcher at the grammar's start (one per sequence)."""
        return _xgrammar().GrammarMatcher(grammar)


def choice_grammar(choices: tuple[str, ...]) -> str:
    """An EBNF grammar whose sentences are exactly ``choices``."""
    return "root ::= " + " | ".join(_ebnf_string(c) for c in choices)


def _ebnf_string(text: str) -> str:
    escaped = []
    for ch in text:
        if ch in '"\\':
            escaped.append("\\" + ch)
        elif ch.isprintable():
            escaped.append(ch)
        else:
            escaped.append(f"\\u{ord(ch):04x}" if ord(ch) < 0x10000 else f"\\U{ord(ch):08x}")
    return '"' + "".join(escaped) + '"'


REJECTED, ACCEPTED, ENDED = 0, 1, 2  # what a matcher did with its token (ENDED: took a stop)


class GrammarWork:
    """One step's grammar work, running in the background: the matchers take the step's
    tokens, then the bitmask of the next step's constrained rows fills (xgrammar's threads,
    the GIL released)."""

    def __init__(self) -> None:
        self.future: Future | None = None
        self.statuses: list[int] | None = None  # per matcher that took a token
        self.running = threading.Event()  # the work holds the GIL or is in xgrammar
        self.accepted = threading.Event()  # the tokens are taken (or the work failed)

    def statuses_of_tokens(self) -> list[int]:
        """REJECTED, ACCEPTED or ENDED per token, once taken (the bitmask may still fill)."""
        self.accepted.wait()
        if self.statuses is None:
            self.future.result()  # (raises what failed)
        return self.statuses

    def masks(self) -> tuple[torch.Tensor, list[int]] | None:
        """The next step's (bitmask [R, ceil(V / 32)] int32 on the host, its logits rows), or
        None when no row is constrained."""
        return self.future.result()


class TokenMasks:
    """Runs each step's ``GrammarWork`` on a thread of its own, while the loop records the
    step; ``to_device`` copies a bitmask to the device (from a reused pinned buffer on CUDA:
    the copy of the step before was done once its tokens were read, which comes before the
    next fill starts)."""

    def __init__(self, device: torch.device, vocab_size: int, stop_token_ids) -> None:
        self.device, self.vocab_size = device, vocab_size
        self.stop_token_ids = frozenset(stop_token_ids)  # (taking one ends a grammar)
        self._host: torch.Tensor | None = None
        self._batch = None
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="nano-engine-grammar")

    def start(
        self, moving: list, tokens: list[int], matchers: list, rows: list[int]
    ) -> GrammarWork:
        """In the background: each of ``moving`` takes its token, then the bitmask of what
        each of ``matchers`` (those of the next step's logits rows ``rows``) allows next
        fills, without those the tokens ended. No matcher may be used elsewhere until the
        work is done. Returns once the work runs: the thread needs the GIL to start, and a
        loop busy in Python would hold it for up to the interpreter's switch interval (5 ms)
        before handing it over; the same holds between the two parts of the work, so the
        loop waits for ``statuses_of_tokens`` before it goes on in Python for long."""
        if self._batch is None:
            self._batch = _xgrammar().BatchGrammarMatcher(FILL_THREADS)
        work = GrammarWork()
        accept = self._batch.batch_accept_token
        fill = self._batch.batch_fill_next_token_bitmask

        def run():
            try:
                work.running.set()
                taken = accept(moving, tokens) if moving else []
                stops = self.stop_token_ids
                work.statuses = [
                    REJECTED if not ok else ENDED if t in stops and m.is_terminated() else ACCEPTED
                    for m, t, ok in zip(moving, tokens, taken)
                ]
                ended = {id(m) for m, status in zip(moving, work.statuses) if status == ENDED}
                kept = [(m, r) for m, r in zip(matchers, rows) if id(m) not in ended]
                host = self._buffer(len(kept))
            finally:
                work.accepted.set()
            if not kept:
                return None
            try:
                fill([m for m, _ in kept], host)  # (the loop goes on once this releases the GIL)
            except RuntimeError:
                # xgrammar refuses to fill a matcher that has ended; the engine never asks
                # for one (an ended grammar finishes its sequence), but should it, that row
                # goes rather than the engine.
                kept = [(m, r) for m, r in kept if not m.is_terminated()]
                if not kept:
                    return None
                host = host[: len(kept)]
                fill([m for m, _ in kept], host)
            return host, [r for _, r in kept]

        work.future = self._pool.submit(run)
        work.running.wait()
        return work

    def _buffer(self, rows: int) -> torch.Tensor:
        import torch

        words = -(-self.vocab_size // 32)
        if self._host is None or self._host.shape[0] < rows:
            pin = self.device.type == "cuda"
            self._host = torch.empty((max(rows, 64), words), dtype=torch.int32, pin_memory=pin)
        return self._host[:rows]

    def to_device(
        self, masks: tuple[torch.Tensor, list[int]] | None
    ) -> tuple[torch.Tensor, list[int]] | None:
        """(bitmask on the device, rows) of ``GrammarWork.masks``."""
        if masks is None:
            return None
        host, rows = masks
        return host.to(self.device, non_blocking=True), rows

    def close(self) -> None:
        """Stop the grammar thread (at the engine's shutdown)."""
        self._pool.shutdown(wait=True)


def apply_masks(logits: torch.Tensor, masks: tuple[torch.Tensor, list[int]]) -> None:
    """Set the float32 logits [S, V] of the tokens the bitmask forbids to -inf, in place."""
    import torch

    bitmask, rows = masks
    # (xgrammar's ``indices`` index the bitmask by logits row too; ours holds the rows only)
    apply = _xgrammar().apply_token_bitmask_inplace
    if len(rows) == logits.shape[0]:  # (rows are in order: every row is constrained)
        apply(logits, bitmask)
        return
    index = torch.tensor(rows, device=logits.device)
    some = logits.index_select(0, index)
    apply(some, bitmask)
    logits.index_copy_(0, index, some)
