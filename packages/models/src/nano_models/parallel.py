"""Tensor parallelism: which shard this process holds, and the collectives between shards."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TensorParallel:
    """This process's place in a tensor-parallel group. Size 1 needs no process group."""

    rank: int = 0
    size: int = 1
    group: dist.ProcessGroup | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"rank {self.rank} is outside a group of {self.size}")
        if self.size > 1 and not dist.is_initialized():
            raise ValueError("tensor parallelism needs torch.distributed to be initialized")

    @classmethod
    def from_group(cls, group: dist.ProcessGroup | None = None) -> TensorParallel:
        """This process in ``group`` (the default group if None)."""
        return cls(dist.get_rank(group), dist.get_world_size(group), group)

    def split(self, total: int, what: str) -> int:
        """This rank's share of ``total`` items, which must divide evenly."""
        if total % self.size:
            raise ValueError(
                f"{what} ({total}) is not divisible by tensor_parallel_size ({self.size})"
            )
        return total // self.size

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def gather(self, x: torch.Tensor) -> torch.Tensor | None:
        """Concatenate every rank's ``x`` along the last dim on rank 0 (None elsewhere)."""
        if self.size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)] if self.rank == 0 else None
        dist.gather(
            x, parts, dst=dist.get_global_rank(self.group, 0) if self.group else 0, group=self.group
        )
        return torch.cat(parts, dim=-1) if parts is not None else None


SINGLE = TensorParallel()
