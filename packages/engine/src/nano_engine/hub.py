"""Models by Hugging Face hub id, as vLLM takes them: ``nano-engine serve Qwen/Qwen3-0.6B``.

A model (or tokenizer) that is no local path but reads as a hub repository id is fetched by
huggingface_hub into its cache (``HF_HUB_CACHE``, default ``~/.cache/huggingface/hub``): the
config, the tokenizer's files and the safetensors weights only (no other weight format is
loaded). Offline (``HF_HUB_OFFLINE=1``, or no network) the cached snapshot is used. Returns the
snapshot's directory, which the engine then reads as any local checkpoint.
"""

from __future__ import annotations

import re
from pathlib import Path

CONFIG_FILES = ("config.json", "generation_config.json")
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
)
WEIGHT_FILES = ("*.safetensors", "*.safetensors.index.json")

# "name" or "org/name": letters, digits, "-", "_", "."; neither starting with "." or "-"
_REPO_ID = re.compile(r"[A-Za-z0-9_][\w.-]{0,95}(/[A-Za-z0-9_][\w.-]{0,95})?")


def is_repo_id(name: str) -> bool:
    """Whether ``name`` could be a hub repository id (it may still be meant as a path)."""
    return bool(_REPO_ID.fullmatch(name)) and ".." not in name and "--" not in name


def resolve(name: str, revision: str | None = None, kind: str = "model") -> str:
    """A local directory for ``name``: itself when it exists (or is no hub id: the caller
    reports the missing path), else the hub snapshot of that id at ``revision`` (a branch,
    tag or commit; default main). ``kind``: "model" (config, tokenizer and weights),
    "config" (dummy weights: no weights fetched) or "tokenizer". ValueError, naming ``name``,
    when it can be neither."""
    if Path(name).expanduser().exists() or not is_repo_id(name):
        if revision is not None:
            raise ValueError(
                f"revision {revision!r} applies to a model id on the Hugging Face hub, "
                f"not to the local path {name!r}"
            )
        return name
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise ValueError(
            f"{kind} {name!r} is no local directory; to fetch it from the Hugging Face hub "
            "install huggingface_hub"
        ) from None
    if kind not in ("model", "config", "tokenizer"):
        raise ValueError(f"kind must be model, config or tokenizer, got {kind!r}")
    patterns = [*CONFIG_FILES, *TOKENIZER_FILES, *(WEIGHT_FILES if kind == "model" else ())]
    try:
        path = Path(snapshot_download(name, revision=revision, allow_patterns=patterns))
    except Exception as e:  # (huggingface_hub's errors: not found, gated, offline, network)
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(
            f"{kind} {name!r} is no local directory, and the Hugging Face hub gave no "
            f"snapshot of it ({type(e).__name__}: {reason}); offline (HF_HUB_OFFLINE=1) only "
            "the local cache is searched"
        ) from None
    needed = ("config.json",)
    if kind == "tokenizer":
        needed = ("tokenizer_config.json", "tokenizer.json")
    if not any((path / f).is_file() for f in needed):
        raise ValueError(f"the hub's {name!r} ({path}) has no {' or '.join(needed)}")
    if kind == "model" and not any(path.glob("*.safetensors")):
        raise ValueError(
            f"the hub's {name!r} ({path}) has no safetensors weights (only safetensors "
            "checkpoints are loaded; --load-format dummy runs on its config alone)"
        )
    return str(path)
