"""Tensor-parallel workers: ranks 1..N-1 in their own processes, rank 0 in the engine.

Tensors move through torch.distributed (NCCL on GPU, gloo on CPU) on a free port chosen per
engine; each step's ``StepInput`` goes to every worker over its own pipe (with async scheduling,
the previous step's sampled tokens follow by broadcast). A worker that dies is seen within a
fraction of a second, from its spawn on: while rank 0 starts (``start``: the rendezvous, the
load, the KV sizing and graph capture, each waiting on every rank) and while it serves
(``dead()``, which the engine polls), and reported with its exit code; ``shutdown`` stops and
joins every process.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import multiprocessing as mp
import socket
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from multiprocessing.connection import wait
from typing import TypeVar

import torch
import torch.distributed as dist

from nano_engine.config import EngineConfig
from nano_engine.model_runner import ModelRunner, StepInput
from nano_models import ModelConfig, TensorParallel

log = logging.getLogger("nano_engine")
T = TypeVar("T")
_TIMEOUT = timedelta(minutes=10)  # model loading and graph capture happen under it


def _joined(rank: int) -> str:
    """The key a worker sets in rank 0's store once it has started and connected."""
    return f"nano-engine/joined/{rank}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_group(rank: int, world: int, store: dist.Store, device: torch.device) -> TensorParallel:
    """Join the process group through ``store`` (rank 0's, which every worker has joined)."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    kwargs = {"device_id": device} if device.type == "cuda" else {}
    world_state = getattr(dist.distributed_c10d, "_world", None)
    if world_state is not None and not dist.is_initialized():
        # torch names a default group by a count that only a destroyed group resets: a start
        # that failed with a thread left in the rendezvous (Workers.start) took "0". The
        # workers, new processes, count from 0.
        world_state.group_count = 0
    dist.init_process_group(
        backend, store=store, rank=rank, world_size=world, timeout=_TIMEOUT, **kwargs
    )
    return TensorParallel.from_group()


def abort_group(runner: ModelRunner | None) -> None:
    """Abort the process group (NCCL) when a peer may never join its collectives or finalize:
    dead, or failed in the middle of a step. Its kernels then exit. NCCL's abort, like its
    destroy, waits for every CUDA graph that captured one of its collectives (seen on two
    H200s), so the runner's graphs go first."""
    if not dist.is_initialized() or dist.get_backend() != "nccl":
        return  # (gloo: a collective with a peer gone raises)
    abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
    if abort is None:
        return
    if runner is not None:
        runner.release_graphs()
    abort()


def rank_device(device: torch.device, rank: int) -> torch.device:
    return torch.device("cuda", rank) if device.type == "cuda" else device


def _worker_main(
    rank: int,
    world: int,
    port: int,
    config: EngineConfig,
    model_config: ModelConfig,
    device: str,
    max_model_len: int,
    conn,
) -> None:
    dev = rank_device(torch.device(device), rank)
    store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=_TIMEOUT)
    store.set(_joined(rank), "1")  # imported and unpickled: rank 0 may join the process group now
    tp = init_group(rank, world, store, dev)
    runner, stopped = None, False
    try:
        runner = ModelRunner(config, model_config, dev, tp, max_model_len)
        gc.collect()
        gc.freeze()  # as the engine does (_freeze_gc); this process ends with the runner
        sampled_rows = 0  # of the previous step
        while True:
            step = conn.recv()
            if step is None:
                stopped = True
                break
            previous = None
            if step.pending_rows:  # async scheduling: rank 0's tokens of the previous step
                previous = torch.empty(sampled_rows, dtype=torch.int64, device=dev)
                dist.broadcast(previous, src=0)
            runner.execute(step, previous)
            sampled_rows = len(step.logits_rows)
    except EOFError:
        pass  # the engine is gone
    finally:
        try:
            if not stopped:  # failed (maybe mid-step), or rank 0 is gone: exit without peers
                abort_group(runner)
            if runner is not None:
                runner.close()  # its CUDA graphs first: NCCL's destroy waits for them
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()


def _capture(fn: Callable[[], object], outcome: list) -> None:
    try:
        outcome.append((True, fn()))
    except BaseException as error:  # (handed to the waiting thread, which raises it)
        outcome.append((False, error))


class Workers:
    def __init__(
        self,
        config: EngineConfig,
        model_config: ModelConfig,
        device: torch.device,
        max_model_len: int,
    ) -> None:
        self.world = config.tensor_parallel_size
        self.stuck: threading.Thread | None = None  # rank 0's start, left in a wait by start()
        if device.type == "cuda" and torch.cuda.device_count() < self.world:
            raise ValueError(
                f"tensor_parallel_size {self.world} needs {self.world} GPUs, "
                f"{torch.cuda.device_count()} are visible"
            )
        # Rank 0's store, which the workers join before anyone waits in the process group: a
        # worker that dies first is seen by polling it, with no thread left in a rendezvous.
        self.store = dist.TCPStore(
            "127.0.0.1", 0, self.world, is_master=True, timeout=_TIMEOUT, wait_for_workers=False
        )
        self.port = self.store.port
        context = mp.get_context("spawn")
        self.procs, self.conns = [], []
        for rank in range(1, self.world):
            parent, child = context.Pipe()
            proc = context.Process(
                target=_worker_main,
                name=f"nano-engine-tp{rank}",
                daemon=True,
                args=(
                    rank,
                    self.world,
                    self.port,
                    config,
                    model_config,
                    device.type,
                    max_model_len,
                    child,
                ),
            )
            proc.start()
            child.close()
            self.procs.append(proc)
            self.conns.append(parent)
        self._wait_joined()
        log.info(
            "started %d tensor-parallel workers (pids %s, port %d)",
            self.world - 1,
            [p.pid for p in self.procs],
            self.port,
        )

    def _wait_joined(self, timeout: float = 300.0) -> None:
        """Wait for every worker to start (import, unpickle its arguments) and join the store.
        One that exits first, or not in ``timeout`` seconds, is an error naming it: the process
        group would otherwise wait for it for minutes."""
        deadline = time.monotonic() + timeout
        waiting = dict(enumerate(self.procs, start=1))
        while waiting:
            wait([proc.sentinel for proc in waiting.values()], timeout=0.05)
            for rank, proc in list(waiting.items()):
                if self.store.check([_joined(rank)]):
                    del waiting[rank]
                elif proc.exitcode is not None or time.monotonic() > deadline:
                    why = (
                        f"exit code {proc.exitcode}; its error is above"
                        if proc.exitcode is not None
                        else f"nothing within {timeout:.0f} s"
                    )
                    self.shutdown(timeout=1.0)
                    raise RuntimeError(
                        f"tensor-parallel worker {rank} (pid {proc.pid}) did not start ({why})"
                    )

    def start(self, fn: Callable[[], T]) -> T:
        """Run ``fn``, this rank's part of the start-up (joining the process group, loading,
        sizing the KV cache, capturing graphs: each waits for every rank), in a thread while
        watching the workers. A worker that exits meanwhile fails the start within a fraction
        of a second with a RuntimeError naming it, instead of leaving this rank in the
        rendezvous or a collective until the group's timeout (minutes). The thread is then left
        to its wait: a gloo collective fails once its peer is gone, an NCCL group is aborted,
        a rendezvous ends at its timeout."""
        outcome: list = []
        thread = threading.Thread(
            target=_capture, args=(fn, outcome), name="nano-engine-start", daemon=True
        )
        thread.start()
        sentinels = [proc.sentinel for proc in self.procs]
        while thread.is_alive():
            wait(sentinels, timeout=0.1)
            if (message := self.dead()) is not None:
                # (NCCL's abort waits for the graphs captured so far, which the thread holds:
                # on a thread of its own, so that this one reports at once in any case)
                threading.Thread(target=abort_group, args=(None,), daemon=True).start()
                thread.join(5.0)  # (its collective's error, if it has one, is no news)
                if thread.is_alive():
                    self.stuck = thread
                    log.warning(
                        "rank 0's start is left waiting for the dead worker (in the process "
                        "group's rendezvous or a collective): the group stays as it is"
                    )
                raise RuntimeError(f"{message} while the engine started; its error is above")
        ok, value = outcome[0]
        if ok:
            return value
        if isinstance(value, (ValueError, TypeError)):
            raise value  # (the configuration's fault, on every rank: this rank says which)
        # A peer's death often reaches this rank first as its collective's error: name the
        # worker. Its sockets and sentinel close before it can be reaped (on a busy host, a
        # while before), so its exit code is polled for, not only waited on.
        deadline = time.monotonic() + 2.0
        while (message := self.dead()) is None and time.monotonic() < deadline:
            time.sleep(0.01)
        if message is not None:
            raise RuntimeError(f"{message} while the engine started; its error is above") from value
        raise value

    def dead(self) -> str | None:
        """A message naming the first worker that exited, or None."""
        for rank, proc in enumerate(self.procs, start=1):
            if proc.exitcode is not None:
                return (
                    f"tensor-parallel worker {rank} (pid {proc.pid}) exited with code "
                    f"{proc.exitcode}"
                )
        return None

    def send(self, step: StepInput, previous: torch.Tensor | None = None) -> None:
        """Give every worker a step, and where it has inputs still being sampled (async
        scheduling), the previous step's sampled tokens ``previous``: broadcast in stream
        order, no host wait. (Only now, not when they were sampled: a failure on this rank in
        between leaves no worker waiting in a collective.)"""
        for conn in self.conns:
            conn.send(step)
        if step.pending_rows:
            dist.broadcast(previous, src=0)

    def stop(self) -> None:
        """Ask every worker to leave its loop (it then destroys its process group)."""
        for conn in self.conns:
            with contextlib.suppress(OSError):
                conn.send(None)

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop (if not asked yet) and join every worker, terminating those still alive after
        ``timeout`` seconds."""
        self.stop()
        deadline = time.monotonic() + timeout
        for proc in self.procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        for proc in self.procs:
            if proc.is_alive():
                proc.terminate()
        for proc in self.procs:
            proc.join(timeout)
        for conn in self.conns:
            conn.close()
        self.procs, self.conns = [], []
