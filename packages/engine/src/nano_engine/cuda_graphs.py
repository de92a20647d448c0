"""CUDA graphs of decode-only steps: inputs, model, LM head and sampling in one replay.

The host's part of a decode step is kept to a little Python, one copy and one replay. It
writes the step as one int32 array (below) into a pinned buffer, one copy brings it to the
device, and one replay unpacks it (token ids, the previous step's
tokens where the inputs are still pending, positions, block tables, cache slots), runs the
model and the LM head, and, when the step's rows take the fused sampling pass (no top-k,
top-p, min-p, logprobs, penalties or min_tokens), draws the tokens too, into ``sampled``,
where the next step's pending inputs read them.

The staged array of a graph of S rows (b real, the rest padding that writes nowhere):

    seeds int64 [S] | 1 / temperature float32 [S] | ids [S] | previous-token row [S] (-1: the
    id is given) | context length [S] (0 for padding) | decode order [S] | w | b |
    block tables [b, w] (w: the longest table of the step)
"""

from __future__ import annotations

import logging
import time
from array import array
from typing import TYPE_CHECKING

import torch

from nano_engine import gumbel
from nano_engine.staging import PinnedStaging
from nano_models import ForwardContext
from nano_models.context import longest_first
from nano_scheduler import cuda_graph_sizes

if TYPE_CHECKING:
    from nano_engine.model_runner import ModelRunner, StepInput
    from nano_engine.sampler import FusedRows

log = logging.getLogger("nano_engine")

_ZERO_Q = array("q", [0])


class DecodeGraphs:
    """One graph per batch size 1, 2, 4, 8, 16, 32, ... up to max_num_seqs, sharing one memory
    pool; a batch runs in the smallest that fits it. ``sample``: draw in the graph (rank 0)."""

    def __init__(
        self, runner: ModelRunner, max_num_seqs: int, staging: PinnedStaging, sample: bool = True
    ) -> None:
        self.runner, self.staging = runner, staging
        self.sizes = cuda_graph_sizes(max_num_seqs)
        self.block_size = runner.block_size
        self.width = -(-runner.max_model_len // runner.block_size)
        biggest = self.sizes[-1]
        dev = runner.device
        self.inputs = torch.zeros(7 * biggest + 2 + biggest * self.width, dtype=torch.int32)
        self.inputs = self.inputs.to(dev)
        self.sampled = torch.zeros(biggest, dtype=torch.int64, device=dev)
        self._sample = sample
        # size -> (graph, its logits [size, vocab] or None (TP workers), whether it draws)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor | None, bool]] = {}
        start = time.perf_counter()
        pool = None
        try:
            for size in reversed(self.sizes):
                with torch.inference_mode():
                    self._forward(size)  # warm-up (compilation)
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=pool):
                        logits, drawn = self._forward(size)
                pool = graph.pool() if pool is None else pool
                self.graphs[size] = (graph, logits, drawn)
            torch.cuda.synchronize(dev)
        except BaseException:  # (the traceback would keep them, and NCCL waits for them)
            self.release()
            raise
        log.info(
            "captured %d decode CUDA graphs (batch %d..%d) in %.1f s",
            len(self.sizes),
            self.sizes[0],
            biggest,
            time.perf_counter() - start,
        )

    def _forward(self, size: int) -> tuple[torch.Tensor | None, bool]:
        """What a replay of the graph of ``size`` rows runs (see the module docstring)."""
        ids, positions, ctx, inv_temperature, seeds = unpack(
            self.inputs, size, self.block_size, self.width, self.sampled, self.runner.max_model_len
        )
        model = self.runner.model
        logits = model.compute_logits(model(ids, positions, ctx), ctx)
        if logits is None or not self._sample:
            return logits, False
        self.sampled[:size].copy_(gumbel.gumbel_argmax(logits, inv_temperature, seeds))
        return logits, True

    def fits(self, step: StepInput) -> bool:
        return len(step.query_lens) <= self.sizes[-1]

    def release(self) -> None:
        for graph, _, _ in self.graphs.values():
            graph.reset()
        self.graphs.clear()

    def run(
        self,
        step: StepInput,
        previous: torch.Tensor | None = None,
        sampling: FusedRows | None = None,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Replay a decode step: (logits [b, vocab] or None, tokens [b] drawn in the graph or
        None; both views of the graph's buffers, valid until the next replay). ``previous``:
        the previous step's tokens, where some inputs are pending; ``sampling``: the rows'
        ``FusedRows`` when they all take the fused pass."""
        if step.pending_rows and previous is None:
            raise ValueError("the step has pending inputs but no previous sampled tokens")
        b = len(step.query_lens)
        size = next(s for s in self.sizes if s >= b)
        staged = stage(step, size, sampling)
        self.staging.copy(staged, self.inputs)
        if (
            previous is not None
            and step.pending_rows
            and previous.data_ptr() != self.sampled.data_ptr()
        ):
            self.sampled[: previous.shape[0]].copy_(previous)
        graph, logits, drawn = self.graphs[size]
        graph.replay()
        tokens = self.sampled[:b] if drawn and sampling is not None else None
        return (logits[:b] if logits is not None else None), tokens


def stage(step: StepInput, size: int, sampling: FusedRows | None = None) -> array:
    """A decode-only ``StepInput`` of b <= ``size`` rows as the int32 array a graph of
    ``size`` rows reads (the module docstring's layout); ``sampling``: its ``FusedRows``."""
    b = len(step.query_lens)
    pad = size - b
    seeds = array("q", sampling.seeds) if sampling is not None else _ZERO_Q * b
    seeds.extend(_ZERO_Q * pad)
    staged = array("i", seeds.tobytes())
    staged.frombytes(bytes(4 * size))  # 1 / temperature: 0 (argmax) unless drawn for
    if sampling is not None:
        inv = array("f", sampling.inv_temperature)
        staged[2 * size : 2 * size + b] = array("i", inv.tobytes())
    staged.extend(step.input_ids)
    staged.extend([0] * pad)
    rows = [-1] * size
    for position, row in zip(step.pending_positions, step.pending_rows):
        rows[position] = row
    staged.extend(rows)
    staged.extend(step.seq_lens)
    staged.extend([0] * pad)
    staged.extend(longest_first(step.seq_lens))
    staged.extend(range(b, size))
    width = max(len(t) for t in step.block_tables)
    staged.extend((width, b))
    fill = array("i", [-1]) * width
    for table in step.block_tables:
        staged.extend(table)
        staged.extend(fill[len(table) :])
    return staged


def unpack(
    staged: torch.Tensor,
    size: int,
    block_size: int,
    width: int,
    sampled: torch.Tensor,
    max_model_len: int,
) -> tuple[torch.Tensor, torch.Tensor, ForwardContext, torch.Tensor, torch.Tensor]:
    """The device side of ``stage``, in torch ops a graph captures: (ids int32 [size],
    positions int64 [size], the ForwardContext with block tables [size, width], 1 / temperature
    float32 [size], seeds int64 [size]). ``sampled``: the previous step's tokens, which the
    pending inputs take."""
    s, bs, dev = size, block_size, staged.device
    seeds = staged[: 2 * s].view(torch.int64)
    inv_temperature = staged[2 * s : 3 * s].view(torch.float32)
    ids, previous, lens, order = (staged[k * s : (k + 1) * s] for k in range(3, 7))
    used, real = staged[7 * s], staged[7 * s + 1]
    tables_in = staged[7 * s + 2 :]
    rows = torch.arange(s + 1, dtype=torch.int32, device=dev)
    cols = torch.arange(width, dtype=torch.int32, device=dev)[None, :]
    index = (rows[:s, None] * used + cols).clamp_(max=tables_in.numel() - 1).long()
    # -1 past each row's table and in the padding rows (a backend may read the whole width)
    tables = torch.where((cols < used) & (rows[:s, None] < real), tables_in[index], -1)
    positions = (lens - 1).clamp(min=0).long()
    blocks = tables.gather(1, (positions // bs)[:, None])[:, 0].long()
    slots = torch.where(lens > 0, blocks * bs + positions % bs, -1)
    pending = sampled[previous.clamp(min=0).long()].to(torch.int32)
    ids = torch.where(previous >= 0, pending, ids)
    ctx = ForwardContext(
        num_prefills=0,
        num_prefill_tokens=0,
        num_decodes=s,
        query_start_loc=rows,
        seq_lens=lens,
        block_tables=tables,
        slot_mapping=slots,
        logits_indices=rows[:s].long(),
        query_start_loc_cpu=list(range(s + 1)),
        seq_lens_cpu=[0] * s,
        max_query_len=1,
        max_seq_len=max_model_len,
        decode_order=order,
    )
    return ids, positions, ctx, inv_temperature, seeds
