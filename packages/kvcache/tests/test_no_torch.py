"""nano_kvcache's control plane imports and works where torch cannot be imported."""

import subprocess
import sys

BLOCK_TORCH = """
import importlib.abc, sys

class NoTorch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError("torch is blocked in this test")

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
assert "torch" not in sys.modules
try:
    import nano_kvcache.ops
except ImportError:
    pass
else:
    raise AssertionError("ops imported without torch")
print("ok")
"""


def test_block_manager_works_without_torch():
    out = subprocess.run(
        [sys.executable, "-c", BLOCK_TORCH + EXERCISE], capture_output=True, text=True, check=False
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
