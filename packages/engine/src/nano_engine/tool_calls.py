"""Tool calls in a chat reply: where the model writes them (the formats below), how they are read
from a whole reply or from one that is still streaming, and the JSON schemas that make a model
write them (``tool_choice`` required or a named function).

Formats: ``hermes`` (``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, as Qwen
writes them), ``llama3_json`` (a JSON object ``{"name": ..., "parameters": {...}}``, several
joined by ``;``, after an optional ``<|python_tag|>``), and the two a grammar imposes: a named
function's arguments alone, and a JSON array of ``{"name", "parameters"}``. A reply that does
not parse is content, never an error. Partial JSON is read with partial-json-parser.
"""

from __future__ import annotations

import json
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass

# (name, arguments) as far as the text holds them: None where not there yet
Call = tuple[str | None, dict | None]


def _partial(text: str):
    """The complete values of a partial JSON text (an unfinished string or number left out);
    None when nothing parses yet."""
    from partial_json_parser import Allow, loads

    if not text.strip():
        return None
    try:
        return loads(text, Allow.ALL & ~Allow.STR & ~Allow.NUM)
    except Exception:  # (partial-json-parser raises several kinds for text it cannot read)
        return None


def _whole(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return None


class ToolFormat(ABC):
    """How a reply holds its tool calls."""

    @abstractmethod
    def split(self, text: str, final: bool) -> tuple[str, str | None]:
        """(content, the text of the calls or None): the content held back where the text may
        still turn into a call."""

    @abstractmethod
    def calls(self, text: str, final: bool) -> list[Call] | None:
        """The calls in the calls' text (partial unless ``final``); None if it is not calls."""

    def parse(self, text: str) -> tuple[str | None, list[tuple[str, dict]]]:
        """(content, calls) of a whole reply; a reply whose calls do not parse is content."""
        content, calls_text = self.split(text, final=True)
        calls = self.calls(calls_text, final=True) if calls_text is not None else None
        if not calls or any(name is None or args is None for name, args in calls):
            return (text or None), []
        return (content or None), calls


class Hermes(ToolFormat):
    """Qwen's ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, content before."""

    start, end = "<tool_call>", "</tool_call>"

    def split(self, text, final):
        i = text.find(self.start)
        if i >= 0:
            return text[:i], text[i:]
        keep = 0 if final else _partial_suffix(text, self.start)
        return text[: len(text) - keep], None

    def calls(self, text, final):
        calls = []
        for block in text.split(self.start)[1:]:
            body, closed = block, self.end in block
            if closed:
                body = block[: block.index(self.end)]
            value = _whole(body) if closed or final else _partial(body)
            if not isinstance(value, dict) and (closed or final):
                return None
            calls.append(_call(value, "arguments"))
        return calls


class Llama3Json(ToolFormat):
    """Llama 3.x's ``{"name": ..., "parameters": {...}}``, ``;``-joined, after an optional
    ``<|python_tag|>``; a reply that does not start so is content."""

    tag = "<|python_tag|>"

    def split(self, text, final):
        stripped = text.lstrip()
        if stripped.startswith(self.tag):
            return "", stripped[len(self.tag) :]
        if stripped.startswith("{"):
            return "", stripped
        if not final and (not stripped or self.tag.startswith(stripped)):
            return "", None  # (held: it may still be a call)
        return text, None

    def calls(self, text, final):
        calls = []
        for part in _split_top_level(text, ";"):
            value = _whole(part) if final else _partial(part)
            if final and not isinstance(value, dict):
                return None
            calls.append(_call(value, "parameters", "arguments"))
        return calls


class Named(ToolFormat):
    """The reply is the named function's arguments (a grammar makes it so)."""

    def __init__(self, name: str) -> None:
        self.name = name

    def split(self, text, final):
        return "", text

    def calls(self, text, final):
        value = _whole(text) if final else _partial(text)
        return [(self.name, value if isinstance(value, dict) else None)]


class Required(ToolFormat):
    """The reply is a JSON array of {"name", "parameters"} (a grammar makes it so)."""

    def split(self, text, final):
        return "", text

    def calls(self, text, final):
        value = _whole(text) if final else _partial(text)
        if not isinstance(value, list):
            return None if final else []
        return [_call(item, "parameters") for item in value]


def _call(value, *keys: str) -> Call:
    if not isinstance(value, dict):
        return None, None
    name = value.get("name") if isinstance(value.get("name"), str) else None
    args = next((value[k] for k in keys if isinstance(value.get(k), dict)), None)
    return name, args


def _split_top_level(text: str, sep: str) -> list[str]:
    """``text`` cut at the ``sep`` outside JSON strings and brackets."""
    parts, depth, start, in_string, escaped = [], 0, 0, False, False
    for i, ch in enumerate(text):
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
        elif ch == sep and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return [p for p in parts if p.strip()]


def _partial_suffix(text: str, tag: str) -> int:
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


FORMATS: dict[str, type[ToolFormat]] = {"hermes": Hermes, "llama3_json": Llama3Json}


def get_tool_parser(name: str) -> ToolFormat:
    """The format of ``--tool-call-parser`` ``name`` (ValueError for an unknown one)."""
    if name not in FORMATS:
        raise ValueError(f"unknown tool call parser {name!r}; known: {', '.join(sorted(FORMATS))}")
    return FORMATS[name]()


def call_id() -> str:
    """A fresh tool call id."""
    return f"call_{uuid.uuid4().hex[:24]}"


def arguments_text(args: dict) -> str:
    """A call's arguments as the JSON text OpenAI's ``arguments`` holds."""
    return json.dumps(args, ensure_ascii=False)


@dataclass
class _Sent:
    id: str
    name: str
    arguments: str = ""


class ToolCallStream:
    """A streamed reply's deltas in OpenAI's form: ``feed`` returns (content delta, tool call
    deltas); each call's first delta has its id, type and name, the next ones pieces of its
    arguments, which concatenate to the arguments of the whole reply (a piece goes out only
    once nothing later can change it)."""

    def __init__(self, fmt: ToolFormat) -> None:
        self.fmt = fmt
        self.text = ""
        self._content = 0  # content characters sent
        self.sent: list[_Sent] = []

    def feed(self, delta: str, final: bool = False) -> tuple[str, list[dict]]:
        self.text += delta
        if final and not self.sent:  # (what did not parse is content, as in ``parse``)
            whole, calls = self.fmt.parse(self.text)
            if not calls:
                rest = (whole or "")[self._content :]
                self._content += len(rest)
                return rest, []
        content, calls_text = self.fmt.split(self.text, final)
        out_content = content[self._content :] if len(content) > self._content else ""
        self._content = max(self._content, len(content))
        deltas: list[dict] = []
        if calls_text is None:
            return out_content, deltas
        calls = self.fmt.calls(calls_text, final) or []
        for index, (name, args) in enumerate(calls):
            if index == len(self.sent):
                if name is None:
                    break
                self.sent.append(_Sent(call_id(), name))
                deltas.append(
                    {
                        "index": index,
                        "id": self.sent[index].id,
                        "type": "function",
                        "function": {"name": name, "arguments": ""},
                    }
                )
            if args is None:
                continue
            whole = arguments_text(args)
            stable = whole if final else whole.rstrip('"}] ')
            sent = self.sent[index].arguments
            if len(stable) > len(sent) and stable.startswith(sent):
                piece = stable[len(sent) :]
                self.sent[index].arguments = stable
                deltas.append({"index": index, "function": {"arguments": piece}})
        return out_content, deltas


def required_schema(tools: list[dict], parallel: bool) -> dict:
    """The JSON schema of a reply that calls one or more of ``tools`` (OpenAI's function
    definitions): an array of {"name", "parameters"}."""
    items = [
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "enum": [t["function"]["name"]]},
                "parameters": t["function"].get("parameters") or {"type": "object"},
            },
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for t in tools
    ]
    schema = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
    if not parallel:
        schema["maxItems"] = 1
    return schema
