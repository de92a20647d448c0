"""Host-to-device copies of a step's inputs through reused pinned buffers.

``tensor.pin_memory()`` on every step costs an ``is_pinned`` query and an allocation from the
caching host allocator (tens of microseconds each on a busy host), per copy. A ``PinnedStaging``
keeps a few pinned buffers and cycles through them: a step's inputs are written into the next
buffer with one ``memmove`` and copied to the device without waiting for the step the device
is running. A buffer is written again only once its last copy has been done (its event),
which with several buffers in turn (a step uses one or two) has long happened.
"""

from __future__ import annotations

import ctypes
from array import array

import torch

DTYPES = {"i": torch.int32, "q": torch.int64, "f": torch.float32, "d": torch.float64}


class PinnedStaging:
    def __init__(self, device: torch.device, slots: int = 6, nbytes: int = 1 << 16) -> None:
        self.device = device
        self._buffers = [
            torch.empty(nbytes, dtype=torch.uint8, pin_memory=True) for _ in range(slots)
        ]
        self._events: list[torch.cuda.Event | None] = [None] * slots
        self._next = 0

    def copy(self, data: array, out: torch.Tensor | None = None) -> torch.Tensor:
        """``data`` on the device: in ``out[:len(data)]`` (a device tensor of its type) or in a
        new tensor. The copy is queued on the current stream; ``data`` may change at once."""
        dtype = DTYPES[data.typecode]
        n = len(data)
        nbytes = n * data.itemsize
        slot = self._next
        self._next = (slot + 1) % len(self._buffers)
        event = self._events[slot]
        if event is not None:
            event.synchronize()  # (its last copy: done long ago, with several slots in turn)
        buffer = self._buffers[slot]
        if buffer.numel() < nbytes:
            buffer = torch.empty(
                max(nbytes, 2 * buffer.numel()), dtype=torch.uint8, pin_memory=True
            )
            self._buffers[slot] = buffer
        if nbytes:
            ctypes.memmove(buffer.data_ptr(), data.buffer_info()[0], nbytes)
        host = buffer[:nbytes].view(dtype)
        if out is None:
            out = torch.empty(n, dtype=dtype, device=self.device)
        elif out.dtype != dtype or out.numel() < n:
            raise ValueError(f"out must hold {n} {dtype}, got {out.numel()} {out.dtype}")
        out = out[:n]
        out.copy_(host, non_blocking=True)
        if event is None:
            event = self._events[slot] = torch.cuda.Event()
        event.record()
        return out
