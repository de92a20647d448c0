"""A chat reply in OpenAI's shape: the model's text split into reasoning (with a reasoning
parser), content and tool calls (with a tool format), as a whole message or as stream deltas."""

from __future__ import annotations

from nano_engine.reasoning import ReasoningParser
from nano_engine.tool_calls import Named, ToolCallStream, ToolFormat, arguments_text, call_id


class ChatReply:
    """How one request's replies are read. ``opened``: its prompt leaves the model thinking."""

    def __init__(
        self, reasoning: ReasoningParser | None, opened: bool, tools: ToolFormat | None
    ) -> None:
        self.reasoning, self.opened, self.tools = reasoning, opened, tools

    def finish_reason(self, reason: str | None, called: bool) -> str | None:
        """OpenAI's: ``tool_calls`` when the model chose to call (not when a named function
        was imposed)."""
        if reason is not None and called and not isinstance(self.tools, Named):
            return "tool_calls"
        return reason

    def message(self, text: str) -> tuple[dict, bool]:
        """(the whole reply's message, whether it calls tools)."""
        message: dict = {"role": "assistant"}
        content: str | None = text
        if self.reasoning is not None:
            message["reasoning_content"], content = self.reasoning.split(text, self.opened)
        calls = []
        if self.tools is not None:
            content, calls = self.tools.parse(content or "")
        message["content"] = content
        if calls:
            message["tool_calls"] = [
                {
                    "id": call_id(),
                    "type": "function",
                    "function": {"name": name, "arguments": arguments_text(args)},
                }
                for name, args in calls
            ]
        return message, bool(calls)

    def stream(self) -> ChatReplyStream:
        """The deltas of one streamed choice."""
        return ChatReplyStream(self)


class ChatReplyStream:
    """One choice's deltas."""

    def __init__(self, reply: ChatReply) -> None:
        self.reasoning = reply.reasoning.stream(reply.opened) if reply.reasoning else None
        self.tools = ToolCallStream(reply.tools) if reply.tools is not None else None
        self.started = False

    def feed(self, text: str, final: bool) -> tuple[dict, bool]:
        """(the delta of this piece of text, whether the reply has called tools so far)."""
        delta: dict = {}
        if not self.started:
            self.started = True
            delta["role"] = "assistant"
        content = text
        if self.reasoning is not None:
            thought, content = self.reasoning.feed(text, final)
            if thought:
                delta["reasoning_content"] = thought
        if self.tools is not None:
            content, calls = self.tools.feed(content, final)
            if calls:
                delta["tool_calls"] = calls
        if content or len(delta) == (1 if "role" in delta else 0):
            delta["content"] = content
        return delta, bool(self.tools and self.tools.sent)
