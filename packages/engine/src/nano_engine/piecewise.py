"""Piecewise CUDA graphs: the forward of a step whose attention runs outside a graph (prefill
chunks, mixed steps) as graphs of the pieces between attention calls.

An eager forward launches ~10 kernels a layer from Python, each behind torch's dispatcher (and
torch.compile's guards for the norms and activations): 20-30 ms of host time for any step of
Qwen3-0.6B on an H200, while its device time is 1-30 ms, so the device waits for the host.
Here the model's pieces (``model.piece``: embedding, then per layer the output projection, norms,
MLP and the next layer's q, k, v with K/V to the cache) are captured once per token count of
``piecewise_graph_sizes``; a step pads its tokens to the next size, replays piece 0, runs
attention 0 eagerly (it needs the step's host-side layout) into a fixed buffer that piece 1
reads, and so on: a graph launch and an attention call per layer.

The pieces of every size share one memory pool. What a piece returns is kept as an alias that
does not hold the memory (``_alias``): each size's intermediate tensors live only while its
pieces are captured, so the pool is as large as one forward of the largest size, and a later
capture reuses memory that an earlier size's replay reads only before anything else runs.
Padding tokens take slot -1 (nothing stored) and position 0; their rows are computed and
dropped.
"""

from __future__ import annotations

import bisect
import logging
import time
from typing import TYPE_CHECKING

import torch

from nano_models import ForwardContext
from nano_scheduler import piecewise_graph_sizes

if TYPE_CHECKING:
    from nano_engine.model_runner import ModelRunner

log = logging.getLogger("nano_engine")


def _alias(t: torch.Tensor) -> torch.Tensor:
    """A tensor over ``t``'s memory that does not keep that memory allocated (a private torch
    API, no public one makes a non-owning storage; the graphs' pool keeps the memory)."""
    storage = t.untyped_storage()
    alias = torch._C._construct_storage_from_data_pointer(
        storage.data_ptr(), t.device, storage.nbytes()
    )
    return torch.empty((), dtype=t.dtype, device=t.device).set_(
        alias, t.storage_offset(), t.shape, t.stride()
    )


class PiecewiseGraphs:
    """One graph per piece of the forward and per size of ``piecewise_graph_sizes(max_tokens)``
    (see the module docstring); ``run`` replays the pieces of the smallest size that holds a
    step, with the attention calls between them."""

    def __init__(self, runner: ModelRunner, max_tokens: int) -> None:
        model, dev = runner.model, runner.device
        self.model, self.attention = model, model.attention_layers
        self.sizes = piecewise_graph_sizes(max_tokens)
        biggest = self.sizes[-1]
        attn = self.attention[0]
        self.ids = torch.zeros(biggest, dtype=torch.int32, device=dev)
        self.positions = torch.zeros(biggest, dtype=torch.int64, device=dev)
        self.slots = torch.full((biggest,), -1, dtype=torch.int64, device=dev)
        self.attn_out = torch.zeros(
            biggest, attn.num_heads, attn.head_dim, dtype=runner.dtype, device=dev
        )
        # size -> its graphs, one per piece, and the pieces' outputs: (q, k, v) for each
        # attention call, then the hidden states [size, hidden] (aliases, see _alias)
        self.graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}
        self.outputs: dict[int, list] = {}
        start = time.perf_counter()
        self.pool = torch.cuda.graph_pool_handle()
        try:
            with torch.inference_mode():
                for size in reversed(self.sizes):
                    self._capture(size)
            torch.cuda.synchronize(dev)
        except BaseException:  # (NCCL's destroy waits for graphs that captured a collective)
            self.release()
            raise
        log.info(
            "captured piecewise CUDA graphs of %d pieces for %d token counts (%d..%d) in %.1f s",
            model.num_pieces,
            len(self.sizes),
            self.sizes[0],
            biggest,
            time.perf_counter() - start,
        )

    def _context(self, size: int) -> ForwardContext:
        """What the pieces of ``size`` tokens read of a step's context: the slots. The rest
        belongs to attention, which runs outside the graphs (None here: a piece that read it
        would fail at capture)."""
        return ForwardContext(
            num_prefills=0,
            num_prefill_tokens=0,
            num_decodes=0,
            query_start_loc=None,
            seq_lens=None,
            block_tables=None,
            slot_mapping=self.slots[:size],
            logits_indices=None,
            query_start_loc_cpu=[],
            seq_lens_cpu=[],
            max_query_len=0,
            max_seq_len=0,
        )

    def _capture(self, size: int) -> None:
        ctx, positions, out = self._context(size), self.positions[:size], self.attn_out[:size]
        model = self.model
        state = self.ids[:size]  # (warm-up first: compilations and autotuning happen outside)
        for i in range(model.num_pieces - 1):
            *_, state = model.piece(i, positions, state, out, ctx)
        model.piece(model.num_pieces - 1, positions, state, out, ctx)
        graphs, outputs, state = [], [], self.ids[:size]
        for i in range(model.num_pieces):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                result = model.piece(i, positions, state, out, ctx)
            graphs.append(graph)
            if i < model.num_pieces - 1:
                *qkv, state = result
                outputs.append(tuple(_alias(t) for t in qkv))
            else:
                outputs.append(_alias(result))
        self.graphs[size], self.outputs[size] = graphs, outputs

    def fits(self, num_tokens: int) -> bool:
        return num_tokens <= self.sizes[-1]

    def size_for(self, num_tokens: int) -> int:
        """The token count of the graphs a step of ``num_tokens`` runs in."""
        return self.sizes[bisect.bisect_left(self.sizes, num_tokens)]

    def run(self, ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """The hidden states [T, hidden] of a step of T tokens: ``ids`` [T] and ``positions``,
        ``ctx.slot_mapping`` [size] (``size_for(T)``, -1 and 0 past T). A view of the graphs'
        memory, valid until the next step is launched."""
        t = ids.shape[0]
        size = self.size_for(t)
        self.ids[:t].copy_(ids)
        self.positions[:size].copy_(positions)
        self.slots[:size].copy_(ctx.slot_mapping)
        graphs, outputs = self.graphs[size], self.outputs[size]
        out = self.attn_out[:t]
        for graph, (q, k, v), attn in zip(graphs, outputs, self.attention):
            graph.replay()
            attn(q[:t], k[:t], v[:t], ctx, out=out)
        graphs[-1].replay()
        return outputs[-1][:t]

    def release(self) -> None:
        for graphs in self.graphs.values():
            for graph in graphs:
                graph.reset()
        self.graphs.clear()
        self.outputs.clear()
