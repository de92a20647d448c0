"""The READMEs' commands as written: every ``nano-engine`` and ``nano-sim`` command parses with
the real command line (its flags exist, its values are valid), every nox session named exists,
every file of the repository a command names is there, every Python block compiles and imports
what exists. Placeholders (``/path/to/...``) and third-party commands are left alone; what
needs a GPU or a model is not run here."""

from __future__ import annotations

import ast
import importlib
import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
READMES = [ROOT / "README.md", *sorted(ROOT.glob("packages/*/README.md"))]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)
SESSIONS = set(re.findall(r"@nox\.session[^\n]*\ndef (\w+)\(", (ROOT / "noxfile.py").read_text()))


def blocks(language: str) -> list[tuple[str, str]]:
    """(README:line, code) of every fenced block in ``language``."""
    found = []
    for readme in READMES:
        text = readme.read_text()
        for m in FENCE.finditer(text):
            if m.group(1) == language:
                line = text[: m.start()].count("\n") + 2
                found.append((f"{readme.relative_to(ROOT)}:{line}", m.group(2)))
    return found


def commands() -> list[tuple[str, list[str]]]:
    """(where, argv) of every simple command in the shell blocks (comments dropped; chains
    split at &&, ||, ; and |; leading VAR=value assignments dropped)."""
    out = []
    for where, code in blocks("bash"):
        for line in code.replace("\\\n", " ").splitlines():  # (continued lines joined)
            words = shlex.split(line, comments=True)
            command: list[str] = []
            for word in [*words, ";"]:
                if word in ("&&", "||", ";", "|"):
                    while command and re.fullmatch(r"[A-Z_]+=.*", command[0]):
                        command.pop(0)
                    if command:
                        out.append((where, command))
                    command = []
                else:
                    command.append(word)
    return out


ALL = commands()


def test_the_readmes_have_commands_to_check():
    assert len(ALL) >= 10 and any(argv[0] == "nano-engine" for _, argv in ALL)


def repository_paths(argv: list[str]) -> list[str]:
    """The arguments that name a file or folder of this repository."""
    return [
        a
        for a in argv
        if not a.startswith(("/", "-", "http"))
        and "path/to" not in a
        and re.match(r"\.?/?(packages|benchmarks|scripts|tests|csrc)(/|$)", a)
    ]


@pytest.mark.parametrize("where, argv", ALL, ids=[f"{w} {' '.join(a)[:50]}" for w, a in ALL])
def test_a_readme_command_is_valid_as_written(where, argv):
    for path in repository_paths(argv):
        path = re.sub(r"\[.*\]$", "", path)  # ("./packages/engine[serve]": the folder)
        assert (ROOT / path).exists(), f"{where}: {path} is not in the repository"
    program, args = argv[0], argv[1:]
    if program == "nano-engine":
        from nano_engine.cli import build_parser

        try:
            build_parser().parse_args(args)
        except SystemExit as e:
            pytest.fail(f"{where}: `{shlex.join(argv)}` does not parse (exit {e.code})")
    elif program == "nano-sim":
        from nano_scheduler.sim.cli import parse_args

        try:
            parse_args(args)
        except SystemExit as e:
            pytest.fail(f"{where}: `{shlex.join(argv)}` does not parse (exit {e.code})")
    elif "nox" in argv[:3]:
        named = [args[i + 1] for i, a in enumerate(args[:-1]) if a == "-s"]
        assert set(named) <= SESSIONS, f"{where}: no nox session {set(named) - SESSIONS}"
    elif program in ("python", "python3") and args and args[0].endswith(".py"):
        assert (ROOT / args[0]).is_file(), f"{where}: {args[0]} is not in the repository"


@pytest.mark.parametrize("where, code", blocks("python"), ids=[w for w, _ in blocks("python")])
def test_a_readme_python_block_compiles_and_imports_what_exists(where, code):
    tree = compile(code, where, "exec", ast.PyCF_ONLY_AST)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("nano_"):
            module = importlib.import_module(node.module)
            for alias in node.names:
                assert hasattr(module, alias.name), f"{where}: {node.module} has no {alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("nano_"):
                    importlib.import_module(alias.name)
