"""Step-time models: how long the engine takes for one scheduled batch, and where.

A ``CostModel`` sees the batch's shape: each prefill chunk as (new tokens, tokens already
cached) and each decode as its context length. It returns the host's and the device's seconds
(``StepCost``); the simulator overlaps them as the engine's loop does. ``RooflineCostModel``
derives the device's time from the model's dimensions and the GPU's bandwidth and FLOP rate;
``FittedCostModel`` fits a linear model to measured step times. The calibrated model, built
from ``nano-engine profile``, is ``nano_scheduler.sim.profiled.ProfiledCostModel``.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple, Protocol

from nano_scheduler.scheduler import SchedulerOutput
from nano_scheduler.sim.fit import nnls
from nano_scheduler.sim.profile import STEP_LOG_FORMAT, StepRecord, read_step_log


class BatchShape(NamedTuple):
    prefills: list[tuple[int, int]]  # (new tokens, cached tokens before them) per chunk
    decodes: list[int]  # context length (tokens attended, the new one included) per decode
    num_sampled: int  # tokens sampled this step (LM head rows)
    num_running: int = 0  # running sequences when the step was scheduled
    num_waiting: int = 0  # waiting ones

    @classmethod
    def of(cls, out: SchedulerOutput, num_running: int = 0, num_waiting: int = 0) -> BatchShape:
        prefills = [(c.num_tokens, c.start) for c in out.prefills]
        sampled = sum(c.samples for c in out.prefills) + len(out.decodes)
        decodes = [len(s.token_ids) for s in out.decodes]
        return cls(prefills, decodes, sampled, num_running, num_waiting)

    @classmethod
    def of_record(cls, record: StepRecord) -> BatchShape:
        """A step log record's batch (its decodes' contexts spread evenly: it keeps their
        count, sum and maximum only)."""
        count, total, longest = record.decodes
        decodes = [total // count + (i < total % count) for i in range(count)] if count else []
        if count and longest > decodes[0]:  # the longest one first, the rest evened out
            rest = total - longest
            decodes = [longest] + [
                rest // (count - 1) + (i < rest % (count - 1)) for i in range(count - 1)
            ]
        prefills = [(n, c) for n, c in record.prefills]
        return cls(prefills, decodes, record.sampled, record.running, record.waiting)

    @property
    def num_tokens(self) -> int:
        return sum(n for n, _ in self.prefills) + len(self.decodes)

    @property
    def prefill_attention(self) -> int:
        """(query, key) pairs of the causal prefill chunks: n * cached + n (n + 1) / 2 each."""
        return sum(n * start + n * (n + 1) // 2 for n, start in self.prefills)

    @property
    def decode_context(self) -> int:
        return sum(self.decodes)


class StepCost(NamedTuple):
    """Seconds of one step by where they are spent, in the step loop's order. Host:
    ``schedule`` (scheduler and step inputs), ``launch`` (the forward's launch),
    ``sample_host`` (the sampler's inputs and launch, the scheduler's advance), ``between``
    (after the outputs are published, before the next iteration: statistics, the step log,
    the inbox). Device: ``forward`` (the model) and ``sample``. How they overlap is the
    simulator's business."""

    schedule: float = 0.0
    launch: float = 0.0
    forward: float = 0.0
    sample_host: float = 0.0
    sample: float = 0.0
    between: float = 0.0


class CostModel(Protocol):
    """Where a step's time goes. ``synchronous``: the device's work blocks the host (a CPU)."""

    synchronous: bool

    def step_cost(self, batch: BatchShape) -> StepCost:
        """The host and device seconds of scheduling, launching and sampling this batch."""
        ...

    def resolve_cost(self, resolved: int, finished: int, outputs: int) -> tuple[float, float]:
        """Host seconds to resolve a step's ``resolved`` tokens (``finished`` sequences ended)
        and to publish ``outputs`` request outputs: (post, publish)."""
        ...

    def is_eager(self, batch: BatchShape) -> bool:
        """Whether the forward runs eagerly (its kernels start as they are launched), not as
        one CUDA graph (it starts once replayed, after its inputs)."""
        ...

    def intake_cost(self, prompt_tokens: int) -> float:
        """Host seconds the loop loses to taking in a request of ``prompt_tokens``."""
        ...


class DeviceOnlyModel:
    """A cost model that knows only the device's time of a step (``step_time``): the host
    costs nothing."""

    synchronous = False

    def step_time(self, batch: BatchShape) -> float:
        raise NotImplementedError

    def step_cost(self, batch: BatchShape) -> StepCost:
        return StepCost(forward=self.step_time(batch))

    def resolve_cost(self, resolved: int, finished: int, outputs: int) -> tuple[float, float]:
        return 0.0, 0.0

    def is_eager(self, batch: BatchShape) -> bool:
        return True

    def intake_cost(self, prompt_tokens: int) -> float:
        return 0.0


_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1}


def _dtype_bytes(dtype: str) -> int:
    if dtype not in _DTYPE_BYTES:
        raise ValueError(
            f"unsupported dtype {dtype!r} in the model config; known: {sorted(_DTYPE_BYTES)}"
        )
    return _DTYPE_BYTES[dtype]


@dataclass(frozen=True)
class ModelShape:
    """The dimensions of a decoder-only transformer that decide its cost."""

    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool = False
    dtype_bytes: int = 2
    # A mixture of experts (Qwen3-MoE): in ``sparse_layers`` of the layers, a router picks
    # ``experts_per_token`` of ``num_experts`` gated MLPs of ``moe_intermediate_size`` each.
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    sparse_layers: int = 0
    kv_dtype_bytes: int | None = None  # the KV cache's (an FP8 cache: 1); None: dtype_bytes

    @classmethod
    def from_hf_config(cls, config: dict | str | Path) -> ModelShape:
        """From a Hugging Face config.json (a dict, or the file or the directory holding it)."""
        if not isinstance(config, dict):
            path = Path(config)
            path = path / "config.json" if path.is_dir() else path
            config = json.loads(path.read_text())
        try:
            heads = config["num_attention_heads"]
            dtype = config.get("torch_dtype") or config.get("dtype") or "bfloat16"
            experts = config.get("num_experts") or config.get("num_local_experts") or 0
            layers = config["num_hidden_layers"]
            sparse = 0
            if experts:  # (transformers' rule: mlp_only_layers, and every decoder_sparse_step)
                step = config.get("decoder_sparse_step") or 1
                dense = set(config.get("mlp_only_layers") or [])
                sparse = sum(i not in dense and (i + 1) % step == 0 for i in range(layers))
            return cls(
                num_layers=config["num_hidden_layers"],
                hidden_size=config["hidden_size"],
                num_heads=heads,
                num_kv_heads=config.get("num_key_value_heads") or heads,
                head_dim=config.get("head_dim") or config["hidden_size"] // heads,
                intermediate_size=config["intermediate_size"],
                vocab_size=config["vocab_size"],
                tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
                dtype_bytes=_dtype_bytes(dtype),
                num_experts=experts,
                experts_per_token=config["num_experts_per_tok"] if experts else 0,
                moe_intermediate_size=config["moe_intermediate_size"] if experts else 0,
                sparse_layers=sparse,
            )
        except KeyError as e:
            raise ValueError(f"the model config lacks {e}; need a decoder-only HF config") from e

    @property
    def attention_params(self) -> int:
        """Matmul parameters of one layer's attention: fused qkv, output projection."""
        attn = self.hidden_size * (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        return attn + self.num_heads * self.head_dim * self.hidden_size

    @property
    def expert_params(self) -> int:
        """Parameters of one expert (a gated MLP of moe_intermediate_size)."""
        return 3 * self.hidden_size * self.moe_intermediate_size

    @property
    def layer_params(self) -> int:
        """Matmul parameters of one dense layer: attention and gated MLP."""
        return self.attention_params + 3 * self.hidden_size * self.intermediate_size

    @property
    def sparse_layer_params(self) -> int:
        """Parameters of one layer with experts: attention, router, every expert."""
        return self.attention_params + self.num_experts * (self.hidden_size + self.expert_params)

    @property
    def weight_bytes(self) -> int:
        embeddings = self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)
        norms = (2 * self.num_layers + 1) * self.hidden_size
        dense = (self.num_layers - self.sparse_layers) * self.layer_params
        sparse = self.sparse_layers * self.sparse_layer_params
        return (dense + sparse + embeddings + norms) * self.dtype_bytes

    def experts_touched(self, tokens: int) -> float:
        """Distinct experts a layer's tokens choose, expected under uniform routing:
        E (1 - (1 - k / E)^tokens)."""
        if not self.num_experts:
            return 0.0
        return self.num_experts * (1 - (1 - self.experts_per_token / self.num_experts) ** tokens)

    def weight_bytes_read(self, tokens: int) -> float:
        """Weight bytes a step of ``tokens`` tokens reads: everything but the experts none of
        its tokens chose."""
        untouched = self.num_experts - self.experts_touched(tokens)
        return self.weight_bytes - (
            self.sparse_layers * untouched * self.expert_params * self.dtype_bytes
        )

    @property
    def kv_bytes_per_token(self) -> int:
        elem = self.kv_dtype_bytes or self.dtype_bytes
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * elem

    @property
    def flops_per_token(self) -> int:
        """Matmul FLOPs of one token through every layer (the LM head is counted apart): in a
        layer with experts, the router and its experts_per_token experts."""
        dense = (self.num_layers - self.sparse_layers) * self.layer_params
        active = self.num_experts * self.hidden_size + self.experts_per_token * self.expert_params
        sparse = self.sparse_layers * (self.attention_params + active)
        return 2 * (dense + sparse)

    @property
    def lm_head_flops(self) -> int:
        return 2 * self.hidden_size * self.vocab_size

    @property
    def attention_flops_per_pair(self) -> int:
        """FLOPs of one (query, key) pair over all layers: q.k and p.v for every head."""
        return 4 * self.num_heads * self.head_dim * self.num_layers


@dataclass(frozen=True)
class GPU:
    name: str
    mem_bandwidth: float  # bytes/s
    flops: float  # dense bf16 FLOP/s
    memory: float  # bytes

    @classmethod
    def preset(cls, name: str) -> GPU:
        try:
            return GPU_PRESETS[name.lower()]
        except KeyError:
            raise ValueError(f"unknown GPU {name!r}; presets: {sorted(GPU_PRESETS)}") from None


GPU_PRESETS = {
    # An H200: the device-to-device copy measured on ours (4.2-4.3 TB/s, benchmarks/RESULTS.md)
    # and the bf16 matrix rate of the machine notes (790 TFLOP/s; our 8k matmul gets 680-773).
    "h200": GPU("h200", 4.3e12, 790e12, 141e9),
    # Datasheet peaks, for comparison.
    "h100": GPU("h100", 3.35e12, 989e12, 80e9),
    "a100": GPU("a100", 2.04e12, 312e12, 80e9),
}


class RooflineCostModel(DeviceOnlyModel):
    """max(FLOPs / rate, bytes / bandwidth) of a step, plus a fixed per-step overhead.

    Bytes: all weights once (of a mixture of experts, those of the experts its tokens are
    expected to choose), every chunk's and decode's KV context once, the new tokens' KV
    written. FLOPs: the matmuls of every new token, the LM head of every sampled token, and
    attention over the (query, key) pairs.
    """

    def __init__(self, model: ModelShape, gpu: GPU, step_overhead: float = 0.0) -> None:
        self.model, self.gpu, self.step_overhead = model, gpu, step_overhead

    def step_time(self, batch: BatchShape) -> float:
        m = self.model
        tokens = batch.num_tokens
        context = batch.decode_context + sum(n + start for n, start in batch.prefills)
        nbytes = m.weight_bytes_read(tokens) + (context + tokens) * m.kv_bytes_per_token
        flops = (
            tokens * m.flops_per_token
            + batch.num_sampled * m.lm_head_flops
            + (batch.prefill_attention + batch.decode_context) * m.attention_flops_per_pair
        )
        return max(flops / self.gpu.flops, nbytes / self.gpu.mem_bandwidth) + self.step_overhead


FEATURES = ("const", "tokens", "seqs", "prefill_attention", "decode_context")


def features(batch: BatchShape) -> list[float]:
    return [
        1.0,
        batch.num_tokens,
        len(batch.prefills) + len(batch.decodes),
        batch.prefill_attention,
        batch.decode_context,
    ]


class FittedCostModel(DeviceOnlyModel):
    """A linear model of measured step times over the batch's features (``FEATURES``), every
    coefficient >= 0, and never below ``floor`` seconds (a step takes time).

    JSON: ``{"coefficients": {"const": s, "tokens": s/token, ...}}``; or measured steps to
    fit by least squares with non-negative coefficients: ``{"samples": [{"prefills": [[new,
    cached], ...], "decodes": [context, ...], "num_sampled": k, "seconds": t}, ...]}``, or the
    engine's step log (``nano-engine serve --step-log``), whose iterations are fitted by their
    whole duration. ``nano-engine profile`` and ``ProfiledCostModel`` predict better: this
    model knows neither the host's part nor CUDA graphs.
    """

    def __init__(self, coefficients: dict[str, float], floor: float = 1e-6) -> None:
        unknown = set(coefficients) - set(FEATURES)
        if unknown:
            raise ValueError(f"unknown cost features {sorted(unknown)}; known: {FEATURES}")
        self.coefficients = {name: float(coefficients.get(name, 0.0)) for name in FEATURES}
        negative = [name for name, c in self.coefficients.items() if not c >= 0]
        if negative:
            raise ValueError(
                f"cost coefficients must be >= 0 (a cost is never negative): {negative}"
            )
        if not floor > 0:
            raise ValueError(f"the floor must be > 0 seconds, got {floor}")
        self.floor = floor
        self._coef = [self.coefficients[name] for name in FEATURES]

    def step_time(self, batch: BatchShape) -> float:
        return max(self.floor, sum(c * x for c, x in zip(self._coef, features(batch))))

    @classmethod
    def fit(cls, samples: list[tuple[BatchShape, float]]) -> FittedCostModel:
        """Least squares on the steps' relative errors, coefficients >= 0."""
        if len(samples) < len(FEATURES):
            raise ValueError(f"need at least {len(FEATURES)} measured steps, got {len(samples)}")
        bad = [t for _, t in samples if not 0 < t < math.inf]
        if bad:
            raise ValueError(f"measured step times must be > 0 seconds, got {bad[0]!r}")
        rows = [features(batch) for batch, _ in samples]
        for j, name in enumerate(FEATURES[1:], 1):
            if max(r[j] for r in rows) == min(r[j] for r in rows):
                raise ValueError(
                    f"the measured steps do not determine the cost model: {name} does not "
                    "vary (measure prefill and decode steps of several shapes, as nano-engine "
                    "bench --step-log does)"
                )
        times = [t for _, t in samples]
        coef = nnls(rows, times, [1.0 / t**2 for t in times])
        return cls(dict(zip(FEATURES, coef)), floor=min(times) / 2)

    @classmethod
    def from_json(cls, path: str | Path) -> FittedCostModel:
        text = Path(path).read_text()
        if text.startswith(f'{{"format": "{STEP_LOG_FORMAT}"'):
            records = read_step_log(path).steps
            steps = [(BatchShape.of_record(r), r.host + r.wait) for r in records if r.num_tokens]
            return cls.fit(steps)
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not valid JSON ({e.msg} at line {e.lineno})") from None
        if not isinstance(data, dict):
            raise ValueError(f"{path}: expected a JSON object")
        if "coefficients" in data:
            return cls(data["coefficients"])
        if "samples" in data:
            samples = []
            for i, s in enumerate(data["samples"]):
                try:
                    batch = BatchShape(
                        [tuple(p) for p in s["prefills"]],
                        list(s["decodes"]),
                        int(s.get("num_sampled", len(s["prefills"]) + len(s["decodes"]))),
                    )
                    samples.append((batch, float(s["seconds"])))
                except (KeyError, TypeError, ValueError) as e:
                    raise ValueError(
                        f"{path}: sample {i} needs prefills [[new, cached], ...], decodes "
                        f"[context, ...] and seconds ({type(e).__name__}: {e})"
                    ) from None
            return cls.fit(samples)
        raise ValueError(f"{path}: expected 'coefficients', 'samples' or an engine step log")

    def to_json(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps({"coefficients": self.coefficients}, indent=2))
