"""A real loopback server for runtime tests: remote operations that take as long as asked.

Run as `python op_server.py`; it prints one JSON line `{"url": ..., "pid": ...}` when ready.

- `GET /op?s=SECONDS`: answer `{"ok": true}` after sleeping.
- `GET /sample?s=SECONDS&n=TOKENS[&sure=1]`: a stand-in completion (ids and logprobs, each 0
  with `sure=1`: drawn with certainty) after sleeping.
- `POST /shutdown`: exit; with `?hang=1`, never answer (a teardown that hangs).
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):  # quiet
        pass

    def _answer(self, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        url = urlparse(self.path)
        q = parse_qs(url.query)
        time.sleep(float(q.get("s", ["0"])[0]))
        if url.path == "/sample":
            n = int(q.get("n", ["3"])[0])
            logprob = 0.0 if q.get("sure") == ["1"] else -0.5
            self._answer({"ids": list(range(1, n + 1)), "logprobs": [logprob] * n})
        else:
            self._answer({"ok": True, "pid": os.getpid()})

    def do_POST(self):
        url = urlparse(self.path)
        if url.path == "/shutdown":
            if "hang=1" in url.query:
                threading.Event().wait()
            self._answer({"ok": True})
            threading.Thread(target=self.server.shutdown, daemon=True).start()


class Server(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address):
        # Clients that hang up mid-request (cancelled episodes) are expected here.
        pass


def main() -> None:
    server = Server(("127.0.0.1", 0), Handler)
    host, port = server.server_address[:2]
    print(json.dumps({"url": f"http://{host}:{port}", "pid": os.getpid()}), flush=True)
    server.serve_forever()


if __name__ == "__main__":
    sys.exit(main())
