"""`plies view RUN_DIR --serve`: the page on 127.0.0.1, refreshed as the run writes.

Read-only by construction: the server opens the run's files for reading only, in its own
process, and re-reads them only when their sizes or modification times changed, and then only
the bytes appended since (`RunReader`). The run never waits for it and never learns it exists.
The page asks `/stamp` every 2 s and fetches `/page` when the stamp moved.
"""

from __future__ import annotations

import json
import sys
import threading
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from ._view import RunView

__all__ = ["LiveServer", "run_stamp", "serve_live"]

WATCHED = ("groups.jsonl", "metrics.jsonl", "summary.json", "run.json", "quarantine.json")


def run_stamp(run_dir: Path) -> str:
    """Sizes and modification times of the files a page is made of: it moves when they do."""
    parts = []
    for name in WATCHED:
        try:
            st = (run_dir / name).stat()
        except OSError:
            parts.append(f"{name}:-")
            continue
        parts.append(f"{name}:{st.st_size}:{st.st_mtime_ns}")
    return "|".join(parts)


class LiveServer(ThreadingHTTPServer):
    """Serves one run's page; the page is rebuilt at most once per change of the files."""

    daemon_threads = True

    def __init__(self, view: RunView, port: int = 0):
        self.view = view
        self._lock = threading.Lock()
        self._stamp: str | None = None
        self._page = b""
        super().__init__(("127.0.0.1", port), _Handler)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/"

    def stamp(self) -> str:
        return run_stamp(self.view.run_dir)

    def page(self) -> bytes:
        with self._lock:
            stamp = self.stamp()
            if stamp != self._stamp:
                self._page = self.view.page(live=True, stamp=stamp).encode()
                self._stamp = stamp
            return self._page


class _Handler(BaseHTTPRequestHandler):
    server: LiveServer

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        if path in ("/", "/page"):
            self._send(self.server.page(), "text/html; charset=utf-8")
        elif path == "/stamp":
            self._send(self.server.stamp().encode(), "text/plain; charset=utf-8")
        else:
            self.send_error(HTTPStatus.NOT_FOUND, "only /, /page and /stamp are served")

    def _send(self, body: bytes, kind: str) -> None:
        self.send_response(HTTPStatus.OK)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        """Quiet: one line per poll every 2 s would drown the ready line's neighbours."""


def serve_live(run_dir: Path, *, tokenizer: Path | None = None, port: int = 0) -> int:
    """Serve until interrupted; print `{"url": ...}` as one JSON line once listening.

    Returns:
        130 after Ctrl-C.
    """
    server = LiveServer(RunView(run_dir, tokenizer=tokenizer), port)
    with server:
        server.page()  # read the run once before announcing the url
        sys.stdout.write(json.dumps({"url": server.url}) + "\n")
        sys.stdout.flush()
        try:
            server.serve_forever(poll_interval=0.5)
        except KeyboardInterrupt:
            return 130
    return 0
