"""A request on its way through the engine: validated and tokenized on the caller's thread
(``RequestFactory``), then its sequences' sampled tokens recorded (logprobs, text, stop strings)
and its outputs assembled (``Request``) on the loop's."""

from __future__ import annotations

import itertools
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

from nano_engine.config import EngineConfig
from nano_engine.detokenizer import IncrementalDetokenizer
from nano_engine.outputs import CompletionOutput, Logprob, RequestOutput, WireOutput
from nano_engine.streams import RequestStream
from nano_engine.structured import GrammarCompiler
from nano_models import ModelConfig
from nano_scheduler import FinishReason, SamplingParams, Scheduler, Sequence

_STOP = FinishReason.STOP  # (read at every token: a global is faster than the Enum's class)


@dataclass
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    stream: RequestStream
    seqs: list[Sequence]
    detokenizers: list[IncrementalDetokenizer | None]
    arrival: float
    sent_tokens: list[int] = field(default_factory=list)
    stop_reasons: list[str | int | None] = field(default_factory=list)
    logprobs: list[list[Logprob]] = field(default_factory=list)
    stream_deltas: bool = True  # False: one output, when the request finishes
    matchers: list | None = None  # structured outputs: a grammar matcher per sequence
    # per sequence, with a reasoning parser: the token that ends the reasoning, before which
    # the grammar does not apply (None: it applies)
    grammar_after: list[int | None] | None = None
    bad_words: list[tuple[int, ...]] | None = None  # bad_words as token sequences
    prompt_logprobs: list[Logprob | None] | None = None  # [None] at first, when asked for
    # when a server's front in another process had it validated (monotonic: one host's clock)
    received: float | None = None
    _prompt_logprobs_sent: bool = False

    def record_prompt_logprob(self, position: int, logprob: Logprob) -> None:
        """The logprob of prompt token ``position`` (again after a preemption: kept once)."""
        if self.prompt_logprobs is not None and position == len(self.prompt_logprobs):
            self.prompt_logprobs.append(logprob)

    def banned(self, seq: Sequence) -> list[int]:
        """The tokens ``seq`` may not take next: the last of each bad word whose other tokens
        end its output (as vLLM has it)."""
        tokens, outputs = seq.token_ids, seq.num_output_tokens
        banned = []
        for word in self.bad_words or ():
            head = word[:-1]
            if not head or (outputs >= len(head) and tuple(tokens[-len(head) :]) == head):
                banned.append(word[-1])
        return banned

    def record(
        self,
        index: int,
        seq: Sequence,
        position: int,
        token: int,
        logprob: Logprob | None,
        scheduler: Scheduler,
    ) -> None:
        """A sampled token of sequence ``index`` (at ``position`` of its token ids), already
        in the scheduler's sequence: its logprob, its text, and a stop string it completes,
        which finishes the sequence (through ``scheduler``)."""
        if logprob is not None:
            self.logprobs[index].append(logprob)
        detok = self.detokenizers[index]
        if detok is not None and detok.stop_reason is not None:
            return  # its text ended at a stop string (a step in flight sampled this)
        stop_token = (  # the token that stopped seq (eos, stop_token_ids)
            seq.finish_reason is _STOP
            and position == len(seq.token_ids) - 1
            and token in seq.stop_token_ids
        )
        if stop_token and token in seq.params.stop_token_ids:
            self.stop_reasons[index] = token
        if detok is None:
            return
        if stop_token and not seq.params.include_stop_str_in_output:
            return  # its text is left out, as in vLLM
        # Stop strings count once min_tokens are out, as for stop tokens (vLLM too).
        may_stop = position + 1 - seq.num_prompt_tokens >= seq.params.min_tokens
        if detok.add(token, may_stop) and seq.finish_reason in (
            None,
            FinishReason.LENGTH,  # its last token: the stop string wins, as in vLLM
        ):
            if seq.is_finished:
                seq.finish_reason = FinishReason.STOP
            else:
                scheduler.finish(seq.seq_id, FinishReason.STOP)
            self.stop_reasons[index] = detok.stop_reason

    def grammar_to_follow(self, index: int, token: int) -> object | None:
        """The matcher that sequence ``index``'s sampled token moves (the sequence is not
        finished), or None while the grammar does not apply yet: the token is still the
        model's reasoning (whose end starts the grammar)."""
        if self.grammar_after is not None and self.grammar_after[index] is not None:
            if token == self.grammar_after[index]:
                self.grammar_after[index] = None  # the reasoning ended: the grammar applies
            return None
        return self.matchers[index]

    def output(
        self, indices, now: float, finished_ids: list[int]
    ) -> RequestOutput | WireOutput | None:
        """What is new in these sequences (None: nothing to send yet): a ``RequestOutput``, or
        where the stream sends outputs on to another process (``stream.wire``) the tuple they
        travel as (``WireOutput``: no objects to build and take apart
        again). The ids of the sequences that finish in it go into ``finished_ids``. (On the
        loop's thread for every streamed request at every step: one sequence, most requests,
        takes no sort and no pass over the others.)"""
        seqs = self.seqs
        if not self.stream_deltas:
            if not all(s.is_finished for s in seqs):
                return None
            indices = range(len(seqs))
        elif len(seqs) > 1:
            indices = sorted(indices)
        with_logprobs = self.params.logprobs is not None
        wire = self.stream.wire
        completions = []
        for i in indices:
            seq, detok, sent = seqs[i], self.detokenizers[i], self.sent_tokens[i]
            done = seq.is_finished
            # (a slice of the new tokens only: output_token_ids would copy every output token)
            new_ids = seq.token_ids[seq.num_prompt_tokens + sent :].tolist()
            new_logprobs = self.logprobs[i][sent:] if with_logprobs else None
            self.sent_tokens[i] = sent + len(new_ids)
            text = detok.delta(done) if detok is not None else ""
            reason = None
            if done:
                reason = seq.finish_reason.value
                finished_ids.append(seq.seq_id)
            stop = self.stop_reasons[i]
            completions.append(
                (i, text, new_ids, reason, new_logprobs, stop)
                if wire
                else CompletionOutput(i, text, new_ids, reason, new_logprobs, stop)
            )
        if len(seqs) == 1:
            last, first = seqs[0].is_finished, seqs[0].first_token_time
        else:
            last = all(s.is_finished for s in seqs)
            first = min((s.first_token_time for s in seqs if s.first_token_time), default=None)
        cached = seqs[0].num_prefix_cached_tokens
        prompt_logprobs = None
        whole = self.prompt_logprobs is not None and (
            len(self.prompt_logprobs) == len(self.prompt_token_ids)
        )
        if whole and not self._prompt_logprobs_sent:
            prompt_logprobs, self._prompt_logprobs_sent = self.prompt_logprobs, True
        if wire:  # (the span from the first token: the replica's clock)
            span = now - first if first else None
            return self.request_id, last, cached, completions, prompt_logprobs, span
        metrics = {
            "arrival_time": self.arrival,
            "first_token_time": first or 0.0,
            "last_token_time": now,
        }
        return RequestOutput(
            self.request_id,
            self.prompt,
            self.prompt_token_ids,
            completions,
            last,
            cached,
            metrics,
            prompt_logprobs,
        )


# The files a Hugging Face tokenizer is loaded from (one of them must be there).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model")


def load_tokenizer(config: EngineConfig):
    if config.skip_tokenizer_init:
        return None
    from transformers import AutoTokenizer

    source = config.tokenizer or config.model
    if not Path(source).is_dir():
        raise ValueError(
            f"no tokenizer directory at {source!r}: pass tokenizer=... or "
            "skip_tokenizer_init=True and token-id prompts"
        )
    advice = "pass tokenizer=DIR, or skip_tokenizer_init=True and token-id prompts"
    if not any((Path(source) / name).is_file() for name in TOKENIZER_FILES):
        raise ValueError(
            f"no tokenizer in {source!r} (looked for {', '.join(TOKENIZER_FILES)}): {advice}"
        )
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=False)
    except Exception as e:  # (transformers raises many kinds for a broken tokenizer)
        raise ValueError(f"cannot load the tokenizer in {source!r} ({e}): {advice}") from e
    if len(tokenizer) == 0:
        raise ValueError(f"the tokenizer in {source!r} has an empty vocabulary: {advice}")
    return tokenizer


def eos_token_ids(config: EngineConfig, model_config: ModelConfig, tokenizer) -> set[int]:
    """Every eos id: generation_config.json's, config.json's and the tokenizer's."""
    ids = set(model_config.eos_token_ids)
    generation = Path(config.model) / "generation_config.json"
    if generation.is_file():
        try:
            eos = json.loads(generation.read_text()).get("eos_token_id")
        except (ValueError, AttributeError) as e:
            raise ValueError(f"{generation} is not a JSON object: {e}") from e
        ids |= set(eos) if isinstance(eos, list) else {eos} if eos is not None else set()
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


def _last(ids: list[int], token: int) -> int:
    """The index of the last ``token`` in ``ids`` (-1: none)."""
    for i in range(len(ids) - 1, -1, -1):
        if ids[i] == token:
            return i
    return -1


def reasoning_tokens(tokenizer, parser_name: str | None) -> tuple[int, int] | None:
    """The token ids of a reasoning parser's start and end tags (ValueError where the
    tokenizer does not have each as one token)."""
    if parser_name is None or tokenizer is None:
        return None
    from nano_engine.reasoning import get_reasoning_parser

    parser = get_reasoning_parser(parser_name)
    ids = []
    for tag in (parser.start, parser.end):
        encoded = tokenizer.encode(tag, add_special_tokens=False)
        if len(encoded) != 1:
            raise ValueError(
                f"reasoning parser {parser_name!r} needs {tag!r} to be one token of the "
                f"tokenizer; it is {len(encoded)}"
            )
        ids.append(encoded[0])
    return ids[0], ids[1]


@dataclass(frozen=True)
class Validated:
    """A request's input, checked against one engine (``RequestFactory.validate``)."""

    text: str | None  # the prompt, when given as text
    token_ids: list[int]
    params: SamplingParams
    bad_words: list[tuple[int, ...]] | None
    grammar: object | None  # the compiled structured output, if asked for


class RequestFactory:
    """Builds validated requests for one engine: its tokenizer, vocabulary, model length and
    cache size (``num_blocks`` of ``block_size`` tokens); sequence and request ids unique
    within it."""

    def __init__(
        self,
        tokenizer,
        vocab_size: int,
        max_model_len: int,
        max_logprobs: int,
        num_blocks: int,
        block_size: int,
        grammars: GrammarCompiler,
        reasoning: tuple[int, int] | None = None,
    ) -> None:
        """``reasoning``: the token ids that start and end a model's reasoning (with a
        reasoning parser)."""
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self.grammars = grammars
        self.reasoning = reasoning
        self.max_model_len, self.max_logprobs = max_model_len, max_logprobs
        self.num_blocks, self.block_size = num_blocks, block_size
        self._seq_ids = itertools.count()
        self._request_ids = itertools.count()

    def make(
        self,
        prompt,
        params=None,
        request_id=None,
        notify=None,
        stream_deltas: bool = True,
        reasoning: bool = False,
    ) -> Request:
        """A validated request (``ValueError`` / ``TypeError`` for bad input). With
        ``stream_deltas`` False its stream gets a single output, when it finishes. With
        ``reasoning`` (a chat, with a reasoning parser), a structured output's grammar applies
        from the end of the model's reasoning."""
        valid = self.validate(prompt, params)
        text, ids, params, grammar = valid.text, valid.token_ids, valid.params, valid.grammar
        request_id = request_id if request_id is not None else str(next(self._request_ids))
        now = time.monotonic()
        seqs, detoks = [], []
        for i in range(params.n):
            seq_params = params
            if params.seed is not None and i:
                seed = params.seed + i
                seed -= 2**64 if seed >= 2**64 else 0  # (within 64 bits)
                seq_params = SamplingParams(**{**params.__dict__, "seed": seed})
            seqs.append(Sequence(next(self._seq_ids), ids, seq_params, now))
            detoks.append(
                IncrementalDetokenizer(
                    self.tokenizer,
                    ids,
                    params.stop,
                    params.skip_special_tokens,
                    params.include_stop_str_in_output,
                )
                if self.tokenizer is not None
                else None
            )
        after = None
        if grammar is not None and reasoning and self.reasoning is not None:
            start, end = self.reasoning
            ended = _last(ids, end) > _last(ids, start)  # (a template that closed it)
            after = [None if ended else end for _ in seqs]
        return Request(
            request_id,
            text,
            ids,
            params,
            RequestStream(request_id, notify),
            seqs,
            detoks,
            now,
            [0] * params.n,
            [None] * params.n,
            [[] for _ in range(params.n)],
            stream_deltas=stream_deltas,
            matchers=None if grammar is None else [self.grammars.matcher(grammar) for _ in seqs],
            grammar_after=after,
            bad_words=valid.bad_words,
            prompt_logprobs=[None] if params.prompt_logprobs is not None else None,
        )

    def validate(self, prompt, params=None) -> Validated:
        """Tokenize and check a request's input (``ValueError`` / ``TypeError``), compiling its
        structured output: here, off the step loop."""
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling params must be SamplingParams, got {type(params).__name__}")
        text, ids = self._tokenize(prompt)
        if not ids:
            raise ValueError("the prompt is empty")
        if len(ids) + 1 > self.max_model_len:
            raise ValueError(
                f"the prompt ({len(ids)} tokens) is longer than the maximum model "
                f"length of {self.max_model_len} tokens (with at least one token to "
                "generate)"
            )
        needed = -(-(len(ids) + 1) // self.block_size)
        if needed > self.num_blocks:
            raise ValueError(
                f"the prompt ({len(ids)} tokens) needs {needed} KV blocks, more than "
                f"the cache holds ({self.num_blocks})"
            )
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer (skip_tokenizer_init is set)")
        vocab = self.vocab_size
        for name, given in (
            ("stop_token_ids", params.stop_token_ids),
            ("allowed_token_ids", params.allowed_token_ids or ()),
            ("logit_bias", params.logit_bias or ()),
        ):
            bad = [t for t in given if t >= vocab]
            if bad:
                raise ValueError(f"{name} {bad[:5]} are outside the vocabulary [0, {vocab})")
        bad_words = self._bad_words(params.bad_words)
        outside = sorted({t for word in bad_words or () for t in word if t >= vocab})
        if outside:
            raise ValueError(
                f"bad_words tokenize to ids {outside[:5]} outside the model's vocabulary "
                f"[0, {vocab})"
            )
        most = min(self.max_logprobs, vocab)
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > most:
                raise ValueError(
                    f"{name} ({value}) is over the engine's limit of {most} "
                    "(max_logprobs, the vocabulary size)"
                )
        grammar = None
        if params.structured_outputs is not None:  # (compiled here: off the step loop)
            grammar = self.grammars.compile(params.structured_outputs)
        return Validated(text, ids, params, bad_words, grammar)

    def _bad_words(self, words) -> list[tuple[int, ...]] | None:
        """Each bad word as tokens, alone and after a space (as vLLM does)."""
        if not words:
            return None
        if self.tokenizer is None:
            raise ValueError("bad_words need a tokenizer (skip_tokenizer_init is set)")
        found = set()
        for word in words:
            for text in (word, " " + word.lstrip()):
                ids = tuple(self.tokenizer.encode(text, add_special_tokens=False))
                if ids:
                    found.add(ids)
        return sorted(found)

    def _tokenize(self, prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(
                    "text prompts need a tokenizer: pass token ids (skip_tokenizer_init is set)"
                )
            return prompt, self.tokenizer(prompt).input_ids
        if not isinstance(prompt, (list, tuple)) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt
        ):
            raise TypeError("a prompt is a string or a list of token ids")
        vocab = self.vocab_size
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        return None, list(prompt)
