"""Structured outputs on xgrammar: a request's constraint compiled into a grammar over the
tokenizer's vocabulary (on the caller's thread, once per distinct constraint: xgrammar caches
them), a matcher per sequence that follows its sampled tokens, and for each step the bitmask of
the tokens each constrained row may take, filled on the host and applied to the logits before
sampling. xgrammar is an optional dependency (``nano-engine[structured]``), imported when the
first constrained request comes."""

from __future__ import annotations

import re
import threading
from concurrent.futures import Future, ThreadPoolExecutor

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


class TokenMasks:
    """The bitmask of a step's constrained rows, filled on the host by xgrammar's threads (the
    GIL released) in the background, while the loop records the step before; ``result``
    copies it to the device (from a reused pinned buffer on CUDA: the copy of the step before
    was done once its tokens were read, which comes before the next fill starts)."""

    def __init__(self, device: torch.device, vocab_size: int) -> None:
        self.device, self.vocab_size = device, vocab_size
        self._host: torch.Tensor | None = None
        self._batch = None
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="nano-engine-grammar")

    def start(self, matchers: list, rows: list[int]) -> Future:
        """Fill, in the background, the tokens each matcher allows next (for the logits rows
        ``rows``); no matcher may change until ``result``."""
        if self._batch is None:
            self._batch = _xgrammar().BatchGrammarMatcher()
        words = -(-self.vocab_size // 32)
        if self._host is None or self._host.shape[0] < len(rows):
            size = max(len(rows), 64)
            pin = self.device.type == "cuda"
            self._host = torch.empty((size, words), dtype=torch.int32, pin_memory=pin)
        host = self._host[: len(rows)]
        fill = self._batch.batch_fill_next_token_bitmask
        return self._pool.submit(lambda: (fill(matchers, host), (host, rows))[1])

    def result(self, pending: Future) -> tuple[torch.Tensor, list[int]]:
        """(bitmask [R, ceil(V / 32)] int32 on the device, rows) of a ``start``."""
        host, rows = pending.result()
        return host.to(self.device, non_blocking=True), rows

    def close(self) -> None:
        """Stop the fill thread (at the engine's shutdown)."""
        self._pool.shutdown(wait=True)


def apply_masks(logits: torch.Tensor, masks: tuple[torch.Tensor, list[int]]) -> None:
    """Set the float32 logits [S, V] of the tokens the bitmask forbids to -inf, in place."""
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
