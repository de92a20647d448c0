"""Build a model from a Hugging Face checkpoint directory (safetensors only), or with random
weights (``load_format="dummy"``) from its config alone."""

from __future__ import annotations

import contextlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from nano_models.config import ModelConfig
from nano_models.parallel import SINGLE, TensorParallel
from nano_models.quantization import (
    Fp8Config,
    check_fp8_lm_head,
    fp8_lm_head,
    prepare_block_fp8,
    quantize_channel_fp8,
)
from nano_models.registry import model_class
from nano_models.weights import WeightSource, default_weight_loader

LOAD_FORMATS = ("auto", "dummy")
# Checkpoint entries that are not parameters of our models.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclass
class LoadReport:
    tensors: int = 0
    bytes_read: int = 0
    files: list[str] = field(default_factory=list)


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def load_model(
    path: str | Path | ModelConfig,
    *,
    dtype: torch.dtype | None = None,
    device: torch.device | str = "cpu",
    tp: TensorParallel = SINGLE,
    load_format: str = "auto",
    seed: int = 0,
    quantization: str | None = None,
    quantize_lm_head: bool = False,
    max_len: int | None = None,
) -> tuple[nn.Module, LoadReport]:
    """The model of a checkpoint directory, on ``device`` in ``dtype`` (default: the config's).

    With tensor parallelism each rank reads only its slices of the checkpoint. ``dummy`` fills
    random weights (seeded) and reads no file; ``path`` may then be a ``ModelConfig``. FP8
    weights (``nano_models.quantization``): a checkpoint's (its quantization_config), or
    ``quantization="fp8"`` on one in bf16 or fp32 (quantized as it loads); ``quantize_lm_head``:
    the LM head's weight too (a scale per vocabulary row), with either. ``max_len``: the
    longest sequence it will run (default: the config's positions); a model whose attention
    slides over a shorter window than that is refused (ours is full attention).
    """
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {load_format!r}")
    cfg = path if isinstance(path, ModelConfig) else ModelConfig.from_pretrained(path)
    window = cfg.sliding_window
    if window is not None and (max_len is None or max_len > window):
        raise ValueError(
            f"sliding-window attention (window {window}) is not supported: sequences of at most "
            f"{window} tokens compute the same (max_len {window} or less; max_model_len in "
            "nano-engine)"
        )
    fp8 = Fp8Config.of(cfg, quantization)
    if quantize_lm_head:
        rows = -(-cfg.vocab_size // tp.size)
        check_fp8_lm_head(fp8, rows, cfg.hidden_size, torch.device(device), dtype or cfg.dtype)
    if fp8 is not None:
        fp8.check_device(torch.device(device), dtype or cfg.dtype)
    cls = model_class(cfg.architecture)
    with _default_dtype(dtype or cfg.dtype), torch.device(device):
        model = cls(cfg, tp)
    model.eval()
    if fp8 is not None and fp8.scheme == "block":
        prepare_block_fp8(model, fp8)
    if load_format == "dummy":
        report = LoadReport()
        _fill_random(model, seed)
    elif isinstance(path, ModelConfig):
        raise ValueError("loading weights needs a checkpoint directory, not a config")
    else:
        report = load_weights(model, Path(path))
    if fp8 is not None and fp8.scheme == "channel":
        quantize_channel_fp8(model, fp8)
    if quantize_lm_head:
        fp8_lm_head(model)
    return model, report


def _fill_random(model: nn.Module, seed: int) -> nn.Module:
    generators: dict[torch.device, torch.Generator] = {}
    for name, param in model.named_parameters():
        if getattr(param, "optional", False):
            continue  # (its default: the checkpoint's value, when it has one)
        device = param.device
        if device not in generators:
            generators[device] = torch.Generator(device=device).manual_seed(seed)
        if name.endswith("weight_scale_inv"):  # (an FP8 weight: e4m3 values of about 1)
            param.data.fill_(0.02)
        elif param.dtype == torch.float8_e4m3fn:
            values = torch.empty(param.shape, device=device)
            param.data.copy_(values.normal_(0.0, 1.0, generator=generators[device]))
        else:
            param.data.normal_(0.0, 0.02, generator=generators[device])
        if name.endswith("norm.weight"):
            param.data += 1.0
    return model


def checkpoint_files(path: Path) -> list[Path]:
    """The safetensors files of a checkpoint directory (through its index when present)."""
    if not path.is_dir():
        raise FileNotFoundError(f"{path} is not a checkpoint directory")
    index = path / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [path / name for name in names]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"{index.name} lists missing files {missing}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        pickles = sorted(p.name for p in path.glob("*.bin")) + sorted(
            p.name for p in path.glob("*.pt")
        )
        hint = f" (found {pickles}: pickled weights are never loaded)" if pickles else ""
        raise FileNotFoundError(f"no *.safetensors weights in {path}{hint}")
    return files


def load_weights(model: nn.Module, path: Path) -> LoadReport:
    """Load every parameter from the checkpoint; a missing, unexpected or mis-shaped tensor is
    a ValueError naming it."""
    params = dict(model.named_parameters())
    mapping = getattr(model, "packed_modules_mapping", {})
    tied = getattr(getattr(model, "config", None), "tie_word_embeddings", False)
    # (a model may map some tensors itself: a mixture of experts, expert by expert)
    own_target = getattr(model, "checkpoint_target", lambda name: None)
    own_shards = getattr(model, "param_shards", lambda name: None)
    expected = {name: own_shards(name) or _shards(name, mapping) for name in params}
    if tied:
        expected.pop("lm_head.weight", None)
    loaded: dict[str, set] = {name: set() for name in expected}
    # (parameters a checkpoint may leave out, as an FP8 KV cache's scales: their defaults stay)
    for name, param in params.items():
        if getattr(param, "optional", False):
            expected.pop(name, None)
    unexpected: list[str] = []
    seen: dict[str, str] = {}  # tensor name -> the file it came from
    report = LoadReport()
    for file in checkpoint_files(path):
        report.files.append(file.name)
        with safe_open(file, framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118  (safe_open is not a mapping)
                if name.endswith(_IGNORED_SUFFIXES) or (tied and name == "lm_head.weight"):
                    continue
                target, shard = own_target(name) or _kv_scale(name) or _target(name, mapping)
                if target not in loaded:
                    unexpected.append(name)
                    continue
                if name in seen:
                    raise ValueError(f"tensor {name} is in both {seen[name]} and {file.name}")
                seen[name] = file.name
                tensor_slice = f.get_slice(name)
                source = WeightSource(
                    name,
                    tuple(tensor_slice.get_shape()),
                    _dtype(tensor_slice.get_dtype()),
                    lambda index, s=tensor_slice: s[index],
                )
                param = params[target]
                if param.is_floating_point() and not source.dtype.is_floating_point:
                    raise ValueError(f"tensor {name} is {source.dtype}, not floating point")
                if shard in loaded[target]:
                    raise ValueError(f"tensor {name} loads {target} {shard} a second time")
                getattr(param, "weight_loader", default_weight_loader)(param, source, shard)
                loaded[target].add(shard)
                report.tensors += 1
                report.bytes_read += source.bytes_read
    if unexpected:
        raise ValueError(f"unexpected tensors in the checkpoint: {sorted(unexpected)}")
    own_name = getattr(model, "checkpoint_name", lambda name, shard: None)
    missing = sorted(
        own_name(name, shard) or _checkpoint_name(name, shard, mapping)
        for name, shards in expected.items()
        for shard in shards - loaded[name]
    )
    if missing:
        raise ValueError(f"tensors missing from the checkpoint: {missing}")
    return report


# An FP8 KV cache's scales as checkpoints name them (AutoFP8's self_attn.k_scale, and the
# k_proj.k_scale / k_proj.output_scale of other quantizers), for our attention layer's.
_KV_SCALE = re.compile(
    r"(?P<attn>.*\.self_attn)\.(?:(?P<kv>[kv])_scale|(?P<proj>[kv])_proj\.(?:(?P<own>[kv])_scale|output_scale))"
)


def _kv_scale(name: str) -> tuple[str, None] | None:
    m = _KV_SCALE.fullmatch(name)
    if m is None or (m["own"] is not None and m["own"] != m["proj"]):
        return None  # (k_proj.v_scale is no scale of ours)
    return f"{m['attn']}.attn.{m['kv'] or m['proj']}_scale", None


def _target(name: str, mapping: dict) -> tuple[str, object]:
    for fragment, (packed, shard) in mapping.items():
        if f".{fragment}." in name:
            return name.replace(f".{fragment}.", f".{packed}."), shard
    return name, None


def _checkpoint_name(param_name: str, shard, mapping: dict) -> str:
    """The checkpoint tensor of a parameter's shard (a packed part's own name)."""
    for fragment, (packed, part) in mapping.items():
        if part == shard and f".{packed}." in param_name:
            return param_name.replace(f".{packed}.", f".{fragment}.")
    return f"{param_name}[{shard}]" if shard is not None else param_name


def _shards(param_name: str, mapping: dict) -> set:
    shards = {shard for fragment, (packed, shard) in mapping.items() if f".{packed}." in param_name}
    return shards or {None}


_SAFETENSORS_DTYPES = {
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F64": torch.float64,
    "I64": torch.int64,
    "I32": torch.int32,
    "F8_E4M3": torch.float8_e4m3fn,
}


def _dtype(name: str) -> torch.dtype:
    try:
        return _SAFETENSORS_DTYPES[name]
    except KeyError:
        raise ValueError(f"unsupported checkpoint dtype {name}") from None
