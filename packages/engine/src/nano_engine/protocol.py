"""The OpenAI-compatible request bodies (pydantic), and their sampling parameters.

Every field of OpenAI's and vLLM's request schemas is honoured or refused: the fields below
are honoured; those in ``UNSUPPORTED`` are refused with a 400 that names them unless sent with
their neutral value (one that changes nothing); any other field is refused as unknown, as
OpenAI does. Every string must be valid Unicode (no lone surrogates).
"""

from __future__ import annotations

import contextlib
import json
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, model_validator

from nano_engine.tool_calls import required_schema
from nano_scheduler import SamplingParams, StructuredOutputsParams


class FieldError(ValueError):
    """A refused request field; ``param`` names it (a dotted path)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


# Fields of OpenAI's and vLLM's request schemas that this server does not implement, with the
# values that leave the output as it is (accepted and dropped).
UNSUPPORTED: dict[str, tuple] = {
    # OpenAI
    "suffix": (None, ""),
    "functions": (None, []),
    "function_call": (None, "none", "auto"),
    "audio": (None,),
    "modalities": (None, ["text"]),
    "prediction": (None,),
    "reasoning_effort": (None,),
    "verbosity": (None,),
    "web_search_options": (None,),
    "metadata": (None, {}),
    "store": (None, False),
    "service_tier": (None, "auto", "default"),
    # vLLM
    "use_beam_search": (None, False),
    "length_penalty": (None, 1.0, 1),
    "spaces_between_special_tokens": (None, True),
    "truncate_prompt_tokens": (None,),
    "logits_processors": (None, []),
    "return_tokens_as_token_ids": (None, False),
    "return_token_ids": (None, False),
    "cache_salt": (None,),
    "kv_transfer_params": (None,),
    "vllm_xargs": (None,),
    "priority": (None, 0),
    "guided_decoding_backend": (None, "auto", "xgrammar"),
    "guided_whitespace_pattern": (None,),
    "add_special_tokens": (None,),  # (each route's default only: see the routes)
    "continue_final_message": (None, False),
    "documents": (None,),
    "chat_template": (None,),
    "mm_processor_kwargs": (None,),
    "media_io_kwargs": (None,),
    "prompt_embeds": (None,),
}

# Message fields the chat template is not given: accepted when null (a message sent back as the
# openai client serializes it), refused otherwise.
UNSUPPORTED_MESSAGE: dict[str, tuple] = {
    name: (None,) for name in ("function_call", "refusal", "audio", "annotations")
}


def _neutral(value: Any, allowed: tuple) -> bool:
    return any(type(value) is type(v) and value == v for v in allowed if v is not None) or (
        value is None
    )


def _check_text(value: Any, path: str) -> None:
    """FieldError for the first string (or key) under ``value`` that is not valid Unicode."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            raise FieldError(
                path or "body",
                f"{path or 'the body'} is not valid Unicode (a lone surrogate at index "
                f"{e.start}): send UTF-8 text",
            ) from None
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_text(key, path)
            _check_text(item, f"{path}.{key}" if path else str(key))
    elif isinstance(value, list) and not all(type(x) is int for x in value):
        for i, item in enumerate(value):
            _check_text(item, f"{path}.{i}")


def _known_fields(model: type[BaseModel], data: Any, unsupported: dict[str, tuple]) -> Any:
    """``data`` without the unsupported fields sent with their neutral values; FieldError for a
    field that is unsupported or unknown."""
    if not isinstance(data, dict):
        return data
    kept = {}
    names = {field.alias or name for name, field in model.model_fields.items()}
    for name, value in data.items():
        if name in names:
            kept[name] = value
        elif name in unsupported:
            if not _neutral(value, unsupported[name]):
                raise FieldError(
                    name,
                    f"{name} is not supported by this server (only its default, "
                    f"{unsupported[name][-1]!r}, is accepted)",
                )
        else:
            raise FieldError(name, f"unknown field {name!r}")
    return kept


class _Body(BaseModel):
    """A request body: valid Unicode throughout; every field known."""

    model_config = ConfigDict(extra="forbid")
    unsupported: ClassVar[dict[str, tuple]] = {}

    @model_validator(mode="before")
    @classmethod
    def _valid(cls, data: Any) -> Any:
        _check_text(data, "")
        return _known_fields(cls, data, cls.unsupported)


class StreamOptions(_Body):
    include_usage: bool = False
    unsupported = {"continuous_usage_stats": (None, False)}


class JSONSchemaFormat(_Body):
    """OpenAI's ``response_format.json_schema``."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    """OpenAI's ``response_format``: plain text, any JSON object, or JSON of a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self):
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise FieldError(
                "json_schema",
                "response_format.json_schema is needed with type json_schema, and only then",
            )
        return self


class StructuredOutputsBody(_Body):
    """vLLM's ``structured_outputs`` extra (one kind of constraint)."""

    json_: str | dict | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    unsupported = {
        "structural_tag": (None,),
        "disable_fallback": (None, False),
        "disable_additional_properties": (None, False),
        "whitespace_pattern": (None,),
        "backend": (None, "auto", "xgrammar"),
    }


class _Sampling(_Body):
    """Fields shared by completions and chat completions, vLLM's extras included."""

    unsupported = UNSUPPORTED

    model: str
    n: int = Field(default=1, ge=1, le=128)  # (OpenAI's bound)
    best_of: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # identifiers of the caller: accepted, not used
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None  # (the prefix cache needs no key)
    request_id: str | None = Field(default=None, min_length=1, max_length=256)
    # vLLM's extra sampling fields
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    prompt_logprobs: int | None = Field(default=None, ge=0, le=20)
    logit_bias: dict[str, float] | None = None  # (OpenAI's: token ids as JSON keys)
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    # a constraint on the output: OpenAI's, vLLM's, or vLLM's deprecated aliases
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsBody | None = None
    guided_json: str | dict | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    @model_validator(mode="after")
    def _best_of(self):
        if self.best_of is not None and self.best_of != self.n:
            raise FieldError("best_of", "best_of is not supported (other than best_of = n)")
        return self

    @property
    def structured_field(self) -> str | None:
        """The field that carries the output's constraint (None: unconstrained)."""
        given = [
            name for name in ("structured_outputs", *_GUIDED) if getattr(self, name) is not None
        ]
        if self.response_format is not None and self.response_format.type != "text":
            given.insert(0, "response_format")
        if len(given) > 1:
            raise FieldError(given[1], f"give one constraint on the output, got {given}")
        return given[0] if given else None

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        """The output's constraint (FieldError naming the field for an invalid one)."""
        field = self.structured_field
        try:
            if field is None:
                return None
            if field == "response_format":
                fmt = self.response_format
                if fmt.type == "json_object" or fmt.json_schema.schema_ is None:
                    return StructuredOutputsParams(json_object=True)
                return StructuredOutputsParams(json=fmt.json_schema.schema_)
            if field == "structured_outputs":
                so = self.structured_outputs
                return StructuredOutputsParams(
                    json=so.json_,
                    regex=so.regex,
                    choice=so.choice,
                    grammar=so.grammar,
                    json_object=so.json_object,
                    disable_any_whitespace=so.disable_any_whitespace,
                )
            return StructuredOutputsParams(**{_GUIDED[field]: getattr(self, field)})
        except ValueError as e:
            raise FieldError(field, str(e)) from None

    def sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        """ValueError with the parameter's name for an invalid value."""
        return SamplingParams(
            n=self.n,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            repetition_penalty=self.repetition_penalty,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            seed=self.seed,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            prompt_logprobs=self._prompt_logprobs(logprobs),
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            structured_outputs=self.structured_outputs_params(),
            logit_bias=self._logit_bias(),
            allowed_token_ids=self.allowed_token_ids,
            bad_words=self.bad_words,
        )

    def _prompt_logprobs(self, logprobs: int | None) -> int | None:
        """vLLM's prompt_logprobs; echo with logprobs needs the prompt's too."""
        if getattr(self, "echo", False) and logprobs is not None:
            return max(logprobs, self.prompt_logprobs or 0)
        return self.prompt_logprobs

    def _logit_bias(self) -> dict[int, float] | None:
        if self.logit_bias is None:
            return None
        try:
            return {int(k): v for k, v in self.logit_bias.items()}
        except ValueError:
            raise FieldError(
                "logit_bias", f"logit_bias keys must be token ids, got {list(self.logit_bias)}"
            ) from None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


_GUIDED = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}


def _prompt_kind(value: Any) -> str | None:
    """Which form a completion's prompt takes, by its first item: each is validated as that
    form alone (a plain union tried every form and made an error object for each token of a
    token-id prompt in the others: ~1 ms for 600 tokens, 20x the rest of the body)."""
    if isinstance(value, str):
        return "str"
    if not isinstance(value, (list, tuple)):
        return None
    if not value or isinstance(value[0], str):
        return "list[str]"  # (an empty list: no prompt, as the plain union read it)
    first = value[0]
    return "list[tuple[int, ...]]" if isinstance(first, (list, tuple)) else "tuple[int, ...]"


# The forms' tags: in a validation error's location after the field (not part of its path).
PROMPT_FORMS = ("str", "list[str]", "tuple[int, ...]", "list[tuple[int, ...]]")

# (token ids as tuples: a server holds each prompt for its request's life, and Python's
# cyclic collector walks every item of a list on each full run, not a tuple of ints)
Prompt = Annotated[
    Annotated[str, Tag(PROMPT_FORMS[0])]
    | Annotated[list[str], Tag(PROMPT_FORMS[1])]
    | Annotated[tuple[int, ...], Tag(PROMPT_FORMS[2])]
    | Annotated[list[tuple[int, ...]], Tag(PROMPT_FORMS[3])],
    Discriminator(
        _prompt_kind,
        custom_error_type="prompt_type",
        custom_error_message="the prompt must be a string, a list of strings, a list of token "
        "ids or a list of lists of token ids",
    ),
]


class CompletionRequest(_Sampling):
    unsupported = {**UNSUPPORTED, "add_special_tokens": (None, True)}

    prompt: Prompt
    max_tokens: int | None = 16
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False

    def prompts(self) -> list[str | tuple[int, ...]]:
        p = self.prompt
        return [p] if isinstance(p, (str, tuple)) else list(p)


class ContentPart(_Body):
    type: Literal["text"]  # (images and audio are not supported)
    text: str


class FunctionCallBody(_Body):
    name: str
    arguments: str


class ToolCallBody(_Body):
    """A call an assistant message made (sent back in the history)."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCallBody


class ChatMessage(_Body):
    unsupported = UNSUPPORTED_MESSAGE

    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallBody] | None = None
    tool_call_id: str | None = None

    def template_dict(self) -> dict:
        """The message for the chat template: text parts joined by newlines (as vLLM does),
        a tool call's arguments as an object where they are JSON (templates write them)."""
        message = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            message["content"] = "\n".join(part.text for part in self.content)
        for call in message.get("tool_calls", ()):
            with contextlib.suppress(ValueError):
                arguments = json.loads(call["function"]["arguments"])
                if isinstance(arguments, dict):
                    call["function"]["arguments"] = arguments
        return message


class FunctionDefinition(_Body):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDefinition(_Body):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_Sampling):
    unsupported = {**UNSUPPORTED, "add_special_tokens": (None, False)}

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None

    @model_validator(mode="after")
    def _tool_choice_names_a_tool(self):
        names = [t.function.name for t in self.tools or ()]
        if len(set(names)) < len(names):
            raise FieldError("tools", f"tools holds a function name twice: {names}")
        choice = self.tool_choice
        if choice not in (None, "none") and not self.tools:
            raise FieldError("tool_choice", "tool_choice needs tools")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise FieldError(
                "tool_choice",
                f"tool_choice names the function {choice.function.name!r}, which is not among "
                f"tools ({names})",
            )
        return self

    @property
    def forced_tools(self) -> str | None:
        """ "required" or the named function when tool_choice makes the reply a call."""
        choice = self.tool_choice
        if isinstance(choice, NamedToolChoice):
            return choice.function.name
        return "required" if choice == "required" else None

    @property
    def structured_field(self) -> str | None:
        field = super().structured_field
        if self.forced_tools is None:
            return field
        if field is not None:
            raise FieldError(
                field, f"{field} cannot be combined with tool_choice {self.forced_tools!r}"
            )
        return "tools"

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        if self.structured_field != "tools":
            return super().structured_outputs_params()
        forced = self.forced_tools
        tools = [t.model_dump(exclude_none=True) for t in self.tools]
        if forced == "required":
            schema = required_schema(tools, self.parallel_tool_calls is not False)
        else:
            tool = next(t for t in tools if t["function"]["name"] == forced)
            schema = tool["function"].get("parameters") or {"type": "object"}
        try:  # (compact: the arguments are written out again anyway)
            return StructuredOutputsParams(json=schema, disable_any_whitespace=True)
        except ValueError as e:
            raise FieldError("tools", str(e)) from None

    @property
    def max_new_tokens(self) -> int | None:
        return (
            self.max_completion_tokens
            if self.max_completion_tokens is not None
            else (self.max_tokens)
        )

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise FieldError("top_logprobs", "top_logprobs needs logprobs set to true")
        return self

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class TokenizeRequest(_Body):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    tools: list[ToolDefinition] | None = None  # (with messages: as a chat renders them)
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[int]
