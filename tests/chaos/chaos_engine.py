"""A faulty engine: a loopback HTTP proxy in front of a real `plies serve` that misbehaves.

The loop's sampler talks to the proxy; every request is relayed to the real server, except
that, after `after` completions went through, the next `count` completions get the fault:

- `5xx`: an error status (500, 502, 503 or 504) instead of the engine's answer;
- `garbage`: the engine ran, but its answer is cut in half, not JSON, of the wrong shape,
  carries one id more than logprobs, ids outside the vocabulary, or a NaN logprob;
- `silent`: no answer at all: the connection is held open until the client gives up, or
  closed without a byte.

Only `/v1/completions` misbehaves; loading policies and listing models stay truthful, so the
loop can still publish. The proxy runs in threads of the test process (`http.server`), so
each trial starts and stops its own.
"""

from __future__ import annotations

import http.client
import json
import random
import select
import socket
import threading
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

ENGINE_FAULTS = ("5xx", "garbage", "silent")
HANG_LIMIT_S = 60.0
"""Longest a silent answer holds a connection whose client never gives up."""


class FaultyEngine:
    """The proxy; `url` is where clients connect. Use as a context manager.

    Args:
        upstream: the real server's base URL.
        fault: one of `ENGINE_FAULTS`.
        after: completions relayed faithfully before the fault starts.
        count: completions that get the fault; later ones are relayed again.
        seed: picks the variant of each faulty answer.
    """

    def __init__(self, upstream: str, fault: str, *, after: int, count: int, seed: int):
        if fault not in ENGINE_FAULTS:
            raise ValueError(f"unknown engine fault {fault!r}")
        parts = urlsplit(upstream)
        self.upstream = (parts.hostname or "127.0.0.1", parts.port or 80)
        self.fault = fault
        self.after = after
        self.count = count
        self.injected: Counter[str] = Counter()
        self.relayed = 0
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self._closing = threading.Event()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        self._server.daemon_threads = True
        self._server.engine = self  # type: ignore[attr-defined]
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def __enter__(self) -> FaultyEngine:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._closing.set()
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=10)

    def variant(self, path: str) -> str | None:
        """The fault for this request, or None to relay it faithfully."""
        if path != "/v1/completions":
            return None
        with self._lock:
            if self.relayed < self.after or sum(self.injected.values()) >= self.count:
                self.relayed += 1
                return None
            variant = self._rng.choice(_VARIANTS[self.fault])
            self.injected[variant] += 1
            return variant

    def relay(self, method: str, path: str, body: bytes, headers: dict[str, str]) -> _Answer:
        conn = http.client.HTTPConnection(*self.upstream, timeout=120)
        try:
            conn.request(method, path, body=body or None, headers=headers)
            resp = conn.getresponse()
            return _Answer(resp.status, resp.getheader("Content-Type", ""), resp.read())
        finally:
            conn.close()

    def hang(self, sock: socket.socket) -> None:
        """Hold the connection without answering until the client closes it."""
        waited = 0.0
        while waited < HANG_LIMIT_S and not self._closing.is_set():
            readable, _, _ = select.select([sock], [], [], 0.2)
            waited += 0.2
            if readable:
                try:
                    if not sock.recv(1, socket.MSG_PEEK):
                        return  # the client gave up
                except OSError:
                    return


class _Answer:
    def __init__(self, status: int, content_type: str, body: bytes, *, cut: bool = False):
        self.status = status
        self.content_type = content_type
        self.body = body
        self.cut = cut


_VARIANTS = {
    "5xx": ("500", "502", "503", "504"),
    "garbage": ("cut", "html", "shape", "extra-id", "out-of-vocab", "nan-logprob"),
    "silent": ("hang", "drop"),
}


def _corrupt(variant: str, answer: _Answer) -> _Answer:
    """The engine's real answer, damaged the way `variant` says."""
    if answer.status != 200:
        return answer
    if variant == "cut":  # the connection drops halfway through the answer
        return _Answer(200, answer.content_type, answer.body[: len(answer.body) // 2], cut=True)
    if variant == "html":
        return _Answer(200, "text/html", b"<html><body>502 Bad Gateway</body></html>")
    if variant == "shape":
        return _Answer(200, "application/json", b'{"choices": [], "object": "text_completion"}')
    data: dict[str, Any] = json.loads(answer.body)
    choice = data["choices"][0]
    if variant == "extra-id":
        choice["token_ids"] = [*choice["token_ids"], 0]
    elif variant == "out-of-vocab":
        choice["token_ids"] = [10**9 + i for i, _ in enumerate(choice["token_ids"])]
    elif variant == "nan-logprob":
        choice["logprobs"]["token_logprobs"][0] = float("nan")
    return _Answer(200, "application/json", json.dumps(data).encode())


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as the real server and its clients use
    server: ThreadingHTTPServer

    def log_message(self, format: str, *args: Any) -> None:
        pass  # the proxy is quiet; the trial reports what it injected

    def do_GET(self) -> None:
        self._handle("GET")

    def do_POST(self) -> None:
        self._handle("POST")

    def _handle(self, method: str) -> None:
        engine: FaultyEngine = self.server.engine  # type: ignore[attr-defined]
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        variant = engine.variant(self.path)
        if variant in ("hang", "drop"):
            if variant == "hang":
                engine.hang(self.connection)
            self.close_connection = True
            return
        if variant is not None and variant.isdigit():
            error = {"error": {"message": f"chaos: engine answered {variant}", "code": variant}}
            self._answer(_Answer(int(variant), "application/json", json.dumps(error).encode()))
            return
        headers = {"Content-Type": self.headers.get("Content-Type", "application/json")}
        try:
            answer = engine.relay(method, self.path, body, headers)
        except OSError:
            self.close_connection = True  # the real server is gone: so is this answer
            return
        self._answer(answer if variant is None else _corrupt(variant, answer))

    def _answer(self, answer: _Answer) -> None:
        self.send_response(answer.status)
        self.send_header("Content-Type", answer.content_type or "application/json")
        self.send_header("Content-Length", str(len(answer.body) * (2 if answer.cut else 1)))
        self.end_headers()
        self.wfile.write(answer.body)
        if answer.cut:
            self.close_connection = True
