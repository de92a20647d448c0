from __future__ import annotations

import pytest

from nano_models.testing import build_checkpoint


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    """Tiny random checkpoints (with tokenizer) of each architecture, built once."""
    built = {}

    def get(arch: str = "qwen3", **overrides):
        key = (arch, tuple(sorted(overrides.items())))
        if key not in built:
            path = tmp_path_factory.mktemp(arch)
            built[key] = str(build_checkpoint(path, arch, **overrides))
        return built[key]

    return get
