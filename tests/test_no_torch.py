"""The control plane (nano_kvcache, nano_scheduler and its simulator) imports and works where
torch cannot be imported."""

import subprocess
import sys

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
