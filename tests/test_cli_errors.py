"""Misuse of the command line: one line that says what is wrong, exit 2, no traceback.

Every case fails before any work (no model load, no warm start), so each run is quick.
"""

from __future__ import annotations

import os
import socket
import subprocess
from pathlib import Path

import pytest

from plies.testing import plies_command, tiny_model_dir


def run_plies(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        plies_command(*args), capture_output=True, text=True, timeout=120, env=env
    )


def assert_refused(done: subprocess.CompletedProcess[str], says: str) -> None:
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert "Traceback" not in done.stderr and says in done.stderr, done.stderr


@pytest.mark.parametrize(
    "args,says",
    [
        (["--budget", "huge"], "plies demo: unknown budget 'huge'; known: default, quick, smoke"),
        (["--env", "docker"], "'docker' is not one of 'local'"),
        (["--sandbox", "foo"], "'foo' is not one of 'none'"),
        (["--env", "openenv", "--sandbox", "local"], "alternatives; pick one"),
    ],
    ids=["budget", "env", "sandbox", "openenv-and-sandbox"],
)
def test_demo_refuses_bad_options_before_any_work(tmp_path, args, says):
    out = tmp_path / "run"
    done = run_plies("demo", "blackjack", "--out", str(out), *args)
    assert_refused(done, says)
    assert not out.exists()
    if args[0] == "--budget" or args[-1] == "local":
        assert len(done.stderr.strip().splitlines()) == 1


def test_demo_refuses_an_out_that_names_a_file(tmp_path):
    out = tmp_path / "not-a-dir"
    out.write_text("x")
    done = run_plies("demo", "blackjack", "--out", str(out), "--budget", "smoke")
    assert_refused(done, f"plies demo: --out {out} is a file")
    assert len(done.stderr.strip().splitlines()) == 1


def test_demo_on_e2b_without_a_key_stops_before_the_warm_start(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "E2B_API_KEY"}
    out = tmp_path / "run"
    done = run_plies("demo", "blackjack", "--out", str(out), "--sandbox", "e2b", env=env)
    assert_refused(done, "plies demo: --sandbox e2b needs E2B_API_KEY")
    assert len(done.stderr.strip().splitlines()) == 1 and not out.exists()


def test_serve_names_a_model_directory_that_does_not_exist(tmp_path):
    missing = tmp_path / "no-such-model"
    done = run_plies("serve", str(missing))
    assert_refused(done, f"cannot serve: model directory {missing} does not exist")
    assert len(done.stderr.strip().splitlines()) == 1


def test_serve_on_a_busy_port_says_so():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        done = run_plies("serve", str(tiny_model_dir()), "--port", str(port))
    assert_refused(done, f"cannot serve: cannot bind 127.0.0.1:{port}: Address already in use")
    assert len(done.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize(
    "content", ['{"hello": 1}', "not json at all", "\udcff"], ids=["json", "text", "bytes"]
)
def test_reap_on_a_file_that_is_not_a_report_is_one_line(tmp_path: Path, content):
    report = tmp_path / "report.json"
    report.write_bytes(content.encode(errors="surrogateescape"))
    done = run_plies("reap", str(report))
    assert_refused(done, "plies reap: ")
    assert len(done.stderr.strip().splitlines()) == 1
