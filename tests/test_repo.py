"""Repository-level promises: one version for every package, and CI running the README's tests."""

from __future__ import annotations

import importlib.metadata
import re
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = sorted(p for p in (ROOT / "packages").iterdir() if (p / "pyproject.toml").exists())
VERSION = (ROOT / "VERSION").read_text().strip()


def test_every_package_has_the_one_version():
    assert re.fullmatch(r"\d+\.\d+\.\d+\S*", VERSION)
    for package in PACKAGES:
        link = package / "VERSION"
        assert link.is_symlink() and link.resolve() == ROOT / "VERSION", link
        dist = f"nano-{package.name}"
        assert importlib.metadata.version(dist) == VERSION, dist
        module = __import__(f"nano_{package.name}")
        assert module.__version__ == VERSION


def test_siblings_are_pinned_to_the_one_version():
    names = {f"nano-{p.name}" for p in PACKAGES}
    for package in PACKAGES:
        for line in importlib.metadata.requires(f"nano-{package.name}") or []:
            req = Requirement(line)
            if req.name in names:
                assert str(req.specifier) == f"=={VERSION}", (package.name, line)


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    commands = re.search(r"```bash\n(.*?)```", readme, re.S).group(1).splitlines()
    test_command = next(c for c in commands if "nox -s tests" in c).split("#")[0].strip()
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert test_command in ci
