"""The step loop's side of structured outputs: which rows of a step a grammar constrains, the
fill of their bitmask in the background while the loop does other work, and each resolved
step's tokens taken by the sequences' matchers (a grammar's end finishes its sequence).

Grammars, matchers and the bitmask's fill are ``nano_engine.structured``'s; this module
decides when they run within a step (on the loop's thread only).
"""

from __future__ import annotations

import logging

from nano_engine.structured import ENDED, REJECTED, GrammarWork, TokenMasks
from nano_scheduler import FinishReason, PendingStep, Scheduler, SchedulerOutput, Sequence

log = logging.getLogger("nano_engine")


class StepGrammars:
    """The grammars of the live constrained requests, step by step. ``owners``: the engine's
    sequence id -> (request, index) map (read only here)."""

    def __init__(self, token_masks: TokenMasks, owners: dict, scheduler: Scheduler) -> None:
        self._token_masks = token_masks
        self._owners = owners
        self._scheduler = scheduler
        self.live = 0  # live requests with structured outputs
        self._filling: tuple[SchedulerOutput, GrammarWork] | None = None  # a step's bitmask

    def follow(
        self, pending: PendingStep, tokens: list[int], next_out: SchedulerOutput | None
    ) -> tuple[list, GrammarWork] | None:
        """Start, in the background, the matchers of a resolved step's constrained sequences
        taking their tokens, then the fill of the next step's bitmask (while the loop records
        this step). Returns what ``followed`` needs, or None."""
        self._drop_filling()
        moving = []  # (request, sequence, matcher, token)
        for row, seq, _ in pending.slots:
            owner = self._owners.get(seq.seq_id)
            # (finished: by a stop string, its grammar's end or its length; no token to take)
            if owner is not None and owner[0].matchers is not None and not seq.is_finished:
                matcher = owner[0].grammar_to_follow(owner[1], tokens[row])
                if matcher is not None:
                    moving.append((owner[0], seq, matcher, tokens[row]))
        matchers, rows = self._rows(next_out.sampling_seqs) if next_out else ([], [])
        if not moving and not rows:
            return None
        work = self._token_masks.start(
            [m[2] for m in moving], [m[3] for m in moving], matchers, rows
        )
        if rows:
            self._filling = (next_out, work)
        return moving, work

    def followed(self, moving: list, work: GrammarWork) -> None:
        """Once the matchers took the tokens: a grammar's end (a stop token it took) finishes
        its sequence, ignore_eos or not (as a stop string does, after the scheduler's
        resolve); a token it refused (the mask let it through: a bug) aborts it."""
        for (request, seq, _, token), status in zip(moving, work.statuses_of_tokens()):
            if status == REJECTED:
                name = request.request_id
                log.error("request %s: token %d sampled against its grammar", name, token)
                if not seq.is_finished:  # (a stop token it refused has finished it already)
                    self._scheduler.finish(seq.seq_id, FinishReason.ABORT)
            elif status == ENDED and not seq.is_finished:
                self._scheduler.finish(seq.seq_id, FinishReason.STOP)

    def filling(self, out: SchedulerOutput) -> bool:
        """Whether the bitmask of ``out``'s rows is filling in the background."""
        return self._filling is not None and self._filling[0] is out

    def masks(self, out: SchedulerOutput) -> tuple | None:
        """The bitmask of a step's rows with structured outputs (started while the step before
        was resolved, or now), on the device, or None."""
        if not self.live:
            return None
        filling, self._filling = self._filling, None
        work = filling[1] if filling is not None and filling[0] is out else None
        if work is None:
            if filling is not None:
                filling[1].masks()  # (one never used: no matcher moves while it fills)
            matchers, rows = self._rows(out.sampling_seqs)
            if not rows:
                return None
            work = self._token_masks.start([], [], matchers, rows)
        return self._token_masks.to_device(work.masks())

    def close(self) -> None:
        self._token_masks.close()

    def _drop_filling(self) -> None:
        if self._filling is not None:
            self._filling[1].masks()  # (one never used: no matcher moves while it fills)
        self._filling = None

    def _rows(self, seqs: list[Sequence]) -> tuple[list, list[int]]:
        """The matchers of a step's rows that its grammar constrains, and those rows."""
        rows, matchers = [], []
        for row, seq in enumerate(seqs):
            owner = self._owners.get(seq.seq_id)  # (gone: finished since, its row unused)
            if owner is not None and owner[0].matchers is not None and not seq.is_finished:
                request, index = owner
                after = request.grammar_after
                if after is None or after[index] is None:  # (not still reasoning)
                    rows.append(row)
                    matchers.append(request.matchers[index])
        return matchers, rows
