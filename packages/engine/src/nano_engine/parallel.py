"""Tensor-parallel workers: ranks 1..N-1 in their own processes, rank 0 in the engine.

Tensors move through torch.distributed (NCCL on GPU, gloo on CPU) on a free port chosen per
engine; each step's ``StepInput`` goes to every worker over its own pipe (with async scheduling,
the previous step's sampled tokens follow by broadcast). A worker that dies is
seen within a fraction of a second by ``dead()`` (the engine polls it) and reported with its
exit code; ``shutdown`` stops and joins every process.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import multiprocessing as mp
import socket
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from nano_engine.config import EngineConfig
from nano_engine.model_runner import ModelRunner, StepInput
from nano_models import ModelConfig, TensorParallel

log = logging.getLogger("nano_engine")
_TIMEOUT = timedelta(minutes=10)  # model loading and graph capture happen under it


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_group(rank: int, world: int, port: int, device: torch.device) -> TensorParallel:
    backend = "nccl" if device.type == "cuda" else "gloo"
    kwargs = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group(
        backend,
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=_TIMEOUT,
        **kwargs,
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
    conn.send("ready")  # imported and unpickled: the engine may join the process group now
    dev = rank_device(torch.device(device), rank)
    tp = init_group(rank, world, port, dev)
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


class Workers:
    def __init__(
        self,
        config: EngineConfig,
        model_config: ModelConfig,
        device: torch.device,
        max_model_len: int,
    ) -> None:
        self.world = config.tensor_parallel_size
        if device.type == "cuda" and torch.cuda.device_count() < self.world:
            raise ValueError(
                f"tensor_parallel_size {self.world} needs {self.world} GPUs, "
                f"{torch.cuda.device_count()} are visible"
            )
        self.port = free_port()
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
        self._wait_ready()
        log.info(
            "started %d tensor-parallel workers (pids %s, port %d)",
            self.world - 1,
            [p.pid for p in self.procs],
            self.port,
        )

    def _wait_ready(self, timeout: float = 300.0) -> None:
        """Wait for every worker to start (import, unpickle its arguments). One that exits
        first is an error naming it: the process group would otherwise wait for it for
        minutes."""
        deadline = time.monotonic() + timeout
        for rank, (proc, conn) in enumerate(zip(self.procs, self.conns), start=1):
            while True:
                if conn.poll(0.05):
                    with contextlib.suppress(EOFError):  # (EOF: it exited)
                        conn.recv()
                        break
                    proc.join(5)
                if proc.exitcode is not None or time.monotonic() > deadline:
                    why = (
                        f"exit code {proc.exitcode}; its error is above"
                        if proc.exitcode is not None
                        else f"nothing within {timeout:.0f} s"
                    )
                    self.shutdown(timeout=1.0)
                    raise RuntimeError(
                        f"tensor-parallel worker {rank} (pid {proc.pid}) did not start ({why})"
                    )

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
