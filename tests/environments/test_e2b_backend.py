"""`E2BBackend`: against a stand-in cloud with the SDK's interface, the real SDK offline, and
(when `E2B_API_KEY` is set) the real cloud."""

from __future__ import annotations

import inspect
import os
import time

import anyio
import e2b
import httpx
import pytest
from _e2b_fake import FakeAsyncSandbox, FakeCommands, FakeE2BCloud, FakeFilesystem
from e2b.retry import resolve_idempotency_key
from e2b.sandbox_async.commands.command import Commands
from e2b.sandbox_async.filesystem.filesystem import Filesystem

from plies import SandboxError
from plies.environments import E2BBackend, SandboxedBlackjackEnv, Task
from plies.environments.e2b_backend import idempotency_key
from plies.environments.reapers import reap_sandbox

pytestmark = pytest.mark.anyio


@pytest.fixture
def cloud(tmp_path) -> FakeE2BCloud:
    return FakeE2BCloud(tmp_path)


def _shape(fn) -> list[tuple[str, object, object]]:
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


@pytest.mark.parametrize(
    ("fake", "real"),
    [
        (FakeAsyncSandbox.create, e2b.AsyncSandbox.create),
        (FakeAsyncSandbox.kill, e2b.AsyncSandbox.kill),
        (FakeAsyncSandbox._cls_kill, e2b.AsyncSandbox._cls_kill),
        (FakeCommands.run, Commands.run),
        (FakeFilesystem.read, Filesystem.read),
        (FakeFilesystem.write, Filesystem.write),
    ],
    ids=["create", "kill", "kill-by-id", "commands.run", "files.read", "files.write"],
)
def test_the_fake_has_the_sdks_signatures(fake, real):
    assert _shape(fake) == _shape(real)


async def test_create_labels_the_sandbox_and_sets_the_reaper(cloud):
    backend = E2BBackend(template="base", sandbox_timeout_s=321, sandbox_cls=cloud.sandbox_class)
    sandbox = await backend.create(run_id="run-1", episode_id="ep-7")
    record = cloud.sandboxes[sandbox.id]
    assert record.metadata == {"plies_run": "run-1", "plies_episode": "ep-7"}
    assert (record.template, record.timeout) == ("base", 321)
    assert record.idempotency_key == idempotency_key("run-1", "ep-7")
    assert await sandbox.kill() is True
    assert await sandbox.kill() is False  # already gone is not an error
    assert await backend.kill(sandbox.id) is False


async def test_a_retried_create_gets_the_same_sandbox(cloud):
    backend = E2BBackend(sandbox_cls=cloud.sandbox_class)
    first = await backend.create(run_id="run-1", episode_id="ep-7")
    again = await backend.create(run_id="run-1", episode_id="ep-7")
    other = await backend.create(run_id="run-1", episode_id="ep-8")
    assert first.id == again.id != other.id and cloud.creates == 2
    for key in (idempotency_key("run-1", "ep-7"), idempotency_key("R" * 300, "Épisode/7")):
        assert resolve_idempotency_key(key) == key  # the SDK's own check accepts it


async def test_files_and_commands_through_the_sdk_interface(cloud):
    backend = E2BBackend(sandbox_cls=cloud.sandbox_class)
    sandbox = await backend.create(run_id="r", episode_id="e")
    try:
        await sandbox.write_file("notes/a.txt", "hi there")
        assert await sandbox.read_file("notes/a.txt") == b"hi there"
        ok = await sandbox.run(["python3", "-c", "print(open('notes/a.txt').read())"], timeout_s=20)
        assert (ok.exit_code, ok.stdout) == (0, "hi there\n")
        bad = await sandbox.run(["python3", "-c", "import sys; sys.exit(4)"], timeout_s=20)
        assert bad.exit_code == 4  # CommandExitException is a result, not a failure
        with pytest.raises(SandboxError, match="FileNotFoundException") as err:
            await sandbox.read_file("missing.txt")
        assert err.value.sandbox_id == sandbox.id
        with pytest.raises(SandboxError, match="TimeoutException"):
            await sandbox.run(["python3", "-c", "import time; time.sleep(30)"], timeout_s=0.5)
        with pytest.raises(SandboxError, match="not a path inside"):
            await sandbox.write_file("../../etc/x", "no")
    finally:
        await sandbox.kill()


@pytest.mark.parametrize(
    "error",
    [
        e2b.SandboxException("boom"),
        e2b.AuthenticationException("bad key"),
        e2b.ServiceBusyException("busy"),
        e2b.RateLimitException("slow down"),
        httpx.ConnectError("refused"),
        httpx.ReadTimeout("slow"),
    ],
    ids=lambda e: type(e).__name__,
)
async def test_sdk_and_transport_errors_become_sandbox_errors(cloud, error):
    backend = E2BBackend(sandbox_cls=cloud.sandbox_class)
    cloud.create_error = error
    with pytest.raises(SandboxError) as err:
        await backend.create(run_id="r", episode_id="e")
    assert err.value.__cause__ is error and type(error).__name__ in str(err.value)
    cloud.create_error = None
    sandbox = await backend.create(run_id="r", episode_id="e")
    cloud.kill_error = error
    with pytest.raises(SandboxError) as err:
        await backend.kill(sandbox.id)
    assert err.value.sandbox_id == sandbox.id and err.value.__cause__ is error


async def test_kill_is_shielded_from_cancellation(cloud):
    backend = E2BBackend(sandbox_cls=cloud.sandbox_class)
    sandbox = await backend.create(run_id="r", episode_id="e")
    cloud.kill_delay_s = 0.3
    with anyio.CancelScope() as scope:
        scope.cancel()
        await sandbox.kill()
    assert cloud.sandboxes == {}


async def test_slow_create_and_kill_are_bounded(cloud):
    backend = E2BBackend(sandbox_cls=cloud.sandbox_class, create_timeout_s=0.2, kill_timeout_s=0.2)
    cloud.create_delay_s = 5
    with pytest.raises(SandboxError, match="plies_episode"):
        await backend.create(run_id="r", episode_id="slow")
    cloud.create_delay_s = 0
    sandbox = await backend.create(run_id="r", episode_id="e")
    cloud.kill_delay_s = 5
    with pytest.raises(SandboxError, match=r"did not finish in 0\.2s") as err:
        await sandbox.kill()
    assert err.value.sandbox_id == sandbox.id


async def test_the_real_sdk_offline_fails_fast_with_errors_plies_maps():
    """No E2B here: debug mode talks to a local envd that is not running, and a bogus API URL
    refuses connections. Both fail inside the real SDK within seconds."""
    results: dict[str, BaseException | object] = {}
    debug = E2BBackend(debug=True, request_timeout_s=5)
    bogus = E2BBackend(api_key="e2b_" + "0" * 40, api_url="http://127.0.0.1:9", request_timeout_s=5)

    async def attempt(name: str, fn) -> None:
        try:
            results[name] = await fn()
        except SandboxError as err:
            results[name] = err

    async def debug_round_trip():
        sandbox = await debug.create(run_id="r", episode_id="e")
        results["debug-id"] = sandbox.id
        try:
            return await sandbox.run(["true"], timeout_s=5)
        finally:
            results["debug-kill"] = await sandbox.kill()

    started = time.monotonic()
    async with anyio.create_task_group() as tg:
        tg.start_soon(attempt, "debug-run", debug_round_trip)
        tg.start_soon(attempt, "bogus-create", lambda: bogus.create(run_id="r", episode_id="e"))
        tg.start_soon(attempt, "bogus-kill", lambda: bogus.kill("sbx-gone"))
    assert time.monotonic() - started < 30

    run_err = results["debug-run"]
    assert isinstance(run_err, SandboxError) and run_err.sandbox_id == "debug_sandbox_id"
    assert isinstance(run_err.__cause__, e2b.SandboxUnreachableException)
    assert results["debug-kill"] is True  # the SDK skips the API in debug mode
    create_err = results["bogus-create"]
    assert isinstance(create_err, SandboxError) and create_err.sandbox_id is None
    assert isinstance(create_err.__cause__, httpx.ConnectError)
    kill_err = results["bogus-kill"]
    assert isinstance(kill_err, SandboxError) and kill_err.sandbox_id == "sbx-gone"
    assert isinstance(kill_err.__cause__, httpx.TransportError)


@pytest.mark.skipif(not os.environ.get("E2B_API_KEY"), reason="needs E2B_API_KEY and E2B's cloud")
async def test_live_e2b_plays_a_hand_and_leaves_nothing_behind():
    backend = E2BBackend(sandbox_timeout_s=300)
    async with SandboxedBlackjackEnv(backend, run_id="plies-live-test") as env:
        obs = await env.reset(Task(id="live", seed=11))
        assert "Your cards" in obs.messages[0]["content"]
        result = await env.call_tool("stand", {})
        assert result.done and result.reward in (-1.0, 0.0, 1.0)
        sandbox_id = env.sandbox_id
    assert await reap_sandbox("e2b", sandbox_id) is False
