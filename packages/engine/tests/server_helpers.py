"""A real nano-engine server in a subprocess on a free loopback port."""

from __future__ import annotations

import signal
import subprocess
import sys
import tempfile
import time

import httpx

from nano_engine.parallel import free_port


def _limit_files(soft: int) -> None:
    import resource

    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def vllm_metric(name: str, model: str, engine: str = "0", **labels: str) -> str:
    """The key of a vLLM metric of one engine (a data-parallel replica) in
    ``ServerProcess.metrics()``."""
    labels = {"model_name": model, "engine": engine, **labels}
    items = ",".join(f"{k}={v}" for k, v in sorted(labels.items()))
    return f"vllm:{name}{{{items}}}"


# The command line in a process where torch cannot be imported (as if it were absent); the
# processes it starts import as usual.
WITHOUT_TORCH = """
import importlib.abc, sys

class NoTorch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)

sys.meta_path.insert(0, NoTorch())
from nano_engine.cli import main
sys.exit(main())
"""


class ServerProcess:
    def __init__(
        self, model: str, *args: str, open_files: int | None = None, without_torch: bool = False
    ) -> None:
        """``open_files``: the server's soft limit on open files at start; ``without_torch``:
        the server's own process cannot import torch."""
        self.port = free_port()
        self.model = model
        self.url = f"http://127.0.0.1:{self.port}"
        # A file, not a pipe: a full pipe would block the server.
        self.log = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115  (closed in stop)
        command = ["-c", WITHOUT_TORCH] if without_torch else ["-m", "nano_engine.cli"]
        self.proc = subprocess.Popen(
            [sys.executable, *command, "serve", model, "--port", str(self.port), *args],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            text=True,
            preexec_fn=None if open_files is None else lambda: _limit_files(open_files),
        )
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.log.seek(0)
                raise RuntimeError(f"the server exited: {self.log.read()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError("the server did not become healthy")

    def output(self) -> str:
        """What the server has written to stdout and stderr so far."""
        # A new open file: seeking the shared one would move the server's write offset too.
        with open(f"/proc/self/fd/{self.log.fileno()}") as f:
            return f.read()

    def metric(self, name: str, **labels: str) -> float:
        return self.metrics().get(vllm_metric(name, self.model, **labels), 0.0)

    def metrics(self) -> dict[str, float]:
        from prometheus_client.parser import text_string_to_metric_families

        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        values = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
                values[sample.name + (f"{{{labels}}}" if labels else "")] = sample.value
        return values

    def wait_idle(self, timeout: float = 30) -> dict[str, float]:
        """Metrics once nothing runs or waits and no KV block is in use."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            running, waiting, usage = (
                vllm_metric(name, self.model)
                for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")
            )
            idle = (m[running], m[waiting], m[usage]) == (0, 0, 0)
            if idle or time.monotonic() > deadline:
                return m
            time.sleep(0.1)

    def stop(self, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()
        finally:
            self.log.close()
