"""nano-kvcache: paged KV block manager with prefix caching, and the KV-store ops.

Importing this package does not import torch; ``nano_kvcache.ops`` and ``nano_kvcache.layout``
need it (``pip install nano-kvcache[torch]``).
"""

from nano_kvcache._version import __version__
from nano_kvcache.block_manager import BlockManager, BlockManagerStats, KVSequence
from nano_kvcache.errors import (
    KVCacheError,
    OutOfBlocksError,
    SequenceTooLongError,
    UnknownSequenceError,
)

__all__ = [
    "BlockManager",
    "BlockManagerStats",
    "KVCacheError",
    "KVSequence",
    "OutOfBlocksError",
    "SequenceTooLongError",
    "UnknownSequenceError",
    "__version__",
]
