"""`plies.testing.serve_process`: a server is started, announced by its ready line, and stopped.

Every spawn-and-read-a-ready-line in tests, benchmarks, examples and the demo goes through it,
so its promises are checked here against real processes: the ready line arrives whole, the
child runs in its own session with the offline environment, it is gone after the block, and
a child that never gets ready is a `PliesError` that quotes its log.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import anyio
import httpx
import pytest

from plies import PliesError
from plies.testing import plies_command, process_alive, serve_process, serve_process_sync
from plies.testing._serve import spawn_server, stop_server

SERVER = """
import http.server, json, os
class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = json.dumps({"pid": os.getpid()}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *args):
        pass
server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
url = f"http://127.0.0.1:{server.server_port}"
print(json.dumps({"url": url, "offline": os.environ.get("HF_HUB_OFFLINE")}), flush=True)
server.serve_forever()
"""
CRASH = "import sys; print('boom: no config', file=sys.stderr); sys.exit(3)"
SILENT = """
import os, sys, time
print(f"still loading, pid {os.getpid()}.", file=sys.stderr, flush=True)
time.sleep(60)
"""


def sync_error(code: str, log: Path, **options: float) -> str:
    """The message of the error `serve_process_sync` raises for `python -c CODE`."""
    argv = [sys.executable, "-c", code]
    with pytest.raises(PliesError) as caught, serve_process_sync(argv, log=log, **options):
        pytest.fail("no ready line, no block")
    return str(caught.value)


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


@pytest.mark.anyio
async def test_serve_process_hands_out_a_ready_server_and_stops_it(tmp_path: Path):
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}
    argv = [sys.executable, "-c", SERVER]
    async with serve_process(argv, log=tmp_path / "s.log", env=env) as server:
        assert server.url == server.ready["url"] and server.ready["offline"] == "1"
        assert os.getsid(server.pid) == server.pid  # its own session: Ctrl-C spares it
        async with httpx.AsyncClient() as http:
            assert (await http.get(server.url)).json() == {"pid": server.pid}
    assert server.process.returncode is not None
    assert gone(server.pid)


def test_serve_process_sync_hands_out_a_ready_server_and_stops_it(tmp_path: Path):
    env = {**os.environ, "HF_HUB_OFFLINE": "0"}  # the caller's environment wins
    argv = [sys.executable, "-c", SERVER]
    with serve_process_sync(argv, log=tmp_path / "s.log", env=env) as server:
        assert server.ready["offline"] == "0"
        assert os.getsid(server.pid) == server.pid
        assert httpx.get(server.url).json() == {"pid": server.process.pid}
    assert server.process.returncode is not None
    assert gone(server.pid)


@pytest.mark.anyio
async def test_a_server_that_exits_before_its_ready_line_is_an_error_with_its_log(tmp_path):
    with pytest.raises(PliesError) as caught:
        async with serve_process([sys.executable, "-c", CRASH], log=tmp_path / "a.log"):
            pytest.fail("no ready line, no block")
    assert "exited with code 3 before its ready line" in str(caught.value)
    assert "boom: no config" in str(caught.value) and sys.executable in str(caught.value)


def test_the_sync_form_reports_an_early_exit_the_same_way(tmp_path):
    message = sync_error(CRASH, tmp_path / "s.log")
    assert "exited with code 3 before its ready line" in message
    assert "boom: no config" in message


def test_a_line_that_is_not_a_ready_line_is_an_error(tmp_path):
    message = sync_error("print('hello'); import time; time.sleep(60)", tmp_path / "s.log")
    assert "printed b'hello\\n' instead of a JSON ready line with a url" in message


@pytest.mark.anyio
async def test_a_server_that_stalls_is_stopped_after_the_ready_timeout(tmp_path):
    spawned: list[int] = []
    argv = [sys.executable, "-c", SILENT]
    with pytest.raises(PliesError, match="printed no ready line within 1 s") as caught:
        await spawn_server(argv, log=tmp_path / "a.log", ready_timeout=1, on_spawn=spawned.append)
    assert "still loading" in str(caught.value)
    (pid,) = spawned
    assert gone(pid)


def test_the_sync_form_stops_a_stalled_server_too(tmp_path):
    message = sync_error(SILENT, tmp_path / "s.log", ready_timeout=1)
    assert "printed no ready line within 1 s" in message
    assert gone(int(message.rsplit("pid ", 1)[1].split(".")[0]))


@pytest.mark.anyio
async def test_a_cancelled_start_leaves_no_process_behind(tmp_path):
    spawned: list[int] = []
    with anyio.move_on_after(1) as scope:
        await spawn_server(
            [sys.executable, "-c", SILENT], log=tmp_path / "a.log", on_spawn=spawned.append
        )
    assert scope.cancelled_caught
    (pid,) = spawned
    assert gone(pid)


@pytest.mark.anyio
async def test_spawn_and_stop_are_the_two_halves_for_a_pool(tmp_path):
    server = await spawn_server([sys.executable, "-c", SERVER], log=tmp_path / "a.log")
    try:
        async with httpx.AsyncClient() as http:
            assert (await http.get(server.url)).status_code == 200
    finally:
        await stop_server(server)
    assert gone(server.pid)
    await stop_server(server)  # an exited server is stopped again without complaint


def test_python_dash_m_plies_is_the_plies_command():
    assert plies_command("serve") == [sys.executable, "-m", "plies", "serve"]
    done = subprocess.run(plies_command("--help"), capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "serve" in done.stdout and "models" in done.stdout


PARENT = """
import sys, time
from plies.testing import plies_command, serve_process_sync
argv = plies_command("serve", sys.argv[1])
with serve_process_sync(argv, log=sys.argv[2], ready_timeout=180) as server:
    print(server.process.pid, flush=True)
    time.sleep(600)
"""


def test_a_server_outlives_no_parent_killed_outright(tiny_model_dir, tmp_path):
    """SIGKILL gives the parent no chance to stop its server, which runs in its own session."""
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, str(tiny_model_dir), str(tmp_path / "serve.log")],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        server_pid = int(parent.stdout.readline())
    finally:
        parent.kill()
        parent.wait()
    deadline = time.monotonic() + 30
    while process_alive(server_pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    alive = process_alive(server_pid)
    if alive:
        os.kill(server_pid, 9)
    assert not alive, (tmp_path / "serve.log").read_text()[-2000:]
    assert "is gone; shutting down" in (tmp_path / "serve.log").read_text()
