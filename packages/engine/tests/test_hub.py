"""Models by Hugging Face hub id, offline, against a cache laid out as the hub lays it out
(blobs, snapshots of links to them, refs): the command line takes ``ORG/NAME`` and generates
what the checkpoint's directory generates; ``nano_engine.hub.resolve`` finds revisions, fetches
no weights for dummy ones, and names what is missing."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from nano_engine import hub
from nano_engine.config import EngineConfig

pytest.importorskip("huggingface_hub")
from huggingface_hub import constants

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def lay_out_cache(cache: Path, repo_id: str, checkpoint: str, commit: str = COMMIT, skip=()):
    """The hub cache's layout of ``checkpoint``'s files at ``commit`` (also main's)."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir(exist_ok=True)
    for f in sorted(Path(checkpoint).iterdir()):
        if f.is_file() and not any(f.match(p) for p in skip):
            blob = repo / "blobs" / hashlib.sha256(f.read_bytes()).hexdigest()
            shutil.copyfile(f, blob)
            (snapshot / f.name).symlink_to(os.path.relpath(blob, snapshot))
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(commit)
    return snapshot


@pytest.fixture
def offline(monkeypatch, tmp_path):
    """An offline hub whose cache is ``tmp_path / "hub"`` (for this process and children)."""
    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return cache


def generate(model: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            *(sys.executable, "-m", "nano_engine", "generate", model, "--prompt", "Hello there"),
            *("--max-tokens", "6", "--ignore-eos", "--block-size", "8", "--device", "cpu"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )


def test_the_command_line_takes_a_hub_id(checkpoints, offline):
    local = checkpoints("qwen3")
    lay_out_cache(offline, "tiny-org/qwen3-tiny", local)
    by_id = generate("tiny-org/qwen3-tiny", dict(os.environ))
    assert by_id.returncode == 0, by_id.stderr
    by_path = generate(local, dict(os.environ))
    assert by_path.returncode == 0, by_path.stderr
    assert by_id.stdout == by_path.stdout and "--- prompt:" in by_id.stdout  # (greedy)
    missing = generate("tiny-org/absent", dict(os.environ))
    assert missing.returncode != 0
    assert "'tiny-org/absent'" in missing.stderr and "HF_HUB_OFFLINE" in missing.stderr
    assert "Traceback" not in missing.stderr


def test_resolve_revisions_kinds_and_errors(checkpoints, offline):
    local = checkpoints("qwen3")
    snapshot = lay_out_cache(offline, "org/full", local)
    assert Path(hub.resolve("org/full")) == snapshot
    assert Path(hub.resolve("org/full", revision=COMMIT)) == snapshot
    with pytest.raises(ValueError, match=r"'org/full'.*(Revision|revision|snapshot)"):
        hub.resolve("org/full", revision="f" * 40)
    # a repository without weights: enough for dummy weights and the tokenizer, not to load
    bare = lay_out_cache(offline, "org/bare", local, skip=("*.safetensors",))
    with pytest.raises(ValueError, match="no safetensors weights"):
        hub.resolve("org/bare")
    assert Path(hub.resolve("org/bare", kind="config")) == bare
    assert Path(hub.resolve("org/bare", kind="tokenizer")) == bare
    config = EngineConfig.from_kwargs("org/bare", load_format="dummy", tokenizer="org/bare")
    assert Path(config.model) == bare and Path(config.tokenizer) == bare
    assert config.revision is None  # (resolved: the snapshot's directory is what is held)
    # local paths pass through; a revision for one is refused
    assert hub.resolve(local) == local
    with pytest.raises(ValueError, match="applies to a model id on the Hugging Face hub"):
        hub.resolve(local, revision="main")
    with pytest.raises(ValueError, match="does not exist"):
        EngineConfig.from_kwargs("./no/such/dir")


@pytest.mark.parametrize(
    "name, expected",
    [
        ("Qwen/Qwen3-0.6B", True),
        ("gpt2", True),
        ("meta-llama/Llama-3.1-8B-Instruct", True),
        ("./models/qwen", False),
        ("/abs/path", False),
        ("a/b/c", False),
        ("org/../x", False),
        ("org--x/y", False),
        ("-org/x", False),
        ("", False),
    ],
)
def test_what_reads_as_a_hub_id(name, expected):
    assert hub.is_repo_id(name) is expected
