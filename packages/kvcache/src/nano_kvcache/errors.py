"""Exceptions of nano_kvcache."""


class KVCacheError(RuntimeError):
    """Base class of the block manager's errors."""


class OutOfBlocksError(KVCacheError):
    """Not enough free blocks right now; retry after other sequences free theirs."""


class SequenceTooLongError(KVCacheError, ValueError):
    """The sequence needs more blocks than the whole pool holds: it can never be allocated."""


class UnknownSequenceError(KVCacheError, KeyError):
    """The sequence holds no blocks of this block manager."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""
