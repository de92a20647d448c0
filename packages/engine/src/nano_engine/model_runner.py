"""The model on one device: weights, KV cache, step inputs, CUDA graphs; rank 0 also samples.

A step travels as a ``StepInput`` of plain lists (what tensor-parallel workers receive); each
rank turns it into device tensors with one host-to-device copy and computes slots and
positions on the device (``nano_kvcache.ops.compute_slot_mapping``).
"""

from __future__ import annotations

import gc
import logging
import time
from array import array
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from nano_engine import gumbel
from nano_engine.config import EngineConfig
from nano_engine.cuda_graphs import DecodeGraphs
from nano_engine.piecewise import PiecewiseGraphs
from nano_engine.sampler import FusedRows
from nano_engine.staging import PinnedStaging
from nano_kvcache import ops
from nano_kvcache.layout import KVCacheLayout
from nano_models import ForwardContext, ModelConfig, TensorParallel, get_attention_backend
from nano_models.compile import compile_layers
from nano_models.context import longest_first
from nano_models.layers.attention import choose_attention_backend
from nano_models.loader import load_model
from nano_scheduler import PENDING_TOKEN, SchedulerOutput

log = logging.getLogger("nano_engine")


@dataclass
class StepInput:
    """One step's batch as plain data: prefill chunks first, then decodes."""

    input_ids: list[int]
    query_lens: list[int]
    seq_lens: list[int]  # context length of each sequence after the step
    block_tables: list[list[int]]
    num_prefills: int
    logits_rows: list[int]  # rows of the hidden states that are sampled
    # Inputs still being sampled by the previous step (async scheduling): input_ids[position]
    # is that step's sampled token of row ``row``.
    pending_positions: list[int] = field(default_factory=list)
    pending_rows: list[int] = field(default_factory=list)
    # Rows whose logits give prompt logprobs: row i holds those of prompt token
    # prompt_slots[i] = (seq_id, position), from the hidden state of the token before it.
    prompt_rows: list[int] = field(default_factory=list)
    prompt_slots: list[tuple[int, int]] = field(default_factory=list)

    @classmethod
    def of(cls, out: SchedulerOutput, previous_rows: dict[int, int] | None = None) -> StepInput:
        """The step's inputs; ``previous_rows`` maps the seq_id of each sequence whose last token
        is still a placeholder to its row in the previous step's sampled tokens."""
        ids, query_lens, seq_lens, tables, rows = [], [], [], [], []
        positions, pending_rows, prompt_rows, prompt_slots = [], [], [], []
        for chunk in out.prefills:
            seq, end = chunk.seq, chunk.start + chunk.num_tokens
            if seq.params.prompt_logprobs is not None:
                for position in range(chunk.start + 1, min(end + 1, seq.num_prompt_tokens)):
                    prompt_rows.append(len(ids) + position - 1 - chunk.start)
                    prompt_slots.append((seq.seq_id, position))
            ids += seq.token_ids[chunk.start : end]
            query_lens.append(chunk.num_tokens)
            seq_lens.append(end)
            tables.append(seq.block_table)
            if chunk.samples:
                rows.append(len(ids) - 1)
                if ids[-1] == PENDING_TOKEN:  # a preempted sequence, back before its token
                    positions.append(len(ids) - 1)
                    pending_rows.append(previous_rows[seq.seq_id])
        first = len(ids)
        for seq in out.decodes:
            token = seq.token_ids[-1]
            if token == PENDING_TOKEN:
                positions.append(len(ids))
                pending_rows.append(previous_rows[seq.seq_id])
            ids.append(token)
            seq_lens.append(len(seq.token_ids))
            tables.append(seq.block_table)
        num_decodes = len(out.decodes)
        query_lens += [1] * num_decodes
        rows += range(first, first + num_decodes)
        return cls(
            ids,
            query_lens,
            seq_lens,
            tables,
            len(out.prefills),
            rows,
            positions,
            pending_rows,
            prompt_rows,
            prompt_slots,
        )


class StepResult(NamedTuple):
    """What ``ModelRunner.execute`` returns: the logits of the sampled rows [S, vocab] (rank 0;
    None elsewhere) and, when a CUDA graph drew them, the tokens [S] int64 on the device. A
    graph's are views of its buffers: valid until the next step is launched."""

    logits: torch.Tensor | None
    tokens: torch.Tensor | None = None
    prompt_logits: torch.Tensor | None = None  # [P, vocab] of ``StepInput.prompt_rows``


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("device 'cuda' was asked for but torch sees no CUDA GPU")
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(name)


def resolve_dtype(name: str, model_config: ModelConfig, device: torch.device) -> torch.dtype:
    if name != "auto":
        return getattr(torch, name)  # (EngineConfig checked it: float32, float16 or bfloat16)
    # Half precision matmuls are slow or missing on many CPUs: float32 there.
    return model_config.dtype if device.type == "cuda" else torch.float32


class ModelRunner:
    def __init__(
        self,
        config: EngineConfig,
        model_config: ModelConfig,
        device: torch.device,
        tp: TensorParallel,
        max_model_len: int,
    ) -> None:
        self.config, self.model_config, self.device, self.tp = config, model_config, device, tp
        self.block_size = config.kvcache_block_size
        self.max_model_len = max_model_len
        if device.type == "cuda":
            torch.cuda.set_device(device)
        self.dtype = resolve_dtype(config.dtype, model_config, device)
        if config.fp8_kv_cache and device.type == "cuda":  # (before minutes of loading)
            major, minor = torch.cuda.get_device_capability(device)
            if (major, minor) < (8, 9):
                raise ValueError(
                    "an FP8 KV cache needs a GPU of compute capability 8.9 or later (Ada, "
                    f"Hopper: its kernels convert to and from e4m3); this one is {major}.{minor}: "
                    "kv_cache_dtype auto"
                )
        torch.manual_seed(config.seed)
        start = time.perf_counter()
        source = model_config if config.load_format == "dummy" else config.model
        self.model, report = load_model(
            source,
            dtype=self.dtype,
            device=device,
            tp=tp,
            load_format=config.load_format,
            seed=config.seed,
            quantization=config.quantization,
            quantize_lm_head=config.quantize_lm_head,
            max_len=max_model_len,
        )
        log.info(
            "rank %d: loaded %s (%s, %.1f GB read) in %.1f s",
            tp.rank,
            model_config.architecture,
            self.dtype,
            report.bytes_read / 1e9,
            time.perf_counter() - start,
        )
        # (a model whose shapes follow its data, as the torch experts of a mixture, runs eagerly)
        self.eager = config.enforce_eager or not getattr(self.model, "supports_cuda_graphs", True)
        if self.eager and not config.enforce_eager:
            log.info("%s runs without CUDA graphs", model_config.architecture)
        if device.type == "cuda" and not self.eager:
            compile_layers(self.model)
        kv_dtype = torch.float8_e4m3fn if config.fp8_kv_cache else self.dtype
        backend = choose_attention_backend(
            config.attention_backend, device, self.block_size, self.dtype, config.fp8_kv_cache
        )
        self.backend = get_attention_backend(backend)
        log.info(
            "rank %d: attention backend %s (asked: %s)", tp.rank, backend, config.attention_backend
        )
        self.graphs: DecodeGraphs | None = None
        self.pieces: PiecewiseGraphs | None = None
        # (the scheduler's budget: a decode step of every sequence always fits)
        self.max_num_batched_tokens = max(config.max_num_batched_tokens, config.max_num_seqs)
        self.staging = PinnedStaging(device) if device.type == "cuda" else None
        attn = self.model.attention_layers[0]
        self.layout = KVCacheLayout(
            model_config.num_hidden_layers,
            attn.num_kv_heads,
            model_config.head_dim,
            self.block_size,
            kv_dtype,
        )
        self.num_blocks = self._size_kv_cache()
        self.kv_cache = self.layout.allocate(self.num_blocks, device)
        self.model.bind_kv_cache(self.kv_cache, self.backend)
        if device.type == "cuda" and config.num_kvcache_blocks is not None:
            self._warm_up_prefill()  # no sizing run did (the cache holds max_model_len tokens)
        log.info(
            "rank %d: KV cache of %d blocks x %d tokens = %d tokens (%.2f GB), attention "
            "backend %s",
            tp.rank,
            self.num_blocks,
            self.block_size,
            self.num_blocks * self.block_size,
            self.num_blocks * self.layout.bytes_per_block / 1e9,
            self.backend.name,
        )
        try:
            self._capture_graphs()
            if device.type == "cuda":
                self._warm_up_logits()  # (tensor-parallel: a gather on every rank)
        except BaseException:  # (a graph that captured a collective holds NCCL's destroy)
            self.release_graphs()
            raise

    def _capture_graphs(self) -> None:
        config, device = self.config, self.device
        if device.type == "cuda" and not self.eager:
            if self.backend.supports_cuda_graphs:
                draw = self.tp.rank == 0 and gumbel.available(device)  # (workers get rank 0's)
                self.graphs = DecodeGraphs(self, config.max_num_seqs, self.staging, sample=draw)
            else:
                log.info(
                    "attention backend %s cannot run in CUDA graphs: eager decode",
                    self.backend.name,
                )
        if self.piecewise:
            self.pieces = PiecewiseGraphs(self, self.max_num_batched_tokens)

    # ---- KV cache sizing ---------------------------------------------------------------------

    def _size_kv_cache(self) -> int:
        """Blocks that fit this process's memory budget, the same on every rank (their min)."""
        cfg = self.config
        if cfg.num_kvcache_blocks is not None:
            blocks = cfg.num_kvcache_blocks
        elif self.device.type == "cuda":
            blocks = self._blocks_from_gpu_memory()
        else:
            blocks = int((cfg.kv_cache_memory_gb or 1.0) * 1e9 // self.layout.bytes_per_block)
        if self.tp.size > 1:
            count = torch.tensor([blocks], device=self.device)
            torch.distributed.all_reduce(count, torch.distributed.ReduceOp.MIN, group=self.tp.group)
            blocks = int(count.item())
        needed = -(-self.max_model_len // self.block_size)
        if blocks < needed:
            if cfg.num_kvcache_blocks is not None:
                more = "num_kvcache_blocks (--num-kvcache-blocks)"
            elif self.device.type == "cuda":
                more = "gpu_memory_utilization (--gpu-memory-utilization)"
            else:
                more = "kv_cache_memory_gb (--kv-cache-memory-gb; default 1 on the CPU)"
            raise ValueError(
                f"the KV cache holds {blocks} blocks of {self.block_size} tokens, fewer than one "
                f"sequence of max_model_len {self.max_model_len} needs ({needed}); raise "
                f"{more}, or lower max_model_len (--max-model-len)"
            )
        return blocks

    def _blocks_from_gpu_memory(self) -> int:
        """Warm up at the largest batch with a small temporary cache and measure the peak of
        this process (weights, activations, sampler), plus the activations of the largest
        captured decode batch (the CUDA-graph pool); the rest of the budget is KV cache."""
        cfg = self.config
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        num_seqs = cfg.max_num_seqs
        tokens = min(self.max_num_batched_tokens, num_seqs * self.max_model_len)
        lens = [tokens // num_seqs + (i < tokens % num_seqs) for i in range(num_seqs)]
        lens = [n for n in lens if n]
        temp_blocks = sum(-(-n // self.block_size) for n in lens)
        temp = self.layout.allocate(temp_blocks, self.device)
        self.model.bind_kv_cache(temp, self.backend)
        base = torch.cuda.memory_allocated(self.device)
        tables, next_block = [], 0
        for n in lens:
            count = -(-n // self.block_size)
            tables.append(list(range(next_block, next_block + count)))
            next_block += count
        ids = [0] * sum(lens)
        rows = [sum(lens[: i + 1]) - 1 for i in range(len(lens))]
        logits = self.execute(StepInput(ids, lens, lens, tables, len(lens), rows)).logits
        # The piecewise graphs' pool holds the activations of a forward of the most tokens.
        pieces_reserve = torch.cuda.max_memory_allocated(self.device) - base
        pieces_reserve = pieces_reserve if self.piecewise else 0
        if logits is not None:  # the sampler's working set at the largest batch
            probs = torch.softmax(logits.float(), -1)
            probs.sort(dim=-1, descending=True)
            del probs
        del logits
        self._warm_up_prefill()
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        graph_reserve = 0
        if not self.eager:
            torch.cuda.reset_peak_memory_stats(self.device)
            base = torch.cuda.memory_allocated(self.device)
            batch = min(cfg.max_num_seqs, len(tables))
            width = -(-self.max_model_len // self.block_size)
            step = StepInput(
                [0] * batch, [1] * batch, [1] * batch, [[0] * width] * batch, 0, list(range(batch))
            )
            self.execute(step)
            torch.cuda.synchronize(self.device)
            graph_reserve = torch.cuda.max_memory_allocated(self.device) - base
        del temp
        self.model.bind_kv_cache(self.layout.allocate(1, self.device), self.backend)
        torch.cuda.empty_cache()
        total = torch.cuda.get_device_properties(self.device).total_memory
        temp_bytes = temp_blocks * self.layout.bytes_per_block
        graph_reserve += pieces_reserve
        budget = total * cfg.gpu_memory_utilization - (peak - temp_bytes) - graph_reserve
        log.info(
            "rank %d: memory peak %.2f GB (temporary cache %.2f GB), CUDA-graph reserve "
            "%.2f GB (piecewise %.2f GB), budget %.2f GB of %.2f GB",
            self.tp.rank,
            peak / 1e9,
            temp_bytes / 1e9,
            graph_reserve / 1e9,
            pieces_reserve / 1e9,
            total * cfg.gpu_memory_utilization / 1e9,
            total / 1e9,
        )
        return max(0, int(budget // self.layout.bytes_per_block))

    def _warm_up_prefill(self) -> None:
        """Run single prompt chunks of 64 and 1,024 tokens and of the longest a step can hold,
        each fresh and after a cached token (a prefix hit, a later chunk), so that no kernel
        variant (prefill tiles, cached keys or none) and no allocation a prompt needs comes
        first in mid-serving. Writes the first blocks of the bound cache."""
        longest = max(2, min(self.max_num_batched_tokens, self.max_model_len - 1))
        for length in {longest, min(longest, 1024), min(longest, 64)}:
            table = list(range(-(-length // self.block_size)))
            for n in (length, length - 1):
                self.execute(StepInput([0] * n, [n], [length], [table], 1, [n - 1]))

    @torch.inference_mode()
    def _warm_up_logits(self) -> None:
        """Take the LM head's product once at every row count a step outside a decode graph
        can sample (1 to max_num_seqs), before serving. cuBLAS settles a shape's kernel at its
        first call and that call waits for the device to be idle: 3 ms on an idle H200, 32 ms
        behind 25 ms of queued work (``benchmarks/bench_first_product.py``). In mid-serving it
        stalled the loop 20-33 ms at each new largest batch of a mixed step, 9-13 times a
        saturated run; the warm-up takes ~0.1 s. Another thread's warm-up counts (the loop's
        is another). Largest first, so that each product's output reuses the first one's
        memory. (Prompt logprobs take the head at up to a step's token count of rows: those
        counts are not warmed, and the first of each may still wait.)"""
        hidden = torch.zeros(
            self.config.max_num_seqs,
            self.model_config.hidden_size,
            dtype=self.dtype,
            device=self.device,
        )
        start = time.perf_counter()
        for rows in range(len(hidden), 0, -1):
            self.model.logits(hidden[:rows])
        torch.cuda.synchronize(self.device)
        log.info(
            "rank %d: LM head warmed at 1..%d rows in %.2f s",
            self.tp.rank,
            len(hidden),
            time.perf_counter() - start,
        )

    def close(self) -> None:
        """Free the device memory: graphs, KV cache, weights. The graphs go first and at once
        (not when the collector finds them): NCCL's destroy waits for every graph that captured
        one of its collectives."""
        self.release_graphs()
        self.kv_cache = None
        self.model = None
        if self.device.type == "cuda":
            gc.collect()
            torch.cuda.empty_cache()

    def release_graphs(self) -> None:
        """Destroy the CUDA graphs now (steps run eagerly from then on)."""
        for graphs in (self.graphs, self.pieces):
            if graphs is not None:
                graphs.release()
        self.graphs = self.pieces = None

    @property
    def piecewise(self) -> bool:
        """Whether steps with attention outside a graph run as piecewise CUDA graphs."""
        return self.device.type == "cuda" and not self.eager and hasattr(self.model, "piece")

    # ---- a step ------------------------------------------------------------------------------

    def bind_thread(self) -> None:
        """Make the runner's device the calling thread's current one (the step loop's thread:
        events and copies there go to this device's stream, whatever the caller had set)."""
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)

    @property
    def synchronous(self) -> bool:
        """Whether a step computes before ``execute`` returns (not a CUDA device)."""
        return self.device.type != "cuda"

    def is_eager(self, out: SchedulerOutput) -> bool:
        """Whether this batch's forward runs eagerly (not in a CUDA graph)."""
        return self.graphs is None or bool(out.prefills) or len(out.decodes) > self.graphs.sizes[-1]

    def tensors(self, step: StepInput, previous: torch.Tensor | None = None, num_tokens: int = 0):
        """Device tensors of a step: input ids, positions and the ForwardContext. ``previous``:
        the previous step's sampled tokens, where ``step`` has pending inputs; ``num_tokens``:
        the length of positions and slots (padding: 0 and -1), at least the step's tokens."""
        num_seqs = len(step.query_lens)
        qsl = [0]
        for n in step.query_lens:
            qsl.append(qsl[-1] + n)
        width = max(len(t) for t in step.block_tables)
        # One int32 buffer, filled by C loops (array.extend), one host-to-device copy.
        flat = array("i", step.input_ids)
        flat.extend(qsl)
        flat.extend(step.seq_lens)
        flat.extend([length - n for length, n in zip(step.seq_lens, step.query_lens)])
        flat.extend(step.logits_rows)
        flat.extend(step.pending_positions)
        flat.extend(step.pending_rows)
        num_decodes = num_seqs - step.num_prefills
        flat.extend(longest_first(step.seq_lens[step.num_prefills :]))
        pad = array("i", [-1]) * width
        for table in step.block_tables:
            flat.extend(table)
            flat.extend(pad[len(table) :])
        if self.staging is not None:  # pinned: the copy does not wait for the running step
            packed = self.staging.copy(flat)
        else:
            packed = torch.frombuffer(flat, dtype=torch.int32).clone()
        t, num_pending = len(step.input_ids), len(step.pending_rows)
        sizes = [t, num_seqs + 1, num_seqs, num_seqs, len(step.logits_rows)]
        sizes += [num_pending, num_pending, num_decodes, num_seqs * width]
        ids, qsl_t, lens_t, start_t, rows_t, pos_t, prev_t, order_t, tables_t = packed.split(sizes)
        tables_t = tables_t.view(num_seqs, width)
        if num_pending:
            if previous is None:
                raise ValueError("the step has pending inputs but no previous sampled tokens")
            ids[pos_t.long()] = previous[prev_t.long()].to(ids.dtype)
        slots, positions = ops.compute_slot_mapping(
            tables_t, qsl_t, start_t, self.block_size, max(t, num_tokens)
        )
        ctx = ForwardContext(
            num_prefills=step.num_prefills,
            num_prefill_tokens=qsl[step.num_prefills],
            num_decodes=num_decodes,
            query_start_loc=qsl_t,
            seq_lens=lens_t,
            block_tables=tables_t,
            slot_mapping=slots,
            logits_indices=rows_t,
            query_start_loc_cpu=qsl,
            seq_lens_cpu=step.seq_lens,
            max_query_len=max(step.query_lens),
            max_seq_len=max(step.seq_lens),
            decode_order=order_t,
        )
        return ids, positions, ctx

    @torch.inference_mode()
    def execute(
        self,
        step: StepInput,
        previous: torch.Tensor | None = None,
        sampling: FusedRows | None = None,
    ) -> StepResult:
        """Run the model on a step. ``previous``: the previous step's sampled tokens [S] on the
        device (async scheduling); ``sampling``: the rows' ``FusedRows`` when they all take the
        sampler's fused pass, which a decode CUDA graph then runs too."""
        if self.graphs is not None and step.num_prefills == 0 and self.graphs.fits(step):
            return StepResult(*self.graphs.run(step, previous, sampling))
        t = len(step.input_ids)
        if self.pieces is not None and self.pieces.fits(t):
            ids, positions, ctx = self.tensors(step, previous, self.pieces.size_for(t))
            hidden = self.pieces.run(ids, positions, ctx)
        else:
            ids, positions, ctx = self.tensors(step, previous)
            hidden = self.model(ids, positions, ctx)
        prompt = None
        if step.prompt_rows:
            rows = torch.tensor(step.prompt_rows, device=hidden.device)
            prompt = self.model.logits(hidden.index_select(0, rows))
        return StepResult(self.model.compute_logits(hidden, ctx), prompt_logits=prompt)
