"""The trace replayer's clients against a real HTTP server (a plain one on a socket here, that
streams the events an OpenAI-compatible server sends)."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from nano_engine.replay import Target, replay
from nano_scheduler.sim.workload import Request

pytest.importorskip("httpx")


class _Streaming(BaseHTTPRequestHandler):
    """GET /health: 200; POST /v1/completions: its max_tokens events of one token, then the
    usage. Every request's path and arrival is noted on the server."""

    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        self.server.seen.append((self.path, time.monotonic()))
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_POST(self) -> None:
        self.server.seen.append((self.path, time.monotonic()))
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        events = [b'data: {"choices": [{"text": "a"}]}\n\n'] * body["max_tokens"]
        usage = {"choices": [], "usage": {"completion_tokens": body["max_tokens"]}}
        events += [f"data: {json.dumps(usage)}\n\n".encode(), b"data: [DONE]\n\n"]
        payload = b"".join(events)
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture()
def server():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Streaming)
    httpd.seen = []
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield httpd
    httpd.shutdown()
    httpd.server_close()


def test_each_client_opens_its_connection_before_the_first_request_is_sent(server):
    """A client's first request costs it tens of milliseconds more than the next (httpx's
    lazy set-up, its connection): each client process pays that with a request to /health
    before the workload starts, so no request's times carry it."""
    url = f"http://127.0.0.1:{server.server_address[1]}"
    requests = [Request(0.0, 8, 3), Request(0.05, 8, 2), Request(0.1, 8, 4)]
    run = replay(Target(url, "m"), requests, processes=2)
    assert not run.failures
    assert [len(r.times) for r in run.records] == [3, 2, 4]
    health = [when for path, when in server.seen if path == "/health"]
    posts = [when for path, when in server.seen if path == "/v1/completions"]
    assert len(health) == 2 and len(posts) == 3
    assert max(health) < min(posts) and run.start <= min(r.sent for r in run.records)
