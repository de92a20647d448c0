"""The nano-engine command's options: value types a flag checks as it parses, the help's
format, and the engine's options, one per ``EngineConfig`` field (``ENGINE_OPTIONS``: vLLM's
spelling first), with their inverse (``engine_flags``) for an engine started in another
process; the sampling and workload options the commands share."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import MISSING, dataclass, fields

from nano_engine.config import (
    ATTENTION_BACKENDS,
    DATA_PARALLEL_BACKENDS,
    DEVICES,
    DTYPES,
    KV_CACHE_DTYPES,
    LOAD_FORMATS,
    QUANTIZATIONS,
    EngineConfig,
)
from nano_engine.reasoning import PARSERS as REASONING_PARSERS
from nano_scheduler.config import POLICIES
from nano_scheduler.router import ROUTERS


def number(kind: type, text: str) -> int | float:
    try:
        return kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{'an integer' if kind is int else 'a number'} is needed, got {text!r}"
        ) from None


def positive(text: str) -> int:
    value = number(int, text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def non_negative(text: str) -> int:
    value = number(int, text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def fraction(text: str) -> float:
    value = number(float, text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value


def gigabytes(text: str) -> float:
    value = number(float, text)
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number of GB > 0, got {text}")
    return value


def seconds(text: str) -> float:
    value = number(float, text)
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number of seconds > 0, got {text}")
    return value


def grace(text: str) -> float:
    value = number(float, text)
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number of seconds >= 0, got {text}")
    return value


def port(text: str) -> int:
    port = number(int, text)
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"a port is 1-65535, got {port}")
    return port


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Appends "(default: ...)" to an option's help unless the help already says it or there is
    no default worth showing (None, or an on/off flag that is off)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (
            "%(default)" in text
            or "default:" in text
            or not action.option_strings
            or action.default in (None, argparse.SUPPRESS)
            or (action.nargs == 0 and not isinstance(action, argparse.BooleanOptionalAction))
        ):
            return text
        return text + " (default: %(default)s)"


@dataclass(frozen=True)
class EngineOption:
    """How one EngineConfig field is spelled on the command line: its flags (vLLM's name first
    where vLLM has the option; ours after it where it already shipped), help and checks."""

    flags: tuple[str, ...]
    help: str
    type: Callable[[str], object] | None = None
    choices: tuple[str, ...] | None = None
    metavar: str | None = None


ENGINE_OPTIONS: dict[str, EngineOption] = {
    "tokenizer": EngineOption(
        ("--tokenizer",),
        "tokenizer directory or Hugging Face hub id (default: the model's)",
        str,
        metavar="DIR",
    ),
    "skip_tokenizer_init": EngineOption(
        ("--skip-tokenizer-init",),
        "load no tokenizer: prompts are token ids (bench and profile set it for "
        "--load-format dummy without --tokenizer)",
    ),
    "max_num_batched_tokens": EngineOption(
        ("--max-num-batched-tokens",), "the most tokens one step computes", positive
    ),
    "max_num_seqs": EngineOption(
        ("--max-num-seqs",), "the most sequences running at once", positive
    ),
    "max_model_len": EngineOption(
        ("--max-model-len",),
        "the longest sequence, prompt and output (default and cap: the model's "
        "max_position_embeddings, or its sliding window)",
        positive,
    ),
    "gpu_memory_utilization": EngineOption(
        ("--gpu-memory-utilization",),
        "share of the GPU's memory the engine may use, the KV cache sized to fill it (CUDA only)",
        fraction,
    ),
    "kv_cache_memory_gb": EngineOption(
        ("--kv-cache-memory-gb",), "GB of KV cache (CPU only; default: 1)", gigabytes
    ),
    "tensor_parallel_size": EngineOption(
        ("--tensor-parallel-size", "-tp"), "GPUs to shard the model over", positive
    ),
    "enforce_eager": EngineOption(
        ("--enforce-eager",), "decode without CUDA graphs (on CUDA they are captured)"
    ),
    "kvcache_block_size": EngineOption(
        ("--block-size", "--kvcache-block-size"), "tokens per KV-cache block", positive
    ),
    "num_kvcache_blocks": EngineOption(
        ("--num-kvcache-blocks", "--num-gpu-blocks-override"),
        "KV-cache blocks, overriding --gpu-memory-utilization and --kv-cache-memory-gb "
        "(default: sized from those)",
        positive,
    ),
    "dtype": EngineOption(
        ("--dtype",), "weights and activations (auto: the checkpoint's)", str, DTYPES
    ),
    "seed": EngineOption(("--seed",), "random seed of the engine (dummy weights, sampling)", int),
    "load_format": EngineOption(
        ("--load-format",),
        "auto: the checkpoint's safetensors; dummy: random weights (config.json alone)",
        str,
        LOAD_FORMATS,
    ),
    "enable_prefix_caching": EngineOption(
        ("--enable-prefix-caching",), "reuse the KV blocks of prompt prefixes already computed"
    ),
    "enable_chunked_prefill": EngineOption(
        ("--enable-chunked-prefill",), "split long prompts over several steps"
    ),
    "scheduling_policy": EngineOption(
        ("--scheduling-policy",), "what a step schedules first", str, POLICIES
    ),
    "attention_backend": EngineOption(
        ("--attention-backend",),
        "auto: flash_attn (where it imports and fits), else triton on CUDA, else torch",
        str,
        ATTENTION_BACKENDS,
    ),
    "device": EngineOption(("--device",), "auto: CUDA when available", str, DEVICES),
    "async_scheduling": EngineOption(
        ("--async-scheduling",),
        "schedule each step while the previous one runs (default: on)",
    ),
    "max_logprobs": EngineOption(
        ("--max-logprobs",), "the most logprobs a request may ask for", non_negative
    ),
    "revision": EngineOption(
        ("--revision",),
        "the branch, tag or commit of a model given as a Hugging Face hub id (default: main)",
        str,
        metavar="REV",
    ),
    "reasoning_parser": EngineOption(
        ("--reasoning-parser",),
        "split the model's thinking into reasoning_content (chat), and apply a structured "
        "output's constraint after it",
        str,
        tuple(sorted(REASONING_PARSERS)),
    ),
    "kv_cache_dtype": EngineOption(
        ("--kv-cache-dtype",),
        "auto: the model's dtype; fp8 (fp8_e4m3): K and V in e4m3 with a scale per layer (the "
        "checkpoint's, else 1), twice the tokens in the same memory",
        str,
        KV_CACHE_DTYPES,
    ),
    "quantization": EngineOption(
        ("--quantization", "-q"),
        "fp8: the linear layers' weights in e4m3 (a scale per output channel, activations "
        "per token), quantized as a bf16 or fp32 checkpoint loads; an FP8 checkpoint is read "
        "as FP8 without it (default: none)",
        str,
        QUANTIZATIONS,
    ),
    "quantize_lm_head": EngineOption(
        ("--quantize-lm-head",),
        "with FP8 weights (--quantization fp8 or an FP8 checkpoint): the LM head's weight in "
        "e4m3 too (a scale per vocabulary row): half its bytes a decode step, logits that "
        "carry its rounding (check with nano-engine accuracy); default: the model's dtype",
    ),
    "data_parallel_size": EngineOption(
        ("--data-parallel-size", "-dp"),
        "engine replicas, each with its own GPU(s), behind one server (or LLM)",
        positive,
    ),
    "data_parallel_backend": EngineOption(
        ("--data-parallel-backend",),
        "ray: replicas as Ray actors (pip install nano-engine[ray]; one host or a cluster); "
        "mp: processes of this host",
        str,
        DATA_PARALLEL_BACKENDS,
    ),
    "data_parallel_address": EngineOption(
        ("--data-parallel-address",),
        "the Ray cluster to place replicas on, as ray.init takes it (default: the one this "
        "process is connected to, else a local one started here)",
        str,
        metavar="ADDRESS",
    ),
    "router": EngineOption(
        ("--router",),
        "how requests are spread over replicas: the fewest outstanding tokens, the replica "
        "that holds the prompt's prefix (within a load bound), or in turn",
        str,
        tuple(sorted(ROUTERS)),
    ),
}


_METAVARS = {positive: "N", non_negative: "N", int: "N", fraction: "FRACTION", gigabytes: "GB"}


def add_engine_options(parser: argparse.ArgumentParser) -> None:
    """One option per EngineConfig field (model is positional), as ENGINE_OPTIONS spells it."""
    group = parser.add_argument_group("engine options")
    for f in fields(EngineConfig):
        if f.name == "model":
            continue
        option = ENGINE_OPTIONS[f.name]
        default = None if f.default is MISSING else f.default
        if option.type is None:  # (an on/off flag: --NAME and --no-NAME)
            group.add_argument(
                *option.flags,
                dest=f.name,
                action=argparse.BooleanOptionalAction,
                default=default,
                help=option.help,
            )
        else:
            group.add_argument(
                *option.flags,
                dest=f.name,
                type=option.type,
                choices=option.choices,
                metavar=option.metavar or _METAVARS.get(option.type),
                default=default,
                help=option.help,
            )


def engine_kwargs(args: argparse.Namespace) -> dict:
    return {f.name: getattr(args, f.name) for f in fields(EngineConfig) if f.name != "model"}


def engine_flags(config: EngineConfig) -> list[str]:
    """The command-line options that give ``config`` (its model aside): the inverse of
    ``add_engine_options``, for an engine started in another process."""
    flags = []
    for f in fields(EngineConfig):
        value = getattr(config, f.name)
        if f.name == "model" or value == f.default:
            continue
        flag = ENGINE_OPTIONS[f.name].flags[0]
        if isinstance(value, bool):
            flags.append(flag if value else "--no-" + flag[2:])
        elif value is not None:
            flags += [flag, str(value)]
    return flags


def sampling_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("sampling")
    group.add_argument("--max-tokens", type=positive, default=64, help="tokens to generate")
    group.add_argument(
        "--temperature", type=float, default=0.0, help="0 is greedy; higher, more random"
    )
    group.add_argument(
        "--top-p", type=float, default=1.0, help="sample from this share of probability (1: all)"
    )
    group.add_argument(
        "--top-k", type=int, default=0, help="sample from the k likeliest tokens (0 or -1: all)"
    )
    group.add_argument(
        "--min-p", type=float, default=0.0, help="drop tokens below this share of the likeliest"
    )
    group.add_argument(
        "--sample-seed", type=int, help="seed of each request's sampling (default: unseeded)"
    )
    group.add_argument("--stop", action="append", help="a string that ends the output (repeatable)")
    group.add_argument(
        "--ignore-eos", action="store_true", help="generate on past the end-of-sequence token"
    )


def add_common_options(parser: argparse.ArgumentParser, top_level: bool = False) -> None:
    """-v also after the subcommand: there SUPPRESS keeps the top level's value unless given."""
    parser.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        default=False if top_level else argparse.SUPPRESS,
        help="log engine details (INFO)",
    )


def length_range(
    parser: argparse.ArgumentParser, flag: str, default: tuple[int, int], what: str
) -> None:
    """A MIN MAX option of lengths drawn uniformly between them."""
    parser.add_argument(
        flag,
        type=positive,
        nargs=2,
        default=default,
        metavar=("MIN", "MAX"),
        help=f"{what}, uniform in MIN..MAX (default: {default[0]} {default[1]})",
    )
