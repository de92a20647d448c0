"""Sampling on the device, for the whole batch at once.

Per row: logit_bias, allowed_token_ids, min_tokens (eos and stop ids masked), bad words, a
structured output's grammar (its bitmask), repetition / presence / frequency penalties,
temperature (0 is greedy), top-k, top-p, min-p, then a draw by the exponential race
(argmax of p / E with E ~ Exp(1)), which needs no normalization and lets a seeded request
draw its noise from its own generator: the same seed gives the same tokens whatever else is in
the batch. Log-probabilities are those of the model's raw distribution.

On CUDA the rows without top-k, top-p or min-p take one fused pass instead (nano_engine.gumbel:
the argmax of logits / temperature plus Gumbel noise keyed by a per-row seed, the same
distribution); a seeded row's seed is mixed with its number of output tokens, so it still draws
the same tokens in any batch. When nothing else needs the logits in float32, a grammar's bitmask
is read by that pass too.
"""

from __future__ import annotations

import random
from array import array
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from nano_engine import gumbel
from nano_engine.outputs import Logprob
from nano_engine.staging import PinnedStaging
from nano_scheduler import SamplingParams, Sequence


@dataclass
class SamplingBatch:
    """The per-row parameters of one step, on the device."""

    temperature: torch.Tensor | None  # [S] float32, 1 for greedy rows (None: fused pass only)
    greedy: torch.Tensor | None  # [S] bool (None: fused pass only)
    top_k: torch.Tensor | None  # [S] int64, vocab size where off
    top_p: torch.Tensor | None  # [S] float32
    min_p: torch.Tensor | None  # [S] float32
    all_greedy: bool
    any_greedy: bool
    masks: list[tuple[int, list[int]]] = field(default_factory=list)  # min_tokens
    penalties: tuple[torch.Tensor, ...] | None = None  # repetition, presence, frequency [S]
    penalty_tokens: tuple[list[int], list[int], list[int], list[int]] | None = None
    seeded: list[tuple[int, torch.Generator]] = field(default_factory=list)
    logprobs: list[int | None] = field(default_factory=list)
    # structured outputs: the bitmask of the constrained rows [R, V / 32] and those rows
    grammar: tuple[torch.Tensor, list[int]] | None = None
    biases: list[tuple[int, list[int], list[float]]] = field(default_factory=list)  # logit_bias
    allowed: list[tuple[int, list[int]]] = field(default_factory=list)  # allowed_token_ids
    # The fused path (CUDA): 1 / temperature (0 for greedy) and Philox seeds per row; rows
    # with top-k / top-p / min-p are marked in ``filtered`` and take the torch path.
    inv_temperature: torch.Tensor | None = None
    seeds: torch.Tensor | None = None
    filtered: torch.Tensor | None = None
    num_filtered: int = 0
    mask_rows: torch.Tensor | None = None  # [S] int32: each row's row of the bitmask, -1: none


class FusedRows(NamedTuple):
    """A batch whose every row takes the fused pass and nothing else: its per-row inputs, for a
    decode CUDA graph to draw the tokens itself."""

    inv_temperature: list[float]  # 0 for greedy rows
    seeds: list[int]  # Philox seeds, 53 bits


class Sampler:
    def __init__(
        self, device: torch.device, vocab_size: int, staging: PinnedStaging | None = None
    ) -> None:
        self.device, self.vocab_size = device, vocab_size
        self._generators: dict[int, torch.Generator] = {}
        # per sequence, what ``fused_rows`` reads of its params (``_fused_row``), worked out
        # at its first step (every decode step asks for every row)
        self._fused_params: dict[int, tuple[float | None, int, bool]] = {}
        self.fused = gumbel.available(device)
        self._rng = random.Random(torch.initial_seed())  # unseeded rows' Philox seeds
        self._staging = staging
        if staging is None and device.type == "cuda":
            self._staging = PinnedStaging(device)
        self._hosts = _HostTokens() if device.type == "cuda" else None

    def fused_rows(self, seqs: list[Sequence], grammar: bool = False) -> FusedRows | None:
        """The rows' fused-pass inputs, or None when some row needs more than the fused pass
        (top-k, top-p, min-p, logprobs, penalties, a min_tokens mask, a grammar unless
        ``grammar``: its bitmask is at hand) or there is no fused pass.
        Draws the same seeds as ``prepare`` would."""
        if not self.fused:
            return None
        inv, known = [], self._fused_params
        for seq in seqs:
            row = known.get(seq.seq_id)
            if row is None:
                row = known[seq.seq_id] = self._fused_row(seq.params)
            inv_temperature, min_tokens, constrained = row
            if (
                inv_temperature is None
                or (constrained and not grammar)
                or (min_tokens and seq.num_output_tokens < min_tokens and seq.stop_token_ids)
            ):
                return None
            inv.append(inv_temperature)
        return FusedRows(inv, [self._seed(seq) for seq in seqs])

    def _fused_row(self, p: SamplingParams) -> tuple[float | None, int, bool]:
        """What of a row's params ``fused_rows`` reads: 1 / temperature (0 greedy; None where
        the row always needs more than the fused pass), its min_tokens (a stop-token mask
        until then), whether it is constrained by a grammar."""
        more = (
            p.logprobs is not None
            or p.repetition_penalty != 1
            or p.presence_penalty
            or p.frequency_penalty
            or p.logit_bias
            or p.allowed_token_ids
            or p.bad_words
            or (
                p.temperature != 0 and (0 < p.top_k < self.vocab_size or p.top_p < 1 or p.min_p > 0)
            )
        )
        inv_temperature = None if more else 0.0 if p.temperature == 0 else 1 / p.temperature
        return inv_temperature, p.min_tokens, p.structured_outputs is not None

    @torch.inference_mode()  # (the host buffers may be inference tensors: made in sample)
    def drawn(self, tokens: torch.Tensor) -> SampledTokens:
        """The tokens a CUDA graph drew for ``fused_rows`` (their copy to the host queued now)."""
        host = self._hosts.next(tokens.shape[0]) if self._hosts is not None else None
        return SampledTokens(tokens, [None] * tokens.shape[0], host=host)

    def warm_up(self, dtype: torch.dtype) -> None:
        """Compile the fused pass for logits [S, vocab] in the model's dtype and in float32
        (logprobs, penalties and min_tokens make them float32), and with a bitmask, at
        start-up, not at the first sampled request."""
        if not self.fused:
            return
        inv_temperature = torch.ones(1, device=self.device)
        seeds = torch.zeros(1, dtype=torch.int64, device=self.device)
        for d in {dtype, torch.float32}:
            logits = torch.zeros(1, self.vocab_size, dtype=d, device=self.device)
            gumbel.gumbel_argmax(logits, inv_temperature, seeds)
        # and with a grammar's bitmask (``prepare_fused``: the model's dtype)
        dev, width = self.device, -(-self.vocab_size // 32)
        words = torch.full((1, width), -1, dtype=torch.int32, device=dev)
        rows = torch.zeros(1, dtype=torch.int32, device=dev)
        gumbel.gumbel_argmax(logits.to(dtype), inv_temperature, seeds, words, rows)

    def release(self, seq_id: int) -> None:
        """Forget a finished sequence's generator and params."""
        self._generators.pop(seq_id, None)
        self._fused_params.pop(seq_id, None)

    def prepare_fused(
        self, rows: FusedRows, grammar: tuple[torch.Tensor, list[int]] | None
    ) -> SamplingBatch:
        """The batch of rows that all take the fused pass (``fused_rows(seqs, grammar=True)``)
        with a grammar's bitmask (``prepare``'s ``grammar``; None: no row is constrained any
        more): seeds, 1 / temperature and each row's row of the bitmask, in one copy to the
        device."""
        n = len(rows.seeds)
        staged = array("i", array("q", rows.seeds).tobytes())
        staged.frombytes(array("f", rows.inv_temperature).tobytes())
        if grammar is not None:
            staged.extend(_mask_rows(grammar[1], n))
        if self._staging is not None:
            packed = self._staging.copy(staged)
        else:
            packed = torch.frombuffer(staged, dtype=torch.int32).to(self.device)
        return SamplingBatch(
            temperature=None,
            greedy=None,
            top_k=None,
            top_p=None,
            min_p=None,
            all_greedy=False,
            any_greedy=False,
            logprobs=[None] * n,
            grammar=grammar,
            inv_temperature=packed[2 * n : 3 * n].view(torch.float32),
            seeds=packed[: 2 * n].view(torch.int64),
            mask_rows=packed[3 * n :] if grammar is not None else None,
        )

    def prepare(
        self,
        seqs: list[Sequence],
        grammar: tuple[torch.Tensor, list[int]] | None = None,
        banned: list[tuple[int, list[int]]] | None = None,
    ) -> SamplingBatch:
        """The step's per-row parameters; ``grammar``: the bitmask of the rows with structured
        outputs (``TokenMasks.to_device``); ``banned``: (row, token ids) the rows may not take
        (bad words)."""
        params: list[SamplingParams] = [s.params for s in seqs]
        vocab = self.vocab_size
        greedy = [p.temperature == 0 for p in params]
        filtered = [
            not g and (0 < p.top_k < vocab or p.top_p < 1 or p.min_p > 0)
            for p, g in zip(params, greedy)
        ]
        # Without the fused path every row takes the torch path.
        torch_rows = filtered if self.fused else [True] * len(params)
        sampled = [p for p, g, t in zip(params, greedy, torch_rows) if t and not g]
        use_top_k = any(0 < p.top_k < vocab for p in sampled)
        use_top_p = any(p.top_p < 1 for p in sampled)
        use_min_p = any(p.min_p > 0 for p in sampled)
        # Every per-row number in one host-to-device copy (float64 holds 53-bit seeds exactly).
        rows = [
            [1.0 if g else p.temperature for p, g in zip(params, greedy)],
            [float(g) for g in greedy],
        ]
        if use_top_k:
            rows.append([float(p.top_k if p.top_k > 0 else vocab) for p in params])
        if use_top_p:
            rows.append([p.top_p for p in params])
        if use_min_p:
            rows.append([p.min_p for p in params])
        if self.fused:
            rows.append([0.0 if g else 1 / p.temperature for p, g in zip(params, greedy)])
            rows.append([float(self._seed(seq)) for seq in seqs])
            rows.append([float(f) for f in filtered])
            if grammar is not None:
                rows.append([float(r) for r in _mask_rows(grammar[1], len(seqs))])
        if self._staging is not None:  # pinned: no wait for the step the device is running
            flat = array("d")
            for row in rows:
                flat.extend(row)
            packed = self._staging.copy(flat).view(len(rows), len(seqs))
        else:
            packed = torch.tensor(rows, dtype=torch.float64)
        packed = iter(packed.unbind(0))
        batch = SamplingBatch(
            temperature=next(packed).float(),
            greedy=next(packed) > 0,
            top_k=next(packed).long() if use_top_k else None,
            top_p=next(packed).float() if use_top_p else None,
            min_p=next(packed).float() if use_min_p else None,
            all_greedy=not sampled,
            any_greedy=len(sampled) < len(params),
            logprobs=[p.logprobs for p in params],
            grammar=grammar,
        )
        if self.fused:
            batch.inv_temperature = next(packed).float()
            batch.seeds = next(packed).long()
            batch.filtered = next(packed) > 0
            batch.num_filtered = sum(filtered)
            if grammar is not None:
                batch.mask_rows = next(packed).int()
        dev = self.device
        constrained = set(grammar[1]) if grammar is not None else ()
        for row, (seq, p) in enumerate(zip(seqs, params)):
            # (a grammar's end, where only a stop token may come, wins over min_tokens)
            if (
                seq.num_output_tokens < p.min_tokens
                and seq.stop_token_ids
                and row not in constrained
            ):
                batch.masks.append((row, sorted(seq.stop_token_ids)))
            if p.logit_bias:
                batch.biases.append((row, list(p.logit_bias), list(p.logit_bias.values())))
            if p.allowed_token_ids:
                batch.allowed.append((row, list(p.allowed_token_ids)))
            if p.seed is not None and not greedy[row] and torch_rows[row]:
                gen = self._generators.get(seq.seq_id)
                if gen is None:
                    gen = torch.Generator(device=dev).manual_seed(p.seed)
                    if not seq.is_finished:  # (released already: a step in flight finished it)
                        self._generators[seq.seq_id] = gen
                batch.seeded.append((row, gen))
        if any(
            p.repetition_penalty != 1 or p.presence_penalty or p.frequency_penalty for p in params
        ):
            batch.penalties = tuple(
                torch.tensor([getattr(p, name) for p in params], dtype=torch.float32).to(dev)
                for name in ("repetition_penalty", "presence_penalty", "frequency_penalty")
            )
            out_rows, out_ids, prompt_rows, prompt_ids = [], [], [], []
            for row, (seq, p) in enumerate(zip(seqs, params)):
                if p.repetition_penalty != 1 or p.presence_penalty or p.frequency_penalty:
                    output = seq.output_token_ids
                    out_rows += [row] * len(output)
                    out_ids += output
                    if p.repetition_penalty != 1:
                        prompt = seq.prompt_token_ids
                        prompt_rows += [row] * len(prompt)
                        prompt_ids += prompt
            batch.penalty_tokens = (out_rows, out_ids, prompt_rows, prompt_ids)
        batch.masks.extend((row, ids) for row, ids in banned or () if ids)
        return batch

    def _seed(self, seq: Sequence) -> int:
        """A row's Philox seed for this step (53 bits): from the request's seed and its
        position when seeded, else fresh."""
        if seq.params.seed is None:
            return self._rng.getrandbits(53)
        return hash((seq.params.seed, seq.num_output_tokens)) & ((1 << 53) - 1)

    def __call__(
        self, logits: torch.Tensor, batch: SamplingBatch
    ) -> tuple[list[int], list[Logprob | None]]:
        """logits [S, V] -> one token id per row, and the requested log-probabilities."""
        return self.sample(logits, batch).result()

    @torch.inference_mode()  # the logits are the runner's inference tensors
    def sample(self, logits: torch.Tensor, batch: SamplingBatch) -> SampledTokens:
        """Draw a token per row of logits [S, V] on the device; ``result()`` brings them over."""
        want_logprobs = any(k is not None for k in batch.logprobs)
        fused_only = batch.seeds is not None and batch.num_filtered == 0
        in_float = (
            not fused_only
            or want_logprobs
            or batch.masks
            or batch.penalties is not None
            or batch.biases
            or batch.allowed
        )
        # A grammar's bitmask: applied to the float32 logits, or read by the fused pass itself.
        grammar = batch.grammar if in_float else None
        in_pass = () if in_float or batch.grammar is None else (batch.grammar[0], batch.mask_rows)
        if in_float:
            logits = logits.float()  # the fused pass reads the model's dtype as it is
        raw_logprobs = torch.log_softmax(logits, dim=-1) if want_logprobs else None
        for row, ids, values in batch.biases:
            logits[row, ids] += torch.tensor(values, device=logits.device)
        for row, ids in batch.allowed:
            kept = logits[row, ids]
            logits[row] = float("-inf")
            logits[row, ids] = kept
        for row, ids in batch.masks:
            logits[row, ids] = float("-inf")
        if grammar is not None:
            from nano_engine.structured import apply_masks

            apply_masks(logits, grammar)
        if batch.penalties is not None:
            logits = self._penalize(logits, batch)
        if fused_only:
            tokens = gumbel.gumbel_argmax(logits, batch.inv_temperature, batch.seeds, *in_pass)
        else:
            tokens = self._torch_sample(logits, batch)
            if batch.seeds is not None:  # some rows have filters: the rest take the fused pass
                fused = gumbel.gumbel_argmax(logits, batch.inv_temperature, batch.seeds)
                tokens = torch.where(batch.filtered, tokens, fused)
        if raw_logprobs is None:
            host = self._hosts.next(tokens.shape[0]) if self._hosts is not None else None
            return SampledTokens(tokens, batch.logprobs, host=host)
        k = max(w for w in batch.logprobs if w is not None)
        chosen = raw_logprobs.gather(-1, tokens[:, None])[:, 0]
        top = (
            raw_logprobs.topk(k, dim=-1) if k else (chosen[:, None][:, :0], tokens[:, None][:, :0])
        )
        return SampledTokens(tokens, batch.logprobs, (chosen, *top))

    def _torch_sample(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        if batch.all_greedy:
            return logits.argmax(dim=-1)
        if batch.any_greedy:
            return torch.where(batch.greedy, logits.argmax(dim=-1), self._draw(logits, batch))
        return self._draw(logits, batch)

    def _penalize(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        repetition, presence, frequency = batch.penalties
        out_rows, out_ids, prompt_rows, prompt_ids = batch.penalty_tokens
        dev = logits.device
        counts = torch.zeros_like(logits)
        if out_ids:
            index = (torch.tensor(out_rows, device=dev), torch.tensor(out_ids, device=dev))
            counts.index_put_(index, torch.ones(len(out_ids), device=dev), accumulate=True)
        seen = counts > 0
        if prompt_ids:
            seen[torch.tensor(prompt_rows, device=dev), torch.tensor(prompt_ids, device=dev)] = True
        rep = repetition[:, None]
        logits = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
        return logits - frequency[:, None] * counts - presence[:, None] * (counts > 0)

    def _draw(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        probs = torch.softmax(logits / batch.temperature[:, None], dim=-1)
        if batch.top_k is not None or batch.top_p is not None:
            sorted_probs, order = probs.sort(dim=-1, descending=True)
            drop = torch.zeros_like(sorted_probs, dtype=torch.bool)
            if batch.top_k is not None:
                ranks = torch.arange(probs.shape[-1], device=probs.device)
                drop |= ranks[None, :] >= batch.top_k[:, None]
            if batch.top_p is not None:
                # Keep the smallest prefix whose mass reaches top_p of what top-k kept (the
                # first token always), as vLLM and transformers do.
                kept = sorted_probs.masked_fill(drop, 0)
                before = kept.cumsum(dim=-1) - kept
                drop |= before >= batch.top_p[:, None] * kept.sum(dim=-1, keepdim=True)
            probs = probs.scatter(-1, order, sorted_probs.masked_fill(drop, 0))
        if batch.min_p is not None:
            floor = batch.min_p[:, None] * probs.max(dim=-1, keepdim=True).values
            probs = probs.masked_fill(probs < floor, 0)
        noise = torch.empty_like(probs).exponential_()
        for row, gen in batch.seeded:
            noise[row].exponential_(generator=gen)
        return (probs / noise).argmax(dim=-1)


@torch.inference_mode()
def prompt_logprobs(logits: torch.Tensor, targets: list[int], k: int) -> tuple[torch.Tensor, ...]:
    """For logits [P, V] of the positions before prompt tokens ``targets``: each target's
    logprob, its rank (1: the likeliest), and the top ``k`` logprobs and ids, on the device."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    index = torch.tensor(targets, device=logits.device)[:, None]
    chosen = logprobs.gather(-1, index)
    rank = (logprobs > chosen).sum(-1) + 1
    values, ids = logprobs.topk(k, dim=-1) if k else (chosen[:, :0], index[:, :0])
    return chosen[:, 0], rank, values, ids


def _mask_rows(rows: list[int], n: int) -> list[int]:
    """For each of ``n`` logits rows, its row of a bitmask holding ``rows`` (-1: none)."""
    index = [-1] * n
    for i, row in enumerate(rows):
        index[row] = i
    return index


class SampledTokens:
    """One step's draws. On CUDA their copy to pinned host memory is queued behind the draw,
    so the host can schedule and launch the next step before reading them."""

    def __init__(
        self,
        tokens: torch.Tensor,
        wanted: list[int | None],
        logprobs: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
        host: torch.Tensor | None = None,
    ) -> None:
        """``host``: a pinned int64 buffer of at least S for the tokens (without logprobs)."""
        self.tokens = tokens  # [S] int64, on the device: the next step's inputs
        self._wanted = wanted
        self._host = [tokens] if logprobs is None else [tokens, *logprobs]
        self._ready = None
        if tokens.is_cuda:
            if host is not None and logprobs is None:
                self._host = [host[: tokens.shape[0]]]
                self._host[0].copy_(tokens, non_blocking=True)
            else:
                self._host = [t.to("cpu", non_blocking=True) for t in self._host]
            self._ready = torch.cuda.Event()
            self._ready.record()

    def result(self) -> tuple[list[int], list[Logprob | None]]:
        """The token ids, and a ``Logprob`` per row that asked for them (waits for the device)."""
        if self._ready is not None:
            self._ready.synchronize()
        token_list = self._host[0].tolist()
        if len(self._host) == 1:
            return token_list, [None] * len(token_list)
        chosen, top_values, top_ids = (t.tolist() for t in self._host[1:])
        out: list[Logprob | None] = []
        for row, w in enumerate(self._wanted):
            if w is None:
                out.append(None)
                continue
            out.append(
                Logprob.of(token_list[row], chosen[row], top_ids[row][:w], top_values[row][:w])
            )
        return token_list, out


class _HostTokens:
    """Pinned buffers for sampled tokens, used in turn. The engine's loop takes one per step
    and reads it (``result``) in the next iteration, before the step after takes another: with
    three, a buffer is never written while its tokens are still unread."""

    def __init__(self, slots: int = 3) -> None:
        self._buffers = [torch.empty(0, dtype=torch.int64) for _ in range(slots)]
        self._next = 0

    def next(self, rows: int) -> torch.Tensor:
        slot = self._next
        self._next = (slot + 1) % len(self._buffers)
        if self._buffers[slot].numel() < rows:
            size = max(rows, 256)
            self._buffers[slot] = torch.empty(size, dtype=torch.int64, pin_memory=True)
        return self._buffers[slot]
