"""The control plane (nano_kvcache, nano_scheduler and its simulator) imports and works where
torch cannot be imported; the engine's command line parses and answers before it needs torch."""

import subprocess
import sys

import pytest

BLOCK_TORCH = """
import importlib.abc, sys

class NoTorch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)  # (as if absent)

sys.meta_path.insert(0, NoTorch())
"""

EXERCISE = """
import nano_kvcache

class Seq:
    def __init__(self, tokens):
        self.token_ids, self.block_table, self.num_cached_tokens = list(tokens), [], 0

bm = nano_kvcache.BlockManager(num_blocks=8, block_size=4)
a, b = Seq(range(10)), Seq(range(10))
bm.allocate(a); bm.commit(a, 10); bm.allocate(b)
assert b.num_cached_tokens == 8, b.num_cached_tokens
a.token_ids += [1, 2]; bm.may_append(a)
bm.deallocate(a); bm.deallocate(b)
assert bm.num_free_blocks == 8

from nano_scheduler import Scheduler, SchedulerConfig, Sequence, SamplingParams
import nano_scheduler.sim

sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64), bm)
sched.add(Sequence(1, list(range(20)), SamplingParams(max_tokens=3)))
while sched.has_unfinished():
    out = sched.schedule()
    sched.update(out, [5] * len(out.sampling_seqs))
assert bm.num_free_blocks == 8
assert "torch" not in sys.modules, sorted(m for m in sys.modules if m.startswith("torch"))
try:
    import nano_kvcache.ops
except ImportError as e:
    assert "pip install 'nano-kvcache[torch]'" in str(e), e  # (what to do, not a bare error)
else:
    raise AssertionError("ops imported without torch")
print("ok")
"""


def test_control_plane_works_without_torch():
    out = subprocess.run(
        [sys.executable, "-c", BLOCK_TORCH + EXERCISE], capture_output=True, text=True, check=False
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


COMMAND_LINE = """
import contextlib, io
from nano_engine import cli
import nano_engine

def run(*argv):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = cli.main(list(argv))
        except SystemExit as e:
            code = e.code
    return code, out.getvalue() + err.getvalue()

code, text = run("--version")
assert code == 0 and text.strip() == f"nano-engine {nano_engine.__version__}", (code, text)
code, text = run("serve", "--help")
assert code == 0 and "--port" in text, (code, text)
code, text = run("bench", "/nonexistent", "--load-format", "dummy")
assert code == 2 and "does not exist" in text, (code, text)
code, text = run("serve", "model", "--port", "99999")
assert code == 2 and "a port is 1-65535, got 99999" in text, (code, text)
assert "torch" not in sys.modules, sorted(m for m in sys.modules if m.startswith("torch"))
try:
    nano_engine.LLMEngine
except ModuleNotFoundError as e:
    assert e.name == "torch", e  # (the engine itself needs torch, and says so when asked for)
else:
    raise AssertionError("the engine imported without torch")
print("ok")
"""


def test_the_engine_command_line_answers_without_torch():
    """nano-engine's help, version and argument errors come before torch is imported (a
    second, not four: torch alone takes ~3 s to import on a 2-core machine)."""
    pytest.importorskip("nano_engine")  # (the build's no-torch venv has the control plane only)
    out = subprocess.run(
        [sys.executable, "-c", BLOCK_TORCH + COMMAND_LINE],
        capture_output=True,
        text=True,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
