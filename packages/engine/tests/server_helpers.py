"""A real nano-engine server in a subprocess on a free loopback port."""

from __future__ import annotations

import signal
import subprocess
import sys
import tempfile
import time

import httpx

from nano_engine.parallel import free_port


class ServerProcess:
    def __init__(self, model: str, *args: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        # A file, not a pipe: a full pipe would block the server.
        self.log = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115  (closed in stop)
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "nano_engine.cli",
                "serve",
                model,
                "--port",
                str(self.port),
                *args,
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            text=True,
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
            idle = (
                m["nano_requests_running"],
                m["nano_requests_waiting"],
                m["nano_kv_cache_usage"],
            ) == (0, 0, 0)
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
