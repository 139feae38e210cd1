"""`VerifiersHarness`: a verifiers environment's rollouts played as plies episodes.

A verifiers environment (`load_environment()` returning a `vf.Environment`: a dataset, an
agent loop of its own, a rubric) runs in a sidecar process of the interpreter that has
`verifiers` installed (`_verifiers_sidecar.py`, which imports no plies). Why a sidecar and
not an import: verifiers and plies' core do not resolve together (verifiers 0.4 pins
`mcp==2.0.0` against openenv's `mcp<2`; 0.3.1's `prime-sandboxes` pins `connectrpc<0.12`
against e2b's `>=0.12.1`; 0.3.0's `connect-python` overwrites connectrpc's files, breaking
e2b), and a Hub environment brings dependencies of its own. docs/environments.md has the rest.

One episode is one verifiers rollout:

- the harness opens a gateway session for the episode and asks the sidecar to roll out the
  dataset row (`ctx.task`) with verifiers' own `OpenAIChatCompletionsClient` pointed at
  that session. So every model call goes through verifiers' client seam into plies' gateway,
  which renders with plies' renderer (each prompt extends the last, or is a full render
  with its `fallback` recorded and counted), samples through the policy client and records
  the exact prompt ids, completion ids and logprobs as the trajectory's turns; a history
  that verifiers rewrote starts a new segment, so every branch is trained once;
- verifiers runs its loop, its rubric scores the rollout and its cleanup handlers run; the
  rubric's reward is the trajectory's `reward`, its metrics are `metrics["verifiers.NAME"]`,
  and `info["verifiers"]` holds the stop condition, the whole conversation and the tools
  as verifiers sent them;
- a rollout the env truncated (max turns, prompt too long, timeout) is `truncated`; one that
  failed (a verifiers error, a failed policy call) is `failed`, with no reward.

Each episode borrows a lease on its rollout from the harness's pool (`harness.pool()`): its
teardown cancels the rollout in the sidecar and waits, bounded, for verifiers' cleanup to
run; a rollout that does not confirm is quarantined. The sidecar process lives as long as
the `async with` block, in its own process group, killed on every path.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import signal
import subprocess
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
from anyio.abc import Process, TaskGroup
from anyio.streams.buffered import BufferedByteReceiveStream

from plies import ConfigError, EnvError, UsageError
from plies.gateway import GatewayServer
from plies.runtime import EpisodeContext, GroupSpec, HarnessPool, Pool, RemoteRef
from plies.trajectory import Status, Trajectory

__all__ = ["SIDECAR", "VerifiersHarness"]

log = logging.getLogger("plies.harness")

SIDECAR = Path(__file__).with_name("_verifiers_sidecar.py")
"""The script the sidecar interpreter runs."""
_MAX_LINE = 1 << 24
_STDERR_TAIL = 8000
_KILL_TIMEOUT_S = 5.0


@dataclass
class _Pending:
    """One request waiting for its answer line."""

    done: anyio.Event = field(default_factory=anyio.Event)
    answer: dict[str, Any] | None = None


class VerifiersHarness:
    """Plays a verifiers environment's rollouts as plies episodes, one gateway session each.

    Args:
        server: a running `GatewayServer`; its gateway's renderer and policy client sample
            every turn.
        environment: what defines `load_environment()`: a `.py` file, or a module installed
            in `python`'s environment (an Environments Hub package).
        python: the interpreter of the environment where `verifiers` is installed.
        env_args: keyword arguments for `load_environment`.
        sampling_args: verifiers' sampling arguments for every rollout (`max_tokens`,
            `temperature`, `top_p`, `seed`); unset ones are the gateway's.
        ready_timeout_s: how long loading the environment may take.
        cancel_timeout_s: how long a cancelled rollout may take to confirm its cleanup
            before its lease is quarantined.

    Example::

        async with VerifiersHarness(server, "my_env.py", python=".venv-verifiers/bin/python") as h:
            rows = await h.dataset(n=8)
            specs = [GroupSpec(task_id=h.task_id(r), size=4, task=r) for r in rows]
            async with RolloutResources(sampler=h.sampler, pools=[h.pool()]) as resources:
                async with RolloutDriver(resources, h.play, policy=ref) as driver: ...
    """

    def __init__(
        self,
        server: GatewayServer,
        environment: str | Path,
        *,
        python: str | Path,
        env_args: Mapping[str, Any] | None = None,
        sampling_args: Mapping[str, Any] | None = None,
        ready_timeout_s: float = 120.0,
        cancel_timeout_s: float = 10.0,
    ):
        self.server = server
        self.environment = str(environment)
        self.python = str(python)
        try:
            self._env_args = json.dumps(dict(env_args or {}))
        except (TypeError, ValueError) as err:
            raise ConfigError(f"env_args must be JSON: {err}") from None
        self.sampling_args = dict(sampling_args or {})
        self.ready_timeout_s = ready_timeout_s
        self.cancel_timeout_s = cancel_timeout_s
        self.ready: dict[str, Any] = {}
        """The sidecar's ready line: the verifiers version and the environment's class."""
        self._process: Process | None = None
        self._tg: TaskGroup | None = None
        self._pending: dict[str, _Pending] = {}
        self._stderr = bytearray()
        self._lost: str | None = None
        self._send_lock = anyio.Lock()

    @property
    def sampler(self) -> Any:
        """The gateway's sampler: every turn of every rollout is sampled by it."""
        return self.server.gateway.sampler

    async def __aenter__(self) -> VerifiersHarness:
        if self._process is not None:
            raise UsageError("a VerifiersHarness can be entered once")
        if not Path(self.python).exists():
            raise ConfigError(f"no interpreter at {self.python} (the environment with verifiers)")
        self._process = await anyio.open_process(
            # -P: the script's own directory must not come first on sys.path, where this
            # module, verifiers.py, would shadow the verifiers package.
            [self.python, "-P", str(SIDECAR), self.environment, self._env_args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()
        entered = False
        try:
            ready = _Pending()
            self._pending["ready"] = ready
            self._tg.start_soon(self._read)
            self._tg.start_soon(self._drain)
            with anyio.move_on_after(self.ready_timeout_s):
                await ready.done.wait()
            if ready.answer is None:
                raise EnvError(
                    f"the verifiers sidecar did not load {self.environment}: "
                    f"{self._lost or f'no ready line in {self.ready_timeout_s:g}s'}"
                )
            self.ready = ready.answer
            if self.ready.get("group_rewards"):
                raise ConfigError(
                    f"{self.environment}: the rubric has group reward functions, which need "
                    "every member's rollout at once; plies scores each rollout alone"
                )
            entered = True
        finally:
            if not entered:  # a failed or cancelled start leaves no process behind
                await self.__aexit__(None, None, None)
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        process, tg = self._process, self._tg
        if process is None or tg is None:
            return
        self._tg = None
        with anyio.CancelScope(shield=True):
            with contextlib.suppress(OSError, anyio.BrokenResourceError):  # gone already
                await process.stdin.aclose()  # type: ignore[union-attr]
            with anyio.move_on_after(self.cancel_timeout_s):
                await process.wait()  # the sidecar cancels what runs, then exits
            await _kill(process)
        tg.cancel_scope.cancel()  # its reader and stderr drain; they end at once
        await tg.__aexit__(None, None, None)
        self._fail_pending("the verifiers sidecar was closed")

    async def dataset(
        self, *, split: str = "train", n: int = -1, seed: int | None = None
    ) -> list[dict[str, Any]]:
        """Rows of the environment's dataset (`split="eval"`: its eval dataset), as JSON.

        Each row is what a rollout takes as `ctx.task`: `prompt`, `example_id`, `answer`,
        `info`, as verifiers formatted them.
        """
        if split not in ("train", "eval"):
            raise ConfigError(f"split must be 'train' or 'eval', got {split!r}")
        answer = await self._ask({"type": "dataset", "split": split, "n": n, "seed": seed})
        return list(answer["rows"])

    @staticmethod
    def task_id(row: Mapping[str, Any]) -> str:
        """A task id for a dataset row: its `example_id`."""
        return f"example-{row.get('example_id')}"

    def groups(self, rows: Sequence[Mapping[str, Any]], *, size: int) -> list[GroupSpec]:
        """One `GroupSpec` of `size` rollouts per row."""
        return [GroupSpec(task_id=self.task_id(r), size=size, task=dict(r)) for r in rows]

    def pool(self, *, limit: int = 64, name: str = "verifiers") -> HarnessPool[_Rollout]:
        """A pool of rollout slots: each lease is one rollout in the sidecar."""
        return HarnessPool(
            self._new_rollout,
            name=name,
            limit=limit,
            kind="verifiers-rollout",
            remote_id=lambda r: r.id,
            teardown_timeout=self.cancel_timeout_s + 1.0,
        )

    async def _new_rollout(self) -> _Rollout:
        return _Rollout(self, uuid.uuid4().hex)

    async def play(self, ctx: EpisodeContext, *, pool: Pool[Any] | str = "verifiers") -> Trajectory:
        """A `RolloutDriver` episode: one rollout of the dataset row `ctx.task`.

        Raises:
            ConfigError: `ctx.task` is not a dataset row (a mapping with a `prompt`).
            EnvError: the sidecar is gone.
        """
        row = ctx.task
        if not isinstance(row, Mapping) or "prompt" not in row:
            raise ConfigError(
                "VerifiersHarness.play needs GroupSpec.task to be a dataset row "
                f"(harness.dataset()), got {type(row).__name__}"
            )
        gateway = self.server.gateway
        async with ctx.borrow(pool) as lease:
            rollout: _Rollout = lease.resource
            key = await gateway.create_session(
                ctx.task_id, group_id=ctx.group_id, info={"example_id": row.get("example_id")}
            )
            trajectory: Trajectory | None = None
            try:
                result = await rollout.run(row, key)
                trajectory = await gateway.finish_session(key, **_outcome(result))
            finally:
                if trajectory is None and gateway.has_session(key):
                    with anyio.CancelScope(shield=True):
                        await gateway.drop_session(key)
        metrics = {
            f"verifiers.{k}": float(v)
            for k, v in (result.get("metrics") or {}).items()
            if isinstance(v, int | float) and math.isfinite(v)
        }
        return trajectory.model_copy(update={"metrics": {**trajectory.metrics, **metrics}})

    async def _ask(self, request: dict[str, Any], rid: str | None = None) -> dict[str, Any]:
        rid = rid or uuid.uuid4().hex
        pending = self._pending[rid] = _Pending()
        try:
            await self._send({**request, "id": rid})
            await pending.done.wait()
        finally:
            self._pending.pop(rid, None)
        if pending.answer is None:
            raise EnvError(f"{self._lost}")
        return pending.answer

    async def _send(self, message: dict[str, Any]) -> None:
        process = self._process
        if process is None or self._tg is None or self._lost is not None:
            raise EnvError(self._lost or "the verifiers sidecar is not running (use `async with`)")
        async with self._send_lock:
            try:
                await process.stdin.send((json.dumps(message) + "\n").encode())  # type: ignore[union-attr]
            except (OSError, anyio.BrokenResourceError, anyio.ClosedResourceError) as err:
                raise EnvError(f"the verifiers sidecar is gone: {err}") from err

    async def _read(self) -> None:
        process = self._process
        assert process is not None and process.stdout is not None
        stream = BufferedByteReceiveStream(process.stdout)
        try:
            while True:
                line = await stream.receive_until(b"\n", _MAX_LINE)
                answer = json.loads(line)
                rid = "ready" if answer.get("type") == "ready" else str(answer.get("id"))
                pending = self._pending.get(rid)
                if pending is not None:
                    pending.answer = answer
                    pending.done.set()
        except (anyio.EndOfStream, anyio.IncompleteRead, anyio.DelimiterNotFound) as err:
            code = await process.wait()
            tail = self._stderr[-_STDERR_TAIL:].decode(errors="replace").strip()
            self._fail_pending(
                f"the verifiers sidecar exited with {code}"
                + (f" ({type(err).__name__})" if not isinstance(err, anyio.EndOfStream) else "")
                + (f": {tail.splitlines()[-1]}" if tail else "")
            )
        except ValueError as err:
            self._fail_pending(f"the verifiers sidecar wrote a line that is not JSON: {err}")

    def _fail_pending(self, why: str) -> None:
        self._lost = self._lost or why
        for pending in self._pending.values():
            pending.done.set()

    async def _drain(self) -> None:
        process = self._process
        assert process is not None and process.stderr is not None
        async for chunk in process.stderr:
            self._stderr += chunk
            del self._stderr[:-_STDERR_TAIL]


class _Rollout:
    """One rollout in the sidecar: what an episode's lease holds.

    Its teardown cancels the rollout if it is still running there, and waits for the
    sidecar to confirm that verifiers' cleanup ran.
    """

    def __init__(self, harness: VerifiersHarness, rid: str):
        self.harness = harness
        self.id = rid
        self.running = False

    async def run(self, row: Mapping[str, Any], key: str) -> dict[str, Any]:
        h = self.harness
        request = {
            "type": "rollout",
            "input": dict(row),
            "base_url": h.server.url,
            "api_key": key,
            "model": h.server.gateway.model,
            "sampling_args": h.sampling_args,
        }
        self.running = True
        answer = await h._ask(request, rid=self.id)
        self.running = False
        return answer

    async def aclose(self) -> None:
        if not self.running or self.harness._lost is not None:
            return  # finished, or its sidecar (and so the rollout) is gone
        with anyio.fail_after(self.harness.cancel_timeout_s):
            await self.harness._ask({"type": "cancel"}, rid=self.id)
        self.running = False

    def remote_refs(self) -> list[RemoteRef]:
        return [RemoteRef(kind="verifiers-rollout", id=self.id)] if self.running else []


def _outcome(result: Mapping[str, Any]) -> dict[str, Any]:
    """What `finish_session` records for the sidecar's result."""
    error = result.get("error")
    info = {
        "verifiers": {
            "stop_condition": result.get("stop_condition"),
            "messages": result.get("messages") or [],
            "tools": result.get("tools") or [],
        }
    }
    if error is not None:
        return {
            "status": Status.FAILED,
            "error": f"verifiers rollout failed: {error}",
            "info": info,
        }
    reward = result.get("reward")
    if isinstance(reward, bool) or not isinstance(reward, int | float) or not math.isfinite(reward):
        return {
            "status": Status.FAILED,
            "error": f"the rubric gave reward {reward!r}, not a number",
            "info": info,
        }
    status = Status.TRUNCATED if result.get("is_truncated") else Status.COMPLETED
    return {"status": status, "reward": float(reward), "info": info}


async def _kill(process: Process) -> None:
    """Stop the sidecar's whole process group, politely first, then whatever is left of it
    (a rubric's worker processes) even when the sidecar itself has exited."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            break  # nothing of the group is left
        if process.returncode is None:
            with anyio.move_on_after(_KILL_TIMEOUT_S):
                await process.wait()
    if process.returncode is None:
        log.error("verifiers sidecar process group %d survived SIGKILL", process.pid)
    await process.aclose()
