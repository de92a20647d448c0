"""Reasoning parsers: a model's thinking, written between a start and an end tag (``<think>``
and ``</think>`` for Qwen3 and DeepSeek-R1), split from its answer, whole or as it streams
(vLLM's ``--reasoning-parser``: the thinking goes to ``reasoning_content``)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ReasoningParser:
    """A model's thinking between ``start`` and ``end`` tags."""

    name: str
    start: str
    end: str

    def opened_in(self, prompt: str) -> bool:
        """Whether the prompt leaves the model thinking (a template that writes the start tag
        itself): its last start tag after its last end tag."""
        return prompt.rfind(self.start) > prompt.rfind(self.end)

    def stream(self, opened: bool = False) -> ReasoningStream:
        """A splitter of one streamed output (``opened``: the prompt left the model thinking)."""
        return ReasoningStream(self, opened)

    def split(self, text: str, opened: bool = False) -> tuple[str | None, str | None]:
        """(reasoning, content) of a whole output; None for a part it lacks."""
        stream = self.stream(opened)
        reasoning, content = stream.feed(text, final=True)
        return (reasoning if stream.thought else None), (content or None)


_BEGIN, _THINKING, _ANSWER = range(3)


class ReasoningStream:
    """Splits an output's text deltas: ``feed`` returns (reasoning delta, content delta),
    holding back the text that may still be the start of a tag."""

    def __init__(self, parser: ReasoningParser, opened: bool) -> None:
        self.parser = parser
        self.state = _THINKING if opened else _BEGIN
        self.thought = opened  # whether there was a reasoning part
        self._held = ""

    def feed(self, delta: str, final: bool = False) -> tuple[str, str]:
        text, self._held = self._held + delta, ""
        reasoning = content = ""
        start, end = self.parser.start, self.parser.end
        while text:
            if self.state == _BEGIN:
                if text.startswith(start):
                    self.state, self.thought = _THINKING, True
                    text = text[len(start) :]
                elif start.startswith(text) and not final:
                    self._held = text
                    break
                else:
                    self.state = _ANSWER
            elif self.state == _THINKING:
                i = text.find(end)
                if i >= 0:
                    reasoning += text[:i]
                    text = text[i + len(end) :]
                    self.state = _ANSWER
                    continue
                keep = 0 if final else _partial_suffix(text, end)
                reasoning += text[: len(text) - keep]
                self._held = text[len(text) - keep :]
                break
            else:
                content += text
                break
        return reasoning, content


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of ``text`` that begins ``tag``."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


PARSERS = {
    "qwen3": ReasoningParser("qwen3", "<think>", "</think>"),
    "deepseek_r1": ReasoningParser("deepseek_r1", "<think>", "</think>"),
}


def get_reasoning_parser(name: str) -> ReasoningParser:
    """The parser of ``--reasoning-parser`` ``name`` (ValueError for an unknown one)."""
    if name not in PARSERS:
        raise ValueError(f"unknown reasoning parser {name!r}; known: {', '.join(sorted(PARSERS))}")
    return PARSERS[name]
