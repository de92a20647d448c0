"""LLMEngine: requests come in from any thread, a step loop runs on its own thread.

The loop owns the scheduler, the model runner and the sampler: each step it schedules, runs the
model, samples, updates the scheduler, detokenizes and pushes incremental outputs to each
request's stream. With async scheduling (the default) it schedules and launches step N+1
before reading step N's tokens, so the host's work overlaps the device's: step N's sequences
carry a placeholder token that step N+1 takes from the device (tensor-parallel workers from
rank 0's broadcast).

Requests are validated and tokenized on the caller's thread, so bad input is an exception there
and never reaches the loop.
"""

from __future__ import annotations

import atexit
import gc
import itertools
import json
import logging
import threading
import time
import weakref
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path

from nano_engine.config import EngineConfig
from nano_engine.detokenizer import IncrementalDetokenizer
from nano_engine.model_runner import ModelRunner, StepInput, resolve_device
from nano_engine.outputs import CompletionOutput, Logprob, RequestOutput
from nano_engine.parallel import Workers, abort_group, init_group
from nano_engine.sampler import SampledTokens, Sampler
from nano_engine.step_log import NO_ENTRY, NullEntry, Phases, StepLogEntry, StepRecorder
from nano_engine.streams import EngineDeadError, RequestStream, publish
from nano_kvcache import BlockManager
from nano_models import ModelConfig, TensorParallel
from nano_scheduler import (
    FinishReason,
    PendingStep,
    SamplingParams,
    Scheduler,
    SchedulerConfig,
    SchedulerOutput,
    Sequence,
)

log = logging.getLogger("nano_engine")


@dataclass
class _Request:
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


@dataclass
class _InFlight:
    """A launched step whose sampled tokens have not been read yet."""

    sampled: SampledTokens
    pending: PendingStep
    rows: dict[int, int]  # seq_id -> row of its token in ``sampled``
    log: StepLogEntry | NullEntry  # its step-log record


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


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.model_config = mc = ModelConfig.from_pretrained(config.model)
        limit = mc.max_position_embeddings
        if config.max_model_len is not None and config.max_model_len > limit:
            raise ValueError(
                f"max_model_len {config.max_model_len} exceeds the model's "
                f"max_position_embeddings ({limit})"
            )
        self.max_model_len = config.max_model_len or limit
        self.tokenizer = load_tokenizer(config)
        self.eos_token_ids = eos_token_ids(config, mc, self.tokenizer)
        device = resolve_device(config.device)
        self.workers = None
        self._apart = False  # a worker may be in a collective that this rank will not join
        tp = TensorParallel()
        if config.tensor_parallel_size > 1:
            self.workers = Workers(config, mc, device, self.max_model_len)
            tp = init_group(0, config.tensor_parallel_size, self.workers.port, device)
        try:
            self.runner = ModelRunner(config, mc, device, tp, self.max_model_len)
            self.sampler = Sampler(self.runner.device, mc.vocab_size, self.runner.staging)
            self.sampler.warm_up(self.runner.dtype)
            self.block_manager = BlockManager(
                self.runner.num_blocks, config.kvcache_block_size, config.enable_prefix_caching
            )
            self.scheduler = Scheduler(
                SchedulerConfig(
                    max_num_seqs=config.max_num_seqs,
                    max_num_batched_tokens=max(config.max_num_batched_tokens, config.max_num_seqs),
                    max_model_len=self.max_model_len,
                    enable_chunked_prefill=config.enable_chunked_prefill,
                    policy=config.scheduling_policy,
                    eos_token_ids=frozenset(self.eos_token_ids),
                ),
                self.block_manager,
            )
        except BaseException:  # (workers and the process group would outlive the engine)
            self._release()
            raise
        self._requests: dict[str, _Request] = {}
        self._seq_owner: dict[int, tuple[_Request, int]] = {}
        self._seq_ids = itertools.count()
        self._request_ids = itertools.count()
        self._inbox: deque[tuple[str, object]] = deque()
        self._cond = threading.Condition()
        self._stopping = False
        self.error: BaseException | None = None
        self.stats = StepStats()
        self.stats_log = StatsLog()
        self.recorder: StepRecorder | None = None  # the step log, when recording
        self.async_scheduling = config.use_async_scheduling
        self._in_flight: _InFlight | None = None
        self._frozen = False  # whether this engine holds the collector frozen (_freeze_gc)
        self._thread = threading.Thread(target=self._loop, name="nano-engine-loop", daemon=True)
        self._thread.start()
        if self.workers is not None:
            threading.Thread(
                target=self._watch_workers, name="nano-engine-watch", daemon=True
            ).start()
        atexit.register(_shutdown_if_alive, weakref.ref(self))
        _freeze_gc(self)  # last: an engine that failed to start froze nothing

    # ---- requests (any thread) ---------------------------------------------------------------

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        notify=None,
    ) -> RequestStream:
        """Validate and queue a request; its outputs arrive on the returned stream."""
        request = self.make_request(prompt, params, request_id, notify)
        self.submit([request])
        return request.stream

    def make_request(
        self, prompt, params=None, request_id=None, notify=None, stream_deltas: bool = True
    ) -> _Request:
        """A validated request, not queued yet (``ValueError`` for bad input). With
        ``stream_deltas`` False its stream gets a single output, when it finishes."""
        if self.error is not None:
            raise EngineDeadError(f"the engine is not running: {self.error}")
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
        needed = self.block_manager.num_blocks_for(len(ids) + 1)
        if needed > self.block_manager.num_blocks:
            raise ValueError(
                f"the prompt ({len(ids)} tokens) needs {needed} KV blocks, more than "
                f"the cache holds ({self.block_manager.num_blocks})"
            )
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer (skip_tokenizer_init is set)")
        vocab = self.model_config.vocab_size
        bad = [t for t in params.stop_token_ids if t >= vocab]
        if bad:
            raise ValueError(f"stop_token_ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        most = min(self.config.max_logprobs, vocab)
        if params.logprobs is not None and params.logprobs > most:
            raise ValueError(
                f"logprobs ({params.logprobs}) is over the engine's limit of {most} "
                "(max_logprobs, the vocabulary size)"
            )
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
        return _Request(
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
        )

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
        vocab = self.model_config.vocab_size
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        return None, list(prompt)

    def submit(self, requests: list[_Request]) -> None:
        with self._cond:
            if self.error is not None:
                raise EngineDeadError(f"the engine is not running: {self.error}")
            duplicate = [r.request_id for r in requests if r.request_id in self._requests]
            if duplicate:
                raise ValueError(f"request ids already in use: {duplicate}")
            for request in requests:
                self._requests[request.request_id] = request
                self._inbox.append(("add", request))
            self._cond.notify()

    def abort(self, request_id: str) -> None:
        """Stop a request wherever it is; its blocks are freed at the next step boundary."""
        with self._cond:
            self._inbox.append(("abort", request_id))
            self._cond.notify()

    def reset_prefix_cache(self) -> int:
        """Forget every cached block no request holds (vLLM's ``reset_prefix_cache``): prompts
        seen before are computed again, as in benchmark runs that repeat a workload. Returns
        the number of blocks forgotten."""
        if threading.current_thread() is self._thread:  # (from the loop itself: no waiting)
            return self.scheduler.block_manager.reset_prefix_cache()
        done: Future[int] = Future()
        with self._cond:
            if self.error is not None:
                raise EngineDeadError(f"the engine is not running: {self.error}")
            self._inbox.append(("reset_prefix_cache", done))
            self._cond.notify()
        while True:
            try:
                return done.result(timeout=0.5)
            except TimeoutError:
                if self.error is not None:
                    raise EngineDeadError(f"the engine is not running: {self.error}") from None

    def has_unfinished(self) -> bool:
        return bool(self._requests)

    def record_steps(
        self, path: str | Path | None = None, watch: threading.Thread | None = None
    ) -> StepRecorder:
        """Start a step log: every iteration of the loop and every request from now on, in
        memory or written to ``path`` (JSON lines, every few seconds and at shutdown);
        ``watch``: a thread whose CPU time to record too (the server's event loop)."""
        self.recorder = StepRecorder(self.runner.device, path, watch)
        return self.recorder

    def stop_recording(self) -> StepRecorder | None:
        """End the step log (written out, if to a file); returns it."""
        recorder, self.recorder = self.recorder, None
        if recorder is not None:
            recorder.flush()
        return recorder

    @property
    def num_requests(self) -> int:
        """Requests queued or running."""
        return len(self._requests)

    @property
    def num_sequences(self) -> int:
        """Sequences of the requests queued or running (finished ones included until their
        request finishes)."""
        return sum(len(r.seqs) for r in list(self._requests.values()))

    @property
    def alive(self) -> bool:
        return self.error is None and self._thread.is_alive()

    # ---- the step loop (its own thread) ------------------------------------------------------

    def _loop(self) -> None:
        try:
            while True:
                with self._cond:
                    while not (
                        self._inbox
                        or self._stopping
                        or self.scheduler.has_unfinished()
                        or self._in_flight is not None
                    ):
                        self._cond.wait()
                    if self._stopping:
                        break
                    commands = list(self._inbox)
                    self._inbox.clear()
                if self._in_flight is not None and any(kind == "abort" for kind, _ in commands):
                    self._step(schedule=False)  # an aborted request's last output is whole
                for kind, payload in commands:
                    if kind == "add":
                        for index, seq in enumerate(payload.seqs):
                            self._seq_owner[seq.seq_id] = (payload, index)
                            self.scheduler.add(seq)
                        if self.recorder is not None:
                            ids = payload.prompt_token_ids
                            self.recorder.accepted(payload.request_id, payload.arrival, len(ids))
                    elif kind == "abort":
                        self._abort(payload)
                    else:  # reset_prefix_cache
                        payload.set_result(self.scheduler.block_manager.reset_prefix_cache())
                if self.scheduler.has_unfinished() or self._in_flight is not None:
                    self._step()
        except BaseException as e:
            self._fail(self._worker_death() or e)
        finally:
            if self.error is None:
                self._fail(EngineDeadError("the engine was shut down"))

    def _worker_death(self, wait: float = 2.0) -> EngineDeadError | None:
        """After a failed step: a dead worker is the cause when there is one (its exit may
        reach us a moment after the collective that failed because of it)."""
        if self.workers is None:
            return None
        deadline = time.monotonic() + wait
        while (message := self.workers.dead()) is None and time.monotonic() < deadline:
            time.sleep(0.05)
        return EngineDeadError(message) if message else None

    def _abort(self, request_id: str) -> None:
        request = self._requests.get(request_id)
        if request is None:
            return
        for seq in request.seqs:
            self.scheduler.abort(seq.seq_id)
        self._deliver(
            [(request, self._output(request, range(len(request.seqs)), time.monotonic()))]
        )

    def _step(self, schedule: bool = True) -> None:
        """Schedule and launch a step, then read the previous step's tokens while it runs
        (async scheduling; without it, this step's own tokens). ``schedule=False`` only
        finishes the step in flight. ``clock`` times each phase (the step log's record)."""
        recorder = self.recorder
        watch = recorder.watch if recorder is not None else None
        clock = Phases(self.runner.synchronous, cpu=recorder is not None, watch=watch)
        previous, self._in_flight = self._in_flight, None
        out = SchedulerOutput()
        if schedule and self.scheduler.has_unfinished():
            out = self.scheduler.schedule()
        touched: dict[str, tuple[_Request, set[int]]] = {}
        for seq in out.finished:
            self._touch(touched, seq)
        log = self._begin_record(out, clock.start)
        if not out.is_empty:
            step = StepInput.of(out, previous.rows if previous else None)
            tokens = previous.sampled.tokens if previous else None
            clock.mark("schedule")
            log.mark(0)
            # A decode step in a CUDA graph draws its tokens there, when every row can.
            fused = (
                None if self.runner.is_eager(out) else self.sampler.fused_rows(out.sampling_seqs)
            )
            if self.workers is not None:
                # Until this rank has launched the step, a worker may wait in a collective
                # that this rank will never join (should it fail in between).
                self._apart = True
                self.workers.send(step, tokens)
            result = self.runner.execute(step, tokens, fused)
            drawn = self.sampler.drawn(result.tokens) if result.tokens is not None else None
            self._apart = False
            log.mark(1)
            clock.mark("launch", device="forward")
        clock.mark("schedule")
        if previous is not None:
            self._resolve(previous, out if not out.is_empty else None, touched, clock)
            previous.log.end()
        now = time.monotonic()
        outputs = [(r, self._output(r, indices, now)) for r, indices in touched.values()]
        clock.mark("post")
        current = None
        if not out.is_empty:
            seqs = out.sampling_seqs
            sampled = drawn
            if sampled is None:
                batch = self.sampler.prepare(seqs)
                clock.mark("sample")
                log.mark(2)
                sampled = self.sampler.sample(result.logits, batch)
                log.mark(3)
            clock.mark("sample", device="sample_device")
            rows = {seq.seq_id: row for row, seq in enumerate(seqs)}
            current = _InFlight(sampled, self.scheduler.advance(out), rows, log)
            clock.mark("sample")
            if self.async_scheduling:
                self._in_flight = current
            else:
                touched = {}
                self._resolve(current, None, touched, clock)
                now = time.monotonic()
                outputs += [(r, self._output(r, indices, now)) for r, indices in touched.values()]
                clock.mark("post")
        outputs = [(r, o) for r, o in outputs if o is not None]
        self._deliver(outputs)
        clock.outputs = len(outputs)
        clock.mark("publish")
        if not out.is_empty:
            self.stats.record(clock.host, clock.device, out.num_batched_tokens)
            self.stats_log.record(out, clock.host, clock.device, self.scheduler)
        log.close(clock, done=current is None or not self.async_scheduling)

    def _begin_record(self, out: SchedulerOutput, start: float) -> StepLogEntry:
        recorder = self.recorder
        if recorder is None:
            return NO_ENTRY
        eager = self.runner.is_eager(out)
        return StepLogEntry(recorder, recorder.begin(out, self.scheduler, eager, start))

    def _resolve(
        self, step: _InFlight, next_out: SchedulerOutput | None, touched, clock: Phases
    ) -> None:
        """Wait for a launched step's tokens and record them: the scheduler's placeholders,
        logprobs, detokenization and stop strings."""
        tokens, logprobs = step.sampled.result()
        clock.mark("wait")
        finished = self.scheduler.resolve(step.pending, tokens, next_out)
        clock.resolved += len(step.pending.slots)
        clock.finished += len(finished)
        # (those finished while scheduling the step come first: their outputs are out already)
        for seq in finished[len(step.pending.output.finished) :]:
            self._touch(touched, seq)
        for row, seq, position in step.pending.slots:
            token, logprob = tokens[row], logprobs[row]
            request, index = self._touch(touched, seq)
            if logprob is not None:
                request.logprobs[index].append(logprob)
            detok = request.detokenizers[index]
            if detok is not None and detok.stop_reason is not None:
                continue  # its text ended at a stop string (a step in flight sampled this)
            stop_token = (  # the token that stopped seq (eos, stop_token_ids)
                seq.finish_reason is FinishReason.STOP
                and position == len(seq.token_ids) - 1
                and token in seq.stop_token_ids
            )
            if stop_token and token in seq.params.stop_token_ids:
                request.stop_reasons[index] = token
            if detok is None:
                continue
            if stop_token and not seq.params.include_stop_str_in_output:
                continue  # its text is left out, as in vLLM
            # Stop strings count once min_tokens are out, as for stop tokens (vLLM too).
            may_stop = position + 1 - seq.num_prompt_tokens >= seq.params.min_tokens
            if detok.add(token, may_stop) and seq.finish_reason in (
                None,
                FinishReason.LENGTH,  # its last token: the stop string wins, as in vLLM
            ):
                if seq.is_finished:
                    seq.finish_reason = FinishReason.STOP
                else:
                    self.scheduler.finish(seq.seq_id, FinishReason.STOP)
                request.stop_reasons[index] = detok.stop_reason

    def _touch(self, touched, seq: Sequence) -> tuple[_Request, int]:
        request, index = self._seq_owner[seq.seq_id]
        touched.setdefault(request.request_id, (request, set()))[1].add(index)
        return request, index

    def _output(self, request: _Request, indices, now: float) -> RequestOutput | None:
        """What is new in these sequences of a request (None: nothing to send yet)."""
        if not request.stream_deltas:
            if not all(s.is_finished for s in request.seqs):
                return None
            indices = range(len(request.seqs))
        outputs = []
        for i in sorted(indices):
            seq, detok = request.seqs[i], request.detokenizers[i]
            done = seq.is_finished
            # (a slice of the new tokens only: output_token_ids would copy every output token)
            new_ids = seq.token_ids[seq.num_prompt_tokens + request.sent_tokens[i] :]
            new_logprobs = (
                request.logprobs[i][request.sent_tokens[i] :]
                if request.params.logprobs is not None
                else None
            )
            request.sent_tokens[i] += len(new_ids)
            text = detok.delta(done) if detok is not None else ""
            outputs.append(
                CompletionOutput(
                    i,
                    text,
                    new_ids,
                    seq.finish_reason.value if done else None,
                    new_logprobs,
                    request.stop_reasons[i],
                )
            )
            if done:
                self.sampler.release(seq.seq_id)
                self._seq_owner.pop(seq.seq_id, None)
        finished = all(s.is_finished for s in request.seqs)
        first = min((s.first_token_time for s in request.seqs if s.first_token_time), default=None)
        metrics = {
            "arrival_time": request.arrival,
            "first_token_time": first or 0.0,
            "last_token_time": now,
        }
        cached = request.seqs[0].num_prefix_cached_tokens
        return RequestOutput(
            request.request_id,
            request.prompt,
            request.prompt_token_ids,
            outputs,
            finished,
            cached,
            metrics,
        )

    def _deliver(self, outputs: list[tuple[_Request, RequestOutput]]) -> None:
        """Publish, then retire the finished requests (until then a failure still reaches
        them through ``_fail``)."""
        publish((request.stream, out) for request, out in outputs)
        if self.recorder is not None:
            for request, out in outputs:
                tokens = sum(len(o.token_ids) for o in out.outputs)
                first = request.seqs[0].first_scheduled_time
                self.recorder.published(request.request_id, tokens, out.finished, first)
        with self._cond:
            for request, out in outputs:
                if out.finished:
                    self._requests.pop(request.request_id, None)

    def _fail(self, error: BaseException) -> None:
        with self._cond:
            if self.error is not None:  # the first failure stands (its requests have it)
                log.debug("after the engine had stopped: %s", error)
                return
            self.error = error
            requests = list(self._requests.values())
            self._requests.clear()
        if not isinstance(error, EngineDeadError):
            log.error("the engine stopped: %s", error, exc_info=error)
        elif "shut down" not in str(error):
            log.error("the engine stopped: %s", error)
        publish((r.stream, EngineDeadError(f"the engine stopped: {error}")) for r in requests)

    def _watch_workers(self) -> None:
        while self.error is None and not self._stopping:
            message = self.workers.dead() if self.workers else None
            if message:
                self._fail(EngineDeadError(message))
                return
            time.sleep(0.2)

    # ---- lifetime ----------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Stop the loop (in-flight requests end with an error), the workers, and free memory."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            # A loop blocked in a collective with a dead worker never returns: do not wait long.
            self._thread.join(timeout=2 if self.error is not None else 30)
        _unfreeze_gc(self)
        self.stop_recording()
        self._release(self._thread)

    def _release(self, loop: threading.Thread | None = None) -> None:
        """Free the runner's device memory, then stop the workers and the process group, even
        if the first fails. In this order: NCCL's destroy waits for every CUDA graph that
        captured one of its collectives. ``loop``: the step loop's thread, once started; the
        runner is closed only after it has ended.

        Broken tensor parallelism: a dead worker, a failure on this rank between sending a step
        and launching it (a worker waits in a collective this rank never joins), or a loop
        still waiting on the device. Then the process group is aborted first (its kernels exit,
        and the loop with them), and the workers are terminated after 2 s."""
        stuck = loop is not None and loop is not threading.current_thread() and loop.is_alive()
        broken = self.workers is not None and (
            self._apart or stuck or self.workers.dead() is not None
        )
        try:
            if broken:
                # (with the loop alive too: it waits on the device, past its last replay)
                abort_group(getattr(self, "runner", None))
                if stuck:
                    loop.join(timeout=5)
            if hasattr(self, "runner") and (loop is None or not loop.is_alive()):
                self.runner.close()
        finally:
            self._stop_workers(broken)

    def _stop_workers(self, broken: bool) -> None:
        if self.workers is None:
            return
        import torch.distributed as dist

        workers, self.workers = self.workers, None
        # Every rank destroys its process group at the same time: NCCL's finalize waits for
        # the peers, so this rank joining the workers first (or they it) hangs. (Seen on two
        # H200s: the workers blocked in destroy_process_group until terminated, then rank 0.)
        workers.stop()
        if dist.is_initialized():
            dist.destroy_process_group()
        workers.shutdown(timeout=2.0 if broken else 10.0)

    def __enter__(self) -> LLMEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


@dataclass
class StepStats:
    """Where the loop's time goes: its own work (schedule, inputs, update, detokenize, publish)
    against waiting for sampled tokens. With async scheduling the two overlap the device's work,
    so the host share is how busy the loop is, not how long the device waits."""

    steps: int = 0
    host_seconds: float = 0.0
    device_seconds: float = 0.0
    tokens: int = 0

    def record(self, host: float, device: float, tokens: int) -> None:
        self.steps += 1
        self.host_seconds += host
        self.device_seconds += device
        self.tokens += tokens

    @property
    def host_share(self) -> float:
        total = self.host_seconds + self.device_seconds
        return self.host_seconds / total if total else 0.0


class StatsLog:
    """One INFO line every ``interval`` seconds while the engine works (as vLLM logs): prompt
    and generation throughput, step time and its host share, queues, KV usage, and the
    preemptions of the interval."""

    def __init__(self, interval: float = 10.0) -> None:
        self.interval = interval
        self.preemptions = 0
        self._reset(time.monotonic())

    def _reset(self, now: float) -> None:
        self.start, self.steps, self.prompt, self.generated = now, 0, 0, 0
        self.host = self.device = 0.0

    def record(self, out, host: float, device: float, scheduler: Scheduler) -> None:
        now = time.monotonic()
        if self.steps == 0 and now - self.start > self.interval + host + device:
            self.start = now - host - device  # the first step after an idle time: start here
        self.steps += 1
        self.prompt += sum(c.num_tokens for c in out.prefills)
        self.generated += len(out.sampling_seqs)
        self.host += host
        self.device += device
        if now - self.start < self.interval:
            return
        if log.isEnabledFor(logging.INFO):
            s, seconds = scheduler.stats(), now - self.start
            log.info(
                "prompt %.0f tok/s, generation %.0f tok/s, %.1f steps/s of %.2f ms "
                "(host %.0f%%), running %d, waiting %d, KV cache %.1f%%, preemptions %d",
                self.prompt / seconds,
                self.generated / seconds,
                self.steps / seconds,
                (self.host + self.device) / self.steps * 1e3,
                100 * self.host / (self.host + self.device),
                s.num_running,
                s.num_waiting,
                100 * s.kv_usage,
                s.num_preemptions - self.preemptions,
            )
            self.preemptions = s.num_preemptions
        self._reset(now)


_gc_lock = threading.Lock()
_gc_holders = 0  # live engines that froze the collector (gc.freeze is process-wide)


def _freeze_gc(engine: LLMEngine) -> None:
    """Move every object alive now (the model, compiled code, graphs: millions) out of the
    cyclic collector's way, as vLLM does after start-up: a full collection in the middle of a
    run walked them for ~0.2 s. Undone when the last engine that froze shuts down."""
    global _gc_holders
    with _gc_lock:
        gc.collect()
        gc.freeze()
        _gc_holders += 1
        engine._frozen = True


def _unfreeze_gc(engine: LLMEngine) -> None:
    global _gc_holders
    with _gc_lock:
        if not engine._frozen:
            return
        engine._frozen = False
        _gc_holders -= 1
        if _gc_holders == 0:
            gc.unfreeze()  # what only cycles keep alive can go now


def _shutdown_if_alive(ref: weakref.ref) -> None:
    engine = ref()
    if engine is not None:
        engine.shutdown()
