"""LLM: the offline API (``generate``, ``chat``) over the threaded engine."""

from __future__ import annotations

import queue
import time
from collections.abc import Sequence as SequenceABC

from nano_engine.config import EngineConfig
from nano_engine.data_parallel import start_engine
from nano_engine.outputs import CompletionOutput, RequestOutput
from nano_engine.streams import RequestStream
from nano_scheduler import SamplingParams


class LLM:
    """``LLM(model, **config)``: see ``EngineConfig`` for the options.

    >>> llm = LLM("path/to/Qwen3-0.6B")
    >>> llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=16))[0].outputs[0].text
    """

    def __init__(self, model: str, **config) -> None:
        self.config = EngineConfig.from_kwargs(model, **config)
        self.engine = start_engine(self.config)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: str | list[int] | SequenceABC[str | list[int]],
        sampling_params: SamplingParams | SequenceABC[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Complete every prompt (strings or token-id lists); outputs in input order. Every
        request is validated before any runs: bad input raises and nothing is queued."""
        return self._generate(prompts, sampling_params, use_tqdm, reasoning=False)

    def _generate(
        self, prompts, sampling_params, use_tqdm: bool, reasoning: bool
    ) -> list[RequestOutput]:
        prompts = _prompt_list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompts)
        elif isinstance(sampling_params, (list, tuple)) and all(
            isinstance(p, SamplingParams) for p in sampling_params
        ):
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts")
        else:
            raise TypeError(
                "sampling_params must be a SamplingParams, a list of them (one per prompt) or "
                f"None, got {_describe(sampling_params)}"
            )
        ready: queue.SimpleQueue[RequestStream] = queue.SimpleQueue()
        requests = [
            self.engine.make_request(
                p, sp, notify=ready.put, stream_deltas=False, reasoning=reasoning
            )
            for p, sp in zip(prompts, params)
        ]
        order = {r.request_id: i for i, r in enumerate(requests)}
        self.engine.submit(requests)
        results: list[RequestOutput | None] = [None] * len(requests)
        bar = _progress(len(requests)) if use_tqdm else None
        start, generated, remaining = time.perf_counter(), 0, len(requests)
        try:
            while remaining:
                stream = ready.get()
                while (delta := stream.get_nowait()) is not None:
                    i = order[delta.request_id]
                    results[i] = merge_outputs(results[i], delta)
                    generated += sum(len(o.token_ids) for o in delta.outputs)
                    if delta.finished:
                        remaining -= 1
                        if bar is not None:
                            bar.set_postfix_str(
                                f"{generated / (time.perf_counter() - start):,.0f} tok/s",
                                refresh=False,
                            )
                            bar.update(1)
        except BaseException:
            for r in requests:
                self.engine.abort(r.request_id)
            raise
        finally:
            if bar is not None:
                bar.close()
        return results

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | SequenceABC[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict | None = None,
        tools: list[dict] | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them, through the tokenizer's
        chat template (``chat_template_kwargs`` go to it, e.g. ``{"enable_thinking": False}``;
        ``tools``, OpenAI's function definitions, too). With a reasoning parser, a structured
        output's constraint applies once the reasoning has ended."""
        if self.tokenizer is None:
            raise ValueError("chat needs a tokenizer (skip_tokenizer_init is set)")
        conversations = _conversations(messages)
        prompts = []
        for i, conversation in enumerate(conversations):
            try:
                text = self.tokenizer.apply_chat_template(
                    conversation,
                    tokenize=False,
                    add_generation_prompt=add_generation_prompt,
                    tools=tools,
                    **template_kwargs(chat_template_kwargs),
                )
            except Exception as e:  # (jinja and transformers raise many kinds)
                raise ValueError(f"the chat template failed on conversation {i}: {e}") from e
            prompts.append(self.tokenizer(text, add_special_tokens=False).input_ids)
        return self._generate(prompts, sampling_params, use_tqdm, reasoning=True)

    def reset_prefix_cache(self) -> int:
        """Forget the cached prompt blocks no request holds; returns how many."""
        return self.engine.reset_prefix_cache()

    def shutdown(self) -> None:
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


# apply_chat_template's own arguments: not for chat_template_kwargs to set
_TEMPLATE_ARGS = (
    "conversation",
    "tokenize",
    "add_generation_prompt",
    "return_dict",
    "tools",
    "chat_template",
    "continue_final_message",
    "documents",
)


def template_kwargs(kwargs: dict | None) -> dict:
    """Extra variables for a chat template (ValueError for one that is not a variable)."""
    if kwargs is None:
        return {}
    if not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
        raise ValueError(f"chat_template_kwargs must be a dict of names, got {kwargs!r}")
    reserved = sorted(set(kwargs) & set(_TEMPLATE_ARGS))
    if reserved:
        raise ValueError(f"chat_template_kwargs may not set {reserved}")
    return kwargs


def merge_outputs(total: RequestOutput | None, delta: RequestOutput) -> RequestOutput:
    """Fold a streamed delta into the whole output."""
    if total is None:
        total = RequestOutput(delta.request_id, delta.prompt, delta.prompt_token_ids, [])
    if len(total.outputs) == len(delta.outputs) == 1 and (
        total.outputs[0].index == delta.outputs[0].index
    ):  # (a stream of one sequence, at every chunk: no index to sort)
        _extend(total.outputs[0], delta.outputs[0])
    else:
        by_index = {o.index: o for o in total.outputs}
        for d in delta.outputs:
            o = by_index.get(d.index)
            if o is None:
                o = by_index[d.index] = CompletionOutput(
                    d.index, "", [], None, [] if d.logprobs is not None else None
                )
            _extend(o, d)
        total.outputs = [by_index[i] for i in sorted(by_index)]
    total.finished, total.metrics = delta.finished, delta.metrics
    total.num_cached_tokens = max(total.num_cached_tokens, delta.num_cached_tokens)
    if delta.prompt_logprobs is not None:
        total.prompt_logprobs = delta.prompt_logprobs
    return total


def _extend(o: CompletionOutput, d: CompletionOutput) -> None:
    o.text += d.text
    o.token_ids += d.token_ids
    if d.logprobs is not None:
        o.logprobs += d.logprobs
    o.finish_reason, o.stop_reason = d.finish_reason, d.stop_reason


def _describe(value: object) -> str:
    return f"{type(value).__name__} {value!r}"[:120]


def _prompt_list(prompts) -> list[str | list[int]]:
    """The prompts as a list: one string or token-id list, or a list / tuple of them."""
    if isinstance(prompts, str) or (_is_ids(prompts) and prompts):
        return [prompts]
    if isinstance(prompts, (list, tuple)):
        for i, p in enumerate(prompts):
            if not (isinstance(p, str) or _is_ids(p)):
                raise TypeError(
                    f"prompt {i} must be a string or a list of token ids (ints), got {_describe(p)}"
                )
        return list(prompts)
    raise TypeError(
        "prompts must be a string, a list of token ids, or a list of those, got "
        f"{_describe(prompts)}"
    )


def _is_ids(value: object) -> bool:
    return isinstance(value, (list, tuple)) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in value
    )


def _conversations(messages) -> list[list[dict]]:
    """One conversation (a list of message dicts) or a list of them, checked."""
    if isinstance(messages, (list, tuple)) and messages and isinstance(messages[0], dict):
        messages = [messages]
    if not isinstance(messages, (list, tuple)) or not messages:
        raise TypeError(
            "messages must be a list of {'role': ..., 'content': ...} dicts, or a list of such "
            f"lists, got {_describe(messages)}"
        )
    for i, conversation in enumerate(messages):
        if not isinstance(conversation, (list, tuple)) or not conversation:
            raise TypeError(
                f"conversation {i} must be a non-empty list of message dicts, got "
                f"{_describe(conversation)}"
            )
        for j, m in enumerate(conversation):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise TypeError(
                    f"message {j} of conversation {i} must be a dict with a 'role' string and "
                    f"'content', got {_describe(m)}"
                )
    return [list(c) for c in messages]


def _progress(total: int):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="Generating", dynamic_ncols=True)
