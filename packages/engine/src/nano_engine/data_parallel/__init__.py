"""Data parallelism: ``data_parallel_size`` engine replicas behind one front (``Fleet``), on
Ray (actors in a placement group, on one host or a cluster) or on this host's processes.

``start_engine(config)`` is what ``LLM`` and ``nano-engine serve`` call: one ``LLMEngine``, or a
``Fleet`` when the config asks for several replicas. The server runs even one engine as a fleet
of one process (``own_process``): its event loop then never holds the interpreter lock that the
engine's step loop needs.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod

from nano_engine.config import EngineConfig
from nano_engine.data_parallel.replica import ReplicaHandle

# (module, class) of each backend, imported when chosen: Ray is an optional dependency
BACKENDS = {
    "mp": ("nano_engine.data_parallel.processes", "ProcessBackend"),
    "ray": ("nano_engine.data_parallel.ray_actors", "RayBackend"),
}


class Backend(ABC):
    """Starts the replicas of a fleet and stops them (and what it set up for them)."""

    @abstractmethod
    def start(self, config: EngineConfig) -> list[ReplicaHandle]:
        """``config.data_parallel_size`` replicas, each started (its engine loaded), or an
        error naming the one that did not start (the others stopped)."""

    @abstractmethod
    def stop(self, replicas: list[ReplicaHandle]) -> None:
        """Shut every replica down (their polls then raise ``ReplicaGone``)."""

    def release(self) -> None:  # noqa: B027  (most backends hold nothing more)
        """Release what ``start`` set up beside the replicas, once no one polls them."""


def get_backend(name: str) -> Backend:
    if name not in BACKENDS:
        raise ValueError(
            f"unknown data_parallel_backend {name!r}; choose one of {sorted(BACKENDS)}"
        )
    module, cls = BACKENDS[name]
    return getattr(importlib.import_module(module), cls)()


def start_engine(config: EngineConfig, own_process: bool = False):
    """The engine ``config`` describes: an ``LLMEngine``, or a ``Fleet`` of replicas.
    ``own_process``: one engine runs in a process of its own all the same (a fleet of one, on
    this host's processes whatever ``data_parallel_backend`` says)."""
    if config.data_parallel_size > 1 or own_process:
        from nano_engine.data_parallel.fleet import Fleet

        if config.data_parallel_size == 1:
            config = config.replace(data_parallel_backend="mp")
        return Fleet(config)
    from nano_engine.engine import LLMEngine

    return LLMEngine(config)
