"""Checkpoint tensors read lazily, so that a tensor-parallel rank reads only its slices."""

from __future__ import annotations

from collections.abc import Callable

import torch


class WeightSource:
    """One checkpoint tensor, not read yet. ``narrow`` reads only the rows or columns a shard
    needs; ``read`` the whole tensor. Bytes read are counted in ``bytes_read``."""

    def __init__(
        self,
        name: str,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        reader: Callable[[tuple[slice, ...]], torch.Tensor],
    ) -> None:
        self.name, self.shape, self.dtype, self._reader = name, tuple(shape), dtype, reader
        self.bytes_read = 0

    @classmethod
    def of(cls, name: str, tensor: torch.Tensor) -> WeightSource:
        """A source over an in-memory tensor (for tests and converted checkpoints)."""
        return cls(name, tensor.shape, tensor.dtype, lambda index: tensor[index])

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        index = tuple(
            slice(start, start + length) if d == dim else slice(None)
            for d in range(len(self.shape))
        )
        tensor = self._reader(index)
        self.bytes_read += tensor.numel() * tensor.element_size()
        return tensor

    def read(self) -> torch.Tensor:
        return self.narrow(0, 0, self.shape[0]) if self.shape else self._read_scalar()

    def _read_scalar(self) -> torch.Tensor:
        tensor = self._reader(())
        self.bytes_read += tensor.element_size()
        return tensor

    def expect_shape(self, shape: tuple[int, ...]) -> None:
        if self.shape != tuple(shape):
            raise ValueError(
                f"checkpoint tensor {self.name} has shape {self.shape}, "
                f"the model expects {tuple(shape)}"
            )


def default_weight_loader(param: torch.nn.Parameter, source: WeightSource, shard_id=None) -> None:
    """A replicated parameter: the whole checkpoint tensor, of the parameter's shape."""
    source.expect_shape(tuple(param.shape))
    param.data.copy_(source.read())
