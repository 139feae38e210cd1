"""`LocalProcessBackend`: real subprocesses in temporary directories, killed and removed."""

from __future__ import annotations

import os
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
import pytest

from plies import ConfigError, SandboxError
from plies.environments import LocalProcessBackend, SandboxBackend
from plies.environments.reapers import reap_sandbox
from plies.environments.sandbox import Sandbox
from plies.testing import process_alive

pytestmark = pytest.mark.anyio

PY = sys.executable


async def wait_dead(pid: int, within_s: float = 5.0) -> bool:
    with anyio.move_on_after(within_s):
        while process_alive(pid):
            await anyio.sleep(0.02)
    return not process_alive(pid)


async def test_files_commands_and_the_environment_allow_list(tmp_path, monkeypatch):
    monkeypatch.setenv("PLIES_TEST_SECRET", "do-not-leak")
    backend = LocalProcessBackend(tmp_path)
    assert isinstance(backend, SandboxBackend)
    sandbox = await backend.create(run_id="run", episode_id="ep")
    assert isinstance(sandbox, Sandbox)
    assert sandbox.kind == "local-sandbox" and Path(sandbox.id).parent == tmp_path
    try:
        await sandbox.write_file("sub/data.txt", "hello")
        assert await sandbox.read_file("sub/data.txt") == b"hello"
        script = "import os, sys; print(','.join(sorted(os.environ)))\n"
        script += "print(open('sub/data.txt').read()); print(os.environ.get('EXTRA')); sys.exit(3)"
        result = await sandbox.run([PY, "-c", script], timeout_s=20, env={"EXTRA": "given"})
        assert result.exit_code == 3
        names, content, extra = result.stdout.splitlines()
        assert "PLIES_TEST_SECRET" not in names.split(",")
        allowed = {"PATH", "LANG", "LC_ALL", "LC_CTYPE", "TZ", "HOME", "TMPDIR", "EXTRA"}
        assert set(names.split(",")) <= allowed | {"PLIES_SANDBOX_ID"}
        assert (content, extra) == ("hello", "given")
        failed = await sandbox.run([PY, "-c", "import sys; sys.stderr.write('boom'); sys.exit(1)"],
                                   timeout_s=20)  # fmt: skip
        assert (failed.exit_code, failed.stderr) == (1, "boom")
        for bad in ("/etc/passwd", "../escape.txt"):
            with pytest.raises(SandboxError, match="not a path inside") as err:
                await sandbox.read_file(bad)
            assert err.value.sandbox_id == sandbox.id
        with pytest.raises(SandboxError, match="could not start"):
            await sandbox.run(["/no/such/program"], timeout_s=5)
        with pytest.raises(ConfigError):
            await sandbox.run([], timeout_s=5)
    finally:
        assert await sandbox.kill() is True
    assert not Path(sandbox.id).exists()
    assert await sandbox.kill() is False
    with pytest.raises(SandboxError, match="killed"):
        await sandbox.run([PY, "-c", "pass"], timeout_s=5)


@asynccontextmanager
async def local_sandbox(root: Path) -> AsyncIterator[Sandbox]:
    """A fresh sandbox under `root`, killed when the block ends, whatever it left running."""
    sandbox = await LocalProcessBackend(root).create(run_id="run", episode_id="ep")
    try:
        yield sandbox
    finally:
        await sandbox.kill()


async def test_a_timeout_kills_the_whole_process_group(tmp_path):
    script = (
        "import subprocess, sys, time\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        "open('child.pid', 'w').write(str(child.pid)); time.sleep(60)\n"
    )
    async with local_sandbox(tmp_path) as sandbox:
        with pytest.raises(SandboxError, match=r"did not finish in 1\.0s") as err:
            await sandbox.run([PY, "-c", script], timeout_s=1.0)
        assert err.value.sandbox_id == sandbox.id
        child = int(await sandbox.read_file("child.pid"))
        assert await wait_dead(child)


async def test_cancelling_a_command_kills_it(tmp_path):
    async with local_sandbox(tmp_path) as sandbox:
        with anyio.move_on_after(1.0):
            await sandbox.run(
                [PY, "-c", "import os, time; open('pid', 'w').write(str(os.getpid())); "
                 "time.sleep(60)"],
                timeout_s=60,
            )  # fmt: skip
        assert await wait_dead(int(await sandbox.read_file("pid")))


async def test_reap_by_id_kills_escaped_processes_and_removes_the_directory(tmp_path):
    """What `plies reap` does for a sandbox some other process made and lost track of."""
    sandbox = await LocalProcessBackend(tmp_path).create(run_id="run", episode_id="ep")
    daemon = (
        "import subprocess, sys\n"
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'],\n"
        "    start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,\n"
        "    cwd='/')\n"
        "print(p.pid)\n"
    )
    result = await sandbox.run([PY, "-c", daemon], timeout_s=20)
    pid = int(result.stdout)
    assert process_alive(pid)  # it left its process group and its directory; the label stays
    assert await reap_sandbox("local-sandbox", sandbox.id) is True
    assert await wait_dead(pid)
    assert not Path(sandbox.id).exists()
    assert await reap_sandbox("local-sandbox", sandbox.id) is False


async def test_kill_by_id_refuses_what_is_not_a_sandbox(tmp_path):
    precious = tmp_path / "precious"
    precious.mkdir()
    with pytest.raises(SandboxError, match="not a local plies sandbox"):
        await LocalProcessBackend().kill(str(precious))
    impostor = tmp_path / "plies-sbx-impostor"
    impostor.mkdir()
    (impostor / ".plies-sandbox.json").write_text('{"id": "/somewhere/else"}')
    with pytest.raises(SandboxError, match="names another sandbox"):
        await LocalProcessBackend().kill(str(impostor))
    assert precious.exists() and impostor.exists()
    with pytest.raises(ConfigError, match="unknown sandbox kind"):
        await reap_sandbox("docker", "x")
    assert sorted(os.listdir(tmp_path)) == ["plies-sbx-impostor", "precious"]
