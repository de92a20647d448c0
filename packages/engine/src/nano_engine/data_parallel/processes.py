"""Replicas as processes of this host (``data_parallel_backend="mp"``): no cluster to set up,
for one machine's GPUs. Replica i gets GPUs [i * tp, (i + 1) * tp) of those visible here.

Each process runs a ``ReplicaCore``: a thread takes the front's commands from one pipe in
order (submit, abort, calls), the main thread sends batches of outputs on another. A process
that ends closes its pipe: the front's reader sees it at once.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import os
import queue
import signal
import threading
import time
import traceback
from multiprocessing.connection import Connection, wait

from nano_engine.config import EngineConfig
from nano_engine.data_parallel import Backend
from nano_engine.data_parallel.replica import (
    STATS_PERIOD,
    Batch,
    ReplicaCore,
    ReplicaGone,
    ReplicaHandle,
    RequestSpec,
)
from nano_engine.interpreter import LOG_FORMAT

log = logging.getLogger("nano_engine")
_START_TIMEOUT = 3600.0  # seconds for a replica to load (a dead one is seen at once)


def _replica_main(
    config: EngineConfig,
    index: int,
    visible: str | None,
    commands: Connection,
    results: Connection,
    log_level: int,
) -> None:
    # (Ctrl-C and a service manager's SIGTERM reach the whole process group: the front stops
    # the replicas in order, after its in-flight requests, and a front that dies closes the
    # command pipe, which ends the replica)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=log_level, format=LOG_FORMAT)
    if visible is not None:  # (before anything initializes CUDA in this process)
        os.environ["CUDA_VISIBLE_DEVICES"] = visible
    loaded = threading.Event()
    watcher = threading.Thread(target=_exit_if_abandoned, args=(commands, loaded), daemon=True)
    watcher.start()
    try:
        core = ReplicaCore(config, index)
        info = core.info()
    except BaseException as e:
        if not isinstance(e, ValueError):  # (a user's error needs no traceback)
            traceback.print_exc()
        with contextlib.suppress(OSError):
            results.send(("failed", (type(e).__name__, str(e))))
        raise SystemExit(1) from None
    finally:
        loaded.set()
        watcher.join()
    results.send(("ready", info))
    sending = threading.Lock()
    stopped = threading.Event()

    def call(method: str, args: tuple) -> None:
        try:
            value = getattr(core, method)(*args)
        except Exception as e:  # (raised again in the front)
            value = e
        with sending:
            results.send(("result", value))

    def serve_commands() -> None:
        try:
            while True:
                kind, payload = commands.recv()
                if kind == "submit":
                    core.submit(payload)
                elif kind == "abort":
                    core.abort(payload)
                elif kind == "call":
                    # (on a thread of its own: this one never waits on the results pipe, so
                    # the front's commands always go through, whatever its reader is doing)
                    threading.Thread(target=call, args=payload, daemon=True).start()
                else:  # stop
                    break
        except (EOFError, OSError):
            pass  # the front is gone
        finally:
            stopped.set()

    threading.Thread(target=serve_commands, name="nano-replica-commands", daemon=True).start()
    try:
        while not stopped.is_set():
            batch = core.outputs(STATS_PERIOD)
            with sending:
                results.send(("batch", batch))
    except (BrokenPipeError, OSError):
        pass
    finally:
        core.shutdown()


def _exit_if_abandoned(commands: Connection, loaded: threading.Event) -> None:
    """While the engine loads: end this process at once if the front goes away or asks it to
    stop (it sends nothing else before the replica is ready), rather than load a model for
    nobody."""
    while not loaded.is_set():
        try:
            if commands.poll(0.2):
                commands.recv()  # (a stop)
                os._exit(1)
        except (EOFError, OSError):
            os._exit(1)


class ProcessReplica(ReplicaHandle):
    """The front's end: commands go through a queue to a thread that writes them to the
    replica's pipe in order (a caller never waits on the pipe); the reader's ``poll`` reads
    batches and hands calls' results to their callers."""

    def __init__(
        self, index: int, process: mp.Process, commands: Connection, results: Connection
    ) -> None:
        self.index, self.process = index, process
        self._commands, self._results = commands, results
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._broken = False  # the command pipe failed: the replica is gone
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._calling = threading.Lock()
        # (joins from two threads race in waitpid: one of them would see a reaped process
        # as alive)
        self._reaping = threading.Lock()
        self._writer = threading.Thread(
            target=self._write, name=f"nano-fleet-send-{index}", daemon=True
        )
        self._writer.start()

    def _write(self) -> None:
        while (message := self._outbox.get()) is not None:
            try:
                self._commands.send(message)
            except (OSError, ValueError):  # (gone: its pipe's reader sees it too)
                self._broken = True
                return

    def _send(self, message: tuple) -> None:
        if self._broken:
            raise ReplicaGone(self._gone())
        self._outbox.put(message)

    def submit(self, specs: list[RequestSpec]) -> None:
        self._send(("submit", specs))

    def abort(self, request_id: str) -> None:
        self._send(("abort", request_id))

    def poll(self) -> Batch:
        while True:
            try:
                kind, payload = self._results.recv()
            except (EOFError, OSError) as e:
                raise ReplicaGone(self._gone()) from e
            if kind == "batch":
                return payload
            self._calls.put(payload)  # (a call's result: its caller waits for it)

    def call(self, method: str, *args: object) -> object:
        with self._calling:
            self._send(("call", (method, args)))
            while True:
                try:
                    value = self._calls.get(timeout=1.0)
                    break
                except queue.Empty:
                    with self._reaping:
                        alive = self.process.is_alive()
                    if not alive or self._broken:
                        raise ReplicaGone(self._gone()) from None
        if isinstance(value, Exception):
            raise value
        return value

    def stop(self) -> None:
        with contextlib.suppress(ReplicaGone):
            self._send(("stop", None))

    def close(self, timeout: float) -> None:
        self.stop()
        with self._reaping:
            self.process.join(timeout)
            if self.process.is_alive():
                log.warning("%s did not stop within %.0f s: killed", self.describe(), timeout)
                self.process.kill()
                self.process.join(5)
        self._outbox.put(None)  # (the writer ends)
        self._writer.join(5)
        self._commands.close()
        self._results.close()  # (a reader in recv: EOF, it ends)

    def _gone(self) -> str:
        with self._reaping:
            self.process.join(1.0)  # (its exit code, once it is reaped)
            code = self.process.exitcode
        return "its process ended" + (f" with exit code {code}" if code is not None else "")


class ProcessBackend(Backend):
    def start(self, config: EngineConfig) -> list[ReplicaHandle]:
        n = config.data_parallel_size
        if n == 1:  # (the engine picks its device and sees the GPUs as this process does; the
            # server's front, which starts it, imports no torch)
            device, gpus = config.device, [None]
        else:
            device = _device(config.device)
            gpus = _gpu_slices(n, config.tensor_parallel_size) if device == "cuda" else [None] * n
        context = mp.get_context("spawn")
        replica_config = config.replace(data_parallel_size=1, device=device)
        level = logging.getLogger("nano_engine").getEffectiveLevel()  # (-v reaches them too)
        handles: list[ProcessReplica] = []
        for i in range(n):
            command_end, commands = context.Pipe(duplex=False)
            results, result_end = context.Pipe(duplex=False)
            # (not a daemon: a replica starts tensor-parallel workers of its own)
            process = context.Process(
                target=_replica_main,
                args=(replica_config, i, gpus[i], command_end, result_end, level),
                name=f"nano-engine-dp{i}",
            )
            process.start()
            command_end.close()
            result_end.close()
            handles.append(ProcessReplica(i, process, commands, results))
        try:
            self._wait_started(handles)
        except BaseException:
            self.stop(handles)
            raise
        return handles

    def _wait_started(self, handles: list[ProcessReplica]) -> None:
        """Each replica's first message: ready (with its info) or why it failed."""
        deadline = time.monotonic() + _START_TIMEOUT
        waiting = {h._results: h for h in handles}
        while waiting:
            ready = wait([*waiting, *(h.process.sentinel for h in waiting.values())], timeout=1.0)
            for conn in [c for c in ready if c in waiting]:
                handle = waiting.pop(conn)
                try:
                    kind, payload = conn.recv()
                except (EOFError, OSError):
                    kind, payload = "failed", handle._gone()
                if kind != "ready":
                    raise _start_error(handle.index, len(handles), payload)
                handle.info = payload
            for handle in waiting.values():
                if not handle.process.is_alive() and not handle._results.poll():
                    raise RuntimeError(
                        f"data-parallel replica {handle.index} did not start: {handle._gone()}"
                    )
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"data-parallel replicas {sorted(h.index for h in waiting.values())} did not "
                    f"start within {_START_TIMEOUT:.0f} s"
                )

    def stop(self, replicas: list[ReplicaHandle]) -> None:
        for replica in replicas:  # (all at once: each engine stops in parallel)
            replica.stop()
        for replica in replicas:
            replica.close(timeout=30.0)


def _start_error(index: int, replicas: int, failure: str | tuple[str, str]) -> Exception:
    """Why a replica did not start: a user's error (a ValueError in the replica: a setting
    that does not fit the model or the device) as itself, the rest as a RuntimeError."""
    if isinstance(failure, tuple):
        kind, message = failure
        if kind == "ValueError":
            if replicas == 1:
                return ValueError(message)
            return ValueError(f"data-parallel replica {index} did not start: {message}")
        failure = f"{kind}: {message}"
    what = "the engine's process" if replicas == 1 else f"data-parallel replica {index}"
    return RuntimeError(f"{what} did not start: {failure}")


def _device(device: str) -> str:
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _gpu_slices(replicas: int, tp: int) -> list[str | None]:
    """CUDA_VISIBLE_DEVICES of each replica: consecutive GPUs of those visible here."""
    import torch

    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = (
        [d.strip() for d in visible.split(",") if d.strip()]
        if visible is not None
        else [str(i) for i in range(torch.cuda.device_count())]
    )
    if len(ids) < replicas * tp:
        if replicas == 1:  # (one engine in its own process: its own check says what is wrong)
            return [None]
        raise ValueError(
            f"data_parallel_size {replicas} x tensor_parallel_size {tp} needs {replicas * tp} "
            f"GPUs; {len(ids)} are visible"
        )
    return [",".join(ids[i * tp : (i + 1) * tp]) for i in range(replicas)]
