"""LLMEngine: requests come in from any thread, a step loop runs on its own thread.

The loop owns the scheduler, the model runner and the sampler: each step it schedules, runs the
model, samples, updates the scheduler, detokenizes and pushes incremental outputs to each
request's stream. With async scheduling (the default) it schedules and launches step N+1
before reading step N's tokens, so the host's work overlaps the device's: step N's sequences
carry a placeholder token that step N+1 takes from the device (tensor-parallel workers from
rank 0's broadcast).

Requests are validated and tokenized on the caller's thread (``nano_engine.requests``), so bad
input is an exception there and never reaches the loop; their tokens are recorded and their
outputs assembled by ``Request`` on the loop's.
"""

from __future__ import annotations

import atexit
import gc
import logging
import threading
import time
import weakref
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from nano_engine.config import EngineConfig, resolve_max_model_len
from nano_engine.grammars import StepGrammars
from nano_engine.model_runner import ModelRunner, StepInput, resolve_device
from nano_engine.outputs import Logprob, RequestOutput, WireOutput, is_last, tokens_of
from nano_engine.parallel import Workers, abort_group, init_group
from nano_engine.requests import (
    Request,
    RequestFactory,
    eos_token_ids,
    load_tokenizer,
    reasoning_tokens,
)
from nano_engine.sampler import FusedRows, SampledTokens, Sampler, prompt_logprobs
from nano_engine.stats import EngineStats, StatsLog, StepStats
from nano_engine.step_log import NO_ENTRY, NullEntry, Phases, StepLogEntry, StepRecorder
from nano_engine.streams import EngineDeadError, RequestStream, publish
from nano_engine.structured import GrammarCompiler, TokenMasks
from nano_kvcache import BlockManager
from nano_models import ModelConfig, TensorParallel
from nano_scheduler import (
    PendingStep,
    SamplingParams,
    Scheduler,
    SchedulerConfig,
    SchedulerOutput,
    Sequence,
)

if TYPE_CHECKING:
    import torch

log = logging.getLogger("nano_engine")


@dataclass
class _InFlight:
    """A launched step whose sampled tokens have not been read yet."""

    sampled: SampledTokens | None  # None: its draw waits for a grammar's bitmask (``deferred``)
    pending: PendingStep
    rows: dict[int, int]  # seq_id -> row of its token in ``sampled``
    log: StepLogEntry | NullEntry  # its step-log record
    # prompt logprobs: the step's (seq_id, position) slots and their tensors on the device
    prompt: tuple[list[tuple[int, int]], tuple] | None = None
    # a draw put off until the next step launches (``_deferrable``): its logits and rows' inputs
    deferred: tuple[torch.Tensor, FusedRows] | None = None


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.model_config = mc = ModelConfig.from_pretrained(config.model)
        self.max_model_len = resolve_max_model_len(config.max_model_len, mc)
        self.tokenizer = load_tokenizer(config)
        self.eos_token_ids = eos_token_ids(config, mc, self.tokenizer)
        device = resolve_device(config.device)
        self.workers = None
        self._apart = False  # a worker may be in a collective that this rank will not join
        try:
            if config.tensor_parallel_size > 1:
                self.workers = Workers(config, mc, device, self.max_model_len)
                self.runner = self.workers.start(lambda: self._start_rank0(device))
                self.runner.bind_thread()  # (as a runner made on this thread would have)
            else:
                self.runner = ModelRunner(config, mc, device, TensorParallel(), self.max_model_len)
            self.sampler = Sampler(self.runner.device, mc.vocab_size, self.runner.staging)
            self.sampler.warm_up(self.runner.dtype)
            self.block_manager = BlockManager(
                self.runner.num_blocks, config.kvcache_block_size, config.enable_prefix_caching
            )
            self.scheduler = Scheduler(
                SchedulerConfig(
                    max_num_seqs=config.max_num_seqs,
                    max_num_batched_tokens=self.runner.max_num_batched_tokens,
                    max_model_len=self.max_model_len,
                    enable_chunked_prefill=config.enable_chunked_prefill,
                    policy=config.scheduling_policy,
                    eos_token_ids=frozenset(self.eos_token_ids),
                ),
                self.block_manager,
            )
        except BaseException:  # (workers and the process group would outlive the engine)
            # (a worker may wait in a collective of the start that this rank left)
            self._apart = self.workers is not None
            self._release()
            raise
        self._requests: dict[str, Request] = {}
        self._seq_owner: dict[int, tuple[Request, int]] = {}
        self.request_factory = RequestFactory(
            self.tokenizer,
            mc.vocab_size,
            self.max_model_len,
            config.max_logprobs,
            self.block_manager.num_blocks,
            self.block_manager.block_size,
            GrammarCompiler(self.tokenizer, mc.vocab_size, sorted(self.eos_token_ids)),
            reasoning_tokens(self.tokenizer, config.reasoning_parser),
        )
        self.grammars = StepGrammars(
            TokenMasks(self.runner.device, mc.vocab_size, self.eos_token_ids),
            self._seq_owner,
            self.scheduler,
        )
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

    def _start_rank0(self, device) -> ModelRunner:
        """Rank 0 of a tensor-parallel engine: join the workers' process group, then load."""
        world = self.config.tensor_parallel_size
        tp = init_group(0, world, self.workers.store, device)
        return ModelRunner(self.config, self.model_config, device, tp, self.max_model_len)

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
        self,
        prompt,
        params=None,
        request_id=None,
        notify=None,
        stream_deltas: bool = True,
        reasoning: bool = False,
    ) -> Request:
        """A validated request, not queued yet (``ValueError`` for bad input). With
        ``stream_deltas`` False its stream gets a single output, when it finishes; with
        ``reasoning`` (a chat, with a reasoning parser) a structured output's grammar applies
        from the end of the model's reasoning."""
        if self.error is not None:
            raise EngineDeadError(f"the engine is not running: {self.error}")
        return self.request_factory.make(
            prompt, params, request_id, notify, stream_deltas, reasoning
        )

    def submit(self, requests: list[Request]) -> None:
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
        self, path: str | Path | None = None, watch: threading.Thread | int | None = None
    ) -> StepRecorder:
        """Start a step log: every iteration of the loop and every request from now on, in
        memory or written to ``path`` (JSON lines, every few seconds and at shutdown);
        ``watch``: a thread whose CPU time to record too (the server's event loop), or the pid
        of a process of this host (the server's front, the engine in a process of its own)."""
        if self.recorder is not None:
            self.recorder.close()
        self.recorder = StepRecorder(self.runner.device, path, watch)
        return self.recorder

    def stop_recording(self) -> StepRecorder | None:
        """End the step log (written out, if to a file); returns it."""
        recorder, self.recorder = self.recorder, None
        if recorder is not None:
            recorder.close()
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

    def replica_stats(self) -> list[EngineStats]:
        """This engine's state for /metrics: one entry (a fleet has one per replica)."""
        return [EngineStats.of(self.scheduler, self.alive)]

    def describe(self) -> dict:
        """What a benchmark reports of the engine: its cache, kernels and loop so far."""
        runner, stats = self.runner, self.stats
        return {
            "kv_blocks": runner.num_blocks,
            "kv_tokens": runner.num_blocks * self.config.kvcache_block_size,
            "attention_backend": runner.backend.name,
            "cuda_graphs": runner.graphs is not None,
            "async_scheduling": self.async_scheduling,
            "device": str(runner.device),
            "steps": stats.steps,
            "host_seconds": stats.host_seconds,
            "device_seconds": stats.device_seconds,
            "preemptions": self.scheduler.num_preemptions,
            "prefix_cache_hit_tokens": self.block_manager.hit_tokens,
        }

    # ---- the step loop (its own thread) ------------------------------------------------------

    def _loop(self) -> None:
        try:
            self.runner.bind_thread()
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
                        self.grammars.live += payload.matchers is not None
                        for index, seq in enumerate(payload.seqs):
                            self._seq_owner[seq.seq_id] = (payload, index)
                            self.scheduler.add(seq)
                        if self.recorder is not None:
                            ids = payload.prompt_token_ids
                            self.recorder.accepted(
                                payload.request_id, payload.arrival, len(ids), payload.received
                            )
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
        clock = Phases(
            self.runner.synchronous,
            cpu=recorder is not None,
            watch=watch,
            collector=recorder.collector if recorder is not None else None,
        )
        previous, self._in_flight = self._in_flight, None
        out = SchedulerOutput()
        if schedule and self.scheduler.has_unfinished():
            out = self.scheduler.schedule()
        touched: dict[str, tuple[Request, set[int]]] = {}
        for seq in out.finished:
            self._touch(touched, seq)
        log = self._begin_record(out, clock.start)
        if not out.is_empty:
            step = StepInput.of(out, previous.rows if previous else None)
            clock.mark("schedule")
            if previous is not None and previous.deferred is not None:
                self._draw_deferred(previous, clock)
            tokens = previous.sampled.tokens if previous else None
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
            prompt = self._prompt_logprobs(step, result.prompt_logits)
            log.mark(1)
            clock.mark("launch", device="forward")
        clock.mark("schedule")
        if previous is not None:
            if previous.deferred is not None:
                self._draw_deferred(previous, clock)
            self._resolve(previous, out if not out.is_empty else None, touched, clock)
            previous.log.end()
        now = time.monotonic()
        outputs = [(r, self._output(r, indices, now)) for r, indices in touched.values()]
        clock.mark("post")
        current = None
        if not out.is_empty:
            seqs = out.sampling_seqs
            sampled, deferred = drawn, None
            if sampled is None and (deferred := self._deferrable(out, seqs)) is None:
                batch = self._sampling_batch(out, seqs)
                clock.mark("sample")
                log.mark(2)
                sampled = self.sampler.sample(result.logits, batch)
                log.mark(3)
            clock.mark("sample", device="sample_device")
            rows = {seq.seq_id: row for row, seq in enumerate(seqs)}
            later = (result.logits, deferred) if deferred is not None else None
            current = _InFlight(sampled, self.scheduler.advance(out), rows, log, prompt, later)
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
        if step.prompt is not None:
            self._record_prompt_logprobs(*step.prompt)
        # (first: the matchers move and the next step's bitmask fills while this one records)
        grammars = self.grammars
        grammar = grammars.follow(step.pending, tokens, next_out) if grammars.live else None
        finished = self.scheduler.resolve(step.pending, tokens, next_out)
        if grammar is not None and grammar[0]:
            grammars.followed(*grammar)
        clock.resolved += len(step.pending.slots)
        clock.finished += len(finished)
        # (those finished while scheduling the step come first: their outputs are out already)
        for seq in finished[len(step.pending.output.finished) :]:
            self._touch(touched, seq)
        owners = self._seq_owner
        for row, seq, position in step.pending.slots:
            request, index = owners[seq.seq_id]
            if request.stream_deltas:
                _touched(touched, request, index)
            request.record(index, seq, position, tokens[row], logprobs[row], self.scheduler)
            if not request.stream_deltas and seq.is_finished:  # (its one output: at the end)
                _touched(touched, request, index)

    def _prompt_logprobs(self, step: StepInput, logits) -> tuple | None:
        """The logprobs of the step's prompt rows (those of requests that ask), computed on the
        device now, read when the step is resolved."""
        if logits is None:  # (none asked, or a worker rank)
            return None
        targets, k = [], 0
        for seq_id, position in step.prompt_slots:
            seq = self._seq_owner[seq_id][0].seqs[self._seq_owner[seq_id][1]]
            targets.append(seq.token_ids[position])
            k = max(k, seq.params.prompt_logprobs)
        return step.prompt_slots, prompt_logprobs(logits, targets, k)

    def _record_prompt_logprobs(self, slots: list[tuple[int, int]], tensors: tuple) -> None:
        chosen, rank, values, ids = (t.tolist() for t in tensors)
        for i, (seq_id, position) in enumerate(slots):
            owner = self._seq_owner.get(seq_id)
            if owner is None or owner[1] != 0:  # (the prompt's: its first sequence's)
                continue
            request, _ = owner
            k = request.params.prompt_logprobs
            token = request.prompt_token_ids[position]
            logprob = Logprob.of(token, chosen[i], ids[i][:k], values[i][:k], rank[i])
            request.record_prompt_logprob(position, logprob)

    def _sampling_batch(self, out: SchedulerOutput, seqs: list[Sequence]):
        """The sampler's inputs for a step it draws outside a decode graph."""
        grammar = self.grammars.masks(out)
        if grammar is not None:  # (rows that need no more than the bitmask: one fused pass)
            rows = self.sampler.fused_rows(seqs, grammar=True)
            if rows is not None:
                return self.sampler.prepare_fused(rows, grammar)
        return self.sampler.prepare(seqs, grammar, self._banned(seqs))

    def _deferrable(self, out: SchedulerOutput, seqs: list[Sequence]) -> FusedRows | None:
        """A step whose draw waits for a grammar's bitmask (filling in the background) and
        takes nothing but the fused pass: with async scheduling its draw waits until the next
        step is scheduled and staged, so that the host prepares that step while the bitmask
        fills and the device runs the draw and that step's forward back to back (drawn now,
        the device would idle from this step's forward to the next launch). Returns the rows'
        inputs (taken now: seeds follow the sequences' lengths, which ``advance`` changes), or
        None: draw now."""
        if not self.async_scheduling or not self.grammars.filling(out):
            return None
        return self.sampler.fused_rows(seqs, grammar=True)

    def _draw_deferred(self, step: _InFlight, clock: Phases) -> None:
        """Draw a deferred step's tokens (``_deferrable``) once its bitmask is filled."""
        logits, rows = step.deferred
        step.deferred = None
        batch = self.sampler.prepare_fused(rows, self.grammars.masks(step.pending.output))
        step.log.mark(2)
        step.sampled = self.sampler.sample(logits, batch)
        step.log.mark(3)
        clock.mark("sample", device="sample_device")

    def _banned(self, seqs: list[Sequence]) -> list[tuple[int, list[int]]]:
        """(row, tokens) that rows with bad words may not take next."""
        banned = []
        for row, seq in enumerate(seqs):
            if seq.params.bad_words:
                owner = self._seq_owner.get(seq.seq_id)
                if owner is not None:
                    banned.append((row, owner[0].banned(seq)))
        return banned

    def _touch(self, touched, seq: Sequence) -> None:
        _touched(touched, *self._seq_owner[seq.seq_id])

    def _output(self, request: Request, indices, now: float) -> RequestOutput | WireOutput | None:
        """What is new in these sequences of a request (None: nothing to send yet; a tuple for
        a stream of a replica: ``Request.output``); a finished sequence's sampler state and
        owner entry go."""
        finished_ids: list[int] = []
        out = request.output(indices, now, finished_ids)
        for seq_id in finished_ids:
            self.sampler.release(seq_id)
            self._seq_owner.pop(seq_id, None)
        return out

    def _deliver(self, outputs: list[tuple[Request, RequestOutput | WireOutput]]) -> None:
        """Publish, then retire the finished requests (until then a failure still reaches
        them through ``_fail``)."""
        publish((request.stream, out) for request, out in outputs)
        if self.recorder is not None:
            for request, out in outputs:
                first = request.seqs[0].first_scheduled_time
                self.recorder.published(request.request_id, tokens_of(out), is_last(out), first)
        with self._cond:
            for request, out in outputs:
                if is_last(out) and self._requests.pop(request.request_id, None) is not None:
                    self.grammars.live -= request.matchers is not None

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
        if not self._thread.is_alive():
            self.grammars.close()
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
        if workers.stuck is not None and workers.stuck.is_alive():
            log.warning("the process group is left as it is: rank 0's start still waits in it")
        elif dist.is_initialized():
            dist.destroy_process_group()
        workers.shutdown(timeout=2.0 if broken else 10.0)

    def __enter__(self) -> LLMEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


_gc_lock = threading.Lock()
_gc_holders = 0  # live engines that froze the collector (gc.freeze is process-wide)


def _touched(touched: dict, request: Request, index: int) -> None:
    """Sequence ``index`` of ``request`` has something new for its output this step."""
    touched.setdefault(request.request_id, (request, set()))[1].add(index)


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
