"""MCP servers as sources of tools: an `Env` whose tools are an MCP server's, one session a episode.

- `McpServer`: how to reach one server: a command spoken to over stdio, or a streamable HTTP
  URL; and whether it is stateless (then all episodes share one session).
- `McpHost`: the MCP host (the spec's name for the application that holds the clients). It is
  an async context manager that owns the tasks the official `mcp` SDK's sessions run in, opens
  one session per episode and makes the envs (`host.env()`, an `EnvPool` factory).
- `McpEnv`: one episode: the task's prompt, the server's tools as typed from `tools/list`, and
  a `submit` tool that ends the episode with the reward a `score` function gives.

Why a host: an `mcp.ClientSession` and its transport run in task groups, which must be left in
the task that entered them, while an env is reset in one task and may be closed in another (a
pool's teardown). Each session therefore lives in a task of the host's group, and an env only
sends requests through it.

Why a process per episode: a stateful server keeps state per process (server-memory writes one
file), so two episodes on one process would see each other's. A stdio server is started per
episode, in a fresh directory (its working directory, and `{episode_dir}` in its arguments and
environment), in its own process group and marked with `PLIES_MCP_SESSION` in its environment;
when the session ends, whatever still carries the mark is killed, so a server that forks and
leaves (npx's children) is not leaked. While it runs, the env names its process group as a
`RemoteRef` of kind "process", which `plies reap` tears down if teardown could not.

Results: text content becomes the tool message; a result with `isError` comes back as a
`ToolResult` with `error=True`; arguments that break the tool's `inputSchema`, and JSON-RPC
errors for the call, are tool errors the model reads; a lost connection or a call past its
timeout is an `EnvError` (the server may have acted, so the episode cannot go on).

Both lines of the `mcp` SDK are spoken: 1.x, which plies installs (openenv's fastmcp, a plies
dependency, requires `mcp<2`), and 2.x, which `.ci/mcp2-tier` installs in an environment of its
own and runs the MCP tests in. Where the two differ (2.x's snake_case fields, `MCPError`,
float timeouts, `list_tools(params=...)`, `httpx2` under the HTTP transport, the low-level
server's handlers given to its constructor), the helpers at the top of this module choose.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import shutil
import signal
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from datetime import timedelta
from importlib.metadata import version
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

import anyio
from anyio.abc import TaskGroup, TaskStatus

from plies import ConfigError, EnvError, ToolError, UsageError
from plies._lifecycle import AsyncLifecycle
from plies.runtime import RemoteRef, process_remote_id

from ._env import Env, Message, Observation, Task, Tool, ToolResult
from .sandbox import marked_pids

if TYPE_CHECKING:
    from mcp import ClientSession
    from mcp import types as mcp_types

__all__ = [
    "EPISODE_DIR",
    "MARK_VAR",
    "HostStatistics",
    "McpEnv",
    "McpHost",
    "McpServer",
    "McpSession",
    "marked_processes",
]

log = logging.getLogger("plies.environments")

EPISODE_DIR = "{episode_dir}"
"""Written in a stdio server's arguments or environment, it becomes the episode's own directory."""

MARK_VAR = "PLIES_MCP_SESSION"
"""The environment variable that marks every process of one stdio session."""

SUBMIT_TOOL = "submit"

_REQUEST_TIMEOUT = 408
"""The code the SDK's session gives a request that got no answer in time (HTTP's 408)."""


@functools.cache
def _sdk_major() -> int:
    """The installed `mcp` SDK's major version (1 or 2); read once, not per tool call."""
    return int(version("mcp").split(".", 1)[0])


def _sdk_field(model: Any, snake: str, camel: str) -> Any:
    """A field of an SDK model by its 2.x name (snake_case) or its 1.x name (camelCase)."""
    return getattr(model, snake) if snake in type(model).model_fields else getattr(model, camel)


def _error_code_message(err: Exception) -> tuple[int, str]:
    """The JSON-RPC code and message of the SDK's error (1.x keeps them in `error`)."""
    data = getattr(err, "error", err)
    return int(data.code), str(data.message)


def _sdk_error() -> type[Exception]:
    """The SDK's JSON-RPC error class: `MCPError` in 2.x, `McpError` in 1.x."""
    import mcp

    found: type[Exception] = getattr(mcp, "MCPError", None) or mcp.McpError
    return found


Score = Callable[["McpEnv", str], Awaitable[float]]
"""`score(env, answer) -> reward`: may call the env's session (`env.session.client`) to check
the server's state before the episode's server is gone."""

_SUBMIT_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"answer": {"type": "string", "description": "Your final answer."}},
    "required": ["answer"],
    "additionalProperties": False,
}


@dataclass(frozen=True, slots=True)
class McpServer:
    """How to reach one MCP server. Build it with `McpServer.stdio(...)` or `McpServer.http(...)`.

    Attributes:
        command: the stdio server's argv (`{episode_dir}` allowed); empty for HTTP.
        url: the streamable HTTP endpoint; None for stdio.
        env: extra environment variables of a stdio server (`{episode_dir}` allowed), on top of
            the `mcp` SDK's safe defaults (HOME, PATH, ...).
        headers: HTTP headers sent with every request (e.g. `Authorization`).
        stateless: the user's word that the server keeps no state between calls: then one
            process and one session serve every episode. Otherwise each episode gets its own
            session (and, for stdio, its own process).
    """

    command: tuple[str, ...] = ()
    url: str | None = None
    env: Mapping[str, str] = field(default_factory=dict)
    headers: Mapping[str, str] = field(default_factory=dict)
    stateless: bool = False

    def __post_init__(self) -> None:
        if bool(self.command) == (self.url is not None):
            raise ConfigError("an McpServer needs either a stdio command or an HTTP url")
        if self.url is not None and not self.url.startswith(("http://", "https://")):
            raise ConfigError(f"an MCP url must be http(s), got {self.url!r}")

    @classmethod
    def stdio(
        cls,
        command: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        stateless: bool = False,
    ) -> McpServer:
        """A server started as `command` and spoken to over its stdin and stdout."""
        return cls(command=tuple(command), env=dict(env or {}), stateless=stateless)

    @classmethod
    def http(
        cls, url: str, *, headers: Mapping[str, str] | None = None, stateless: bool = False
    ) -> McpServer:
        """A running server's streamable HTTP endpoint; each episode opens its own session."""
        return cls(url=url, headers=dict(headers or {}), stateless=stateless)

    @property
    def name(self) -> str:
        return Path(self.command[0]).name if self.command else str(self.url)


@dataclass(frozen=True, slots=True)
class HostStatistics:
    """A snapshot of a host's sessions."""

    sessions_open: int
    sessions_opened: int
    stragglers_killed: int
    """Processes still carrying a session's mark after its transport closed, killed then."""


@dataclass(eq=False)
class McpSession:
    """One initialized MCP client session, running in a task of its `McpHost`.

    Attributes:
        client: the `mcp` SDK's `ClientSession`; call it from any task.
        tools: the server's tools, from `tools/list`.
        ref: the process group of a per-episode stdio server, or the HTTP session; None for
            the shared session of a stateless server (the host owns that one).
        directory: the episode's directory (stdio), removed when the session ends.
    """

    client: ClientSession
    tools: list[mcp_types.Tool]
    ref: RemoteRef | None
    directory: Path | None
    shared: bool = False
    error: Exception | None = None
    _stop: anyio.Event = field(default_factory=anyio.Event)
    _ended: anyio.Event = field(default_factory=anyio.Event)


class McpHost(AsyncLifecycle):
    """Opens MCP sessions for episodes and owns the tasks they run in.

    Args:
        server: the server to reach.
        init_timeout_s: to start a server, initialize the session and list its tools.
        call_timeout_s: for each tool call; past it the env raises `EnvError`.
        close_timeout_s: to end a session (the transport's own shutdown, then the kill).

    Example:
        ```python
        server = McpServer.stdio(["mcp-server-memory"], env={"MEMORY_FILE_PATH":
                                 "{episode_dir}/memory.jsonl"})
        async with McpHost(server) as host:
            async with host.env() as env:
                obs = await env.reset(Task(id="t", data={"prompt": "Remember that I like tea."}))
                result = await env.call_tool("read_graph", {})
        ```
    """

    def __init__(
        self,
        server: McpServer,
        *,
        init_timeout_s: float = 60.0,
        call_timeout_s: float = 60.0,
        close_timeout_s: float = 10.0,
    ) -> None:
        self.server = server
        self.init_timeout_s = init_timeout_s
        self.call_timeout_s = call_timeout_s
        self.close_timeout_s = close_timeout_s
        self._tg: TaskGroup | None = None
        self._shared: McpSession | None = None
        self._shared_lock = anyio.Lock()
        self._open_count = 0
        self._opened = 0
        self._stragglers = 0

    def statistics(self) -> HostStatistics:
        return HostStatistics(self._open_count, self._opened, self._stragglers)

    def env(self, *, score: Score | None = None, system_prompt: str | None = None) -> McpEnv:
        """A new env on this host (for `EnvPool(lambda: ...)` or `async with`)."""
        return McpEnv(self, score=score, system_prompt=system_prompt)

    async def __aenter__(self) -> McpHost:
        self._open()
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        if not self._close() or self._tg is None:
            return
        shared, self._shared = self._shared, None
        if shared is not None:
            with contextlib.suppress(EnvError):
                await self._end(shared)
        # Sessions no env closed end here: their tasks are cancelled, and each task's cleanup
        # (shielded) kills its server before the group exits.
        self._tg.cancel_scope.cancel()
        await self._tg.__aexit__(None, None, None)

    async def open_session(self) -> McpSession:
        """A session for one episode: the shared one for a stateless server, else a new one.

        Raises:
            EnvError: the server did not start, initialize or list its tools in time.
        """
        self._check_open("open an MCP session")
        if not self.server.stateless:
            return await self._start()
        async with self._shared_lock:
            if self._shared is None or self._shared._ended.is_set():
                self._shared = await self._start()
                self._shared.shared = True
                self._shared.ref = None
            return self._shared

    async def close_session(self, session: McpSession) -> None:
        """End an episode's session (the shared one stays open until the host exits).

        Raises:
            EnvError: the session did not end in `close_timeout_s`; its server may be alive.
        """
        if session.shared:
            return
        await self._end(session)

    async def _start(self) -> McpSession:
        assert self._tg is not None
        # Shielded: a session that started must be known to its env, or nobody ends it.
        with anyio.CancelScope(shield=True):
            return await self._tg.start(self._run)

    async def _end(self, session: McpSession) -> None:
        session._stop.set()
        with anyio.CancelScope(shield=True), anyio.move_on_after(self.close_timeout_s):
            await session._ended.wait()
        if not session._ended.is_set():
            raise EnvError(f"the MCP session of {self.server.name} did not end in time")
        if session.error is not None:  # its cleanup ran all the same: nothing is left
            log.warning(
                "the MCP session of %s failed: %s", self.server.name, _describe(session.error)
            )

    async def _run(self, *, task_status: TaskStatus[McpSession]) -> None:
        mark = uuid.uuid4().hex
        session: McpSession | None = None
        directory: Path | None = None
        with tempfile.TemporaryFile("w+") as errlog:
            try:
                async with AsyncExitStack() as stack:
                    if self.server.command:
                        directory = Path(tempfile.mkdtemp(prefix="plies-mcp-"))
                        streams = await stack.enter_async_context(
                            self._stdio(mark, directory, errlog)
                        )
                    else:
                        streams = await stack.enter_async_context(self._http(stack))
                    session = await self._initialize(stack, streams, mark, directory)
                    self._open_count += 1
                    self._opened += 1
                    task_status.started(session)
                    try:
                        await session._stop.wait()
                    finally:
                        self._open_count -= 1
            except Exception as err:
                if session is None:
                    raise EnvError(
                        f"could not start an MCP session with {self.server.name}: "
                        f"{_describe(err)}{_tail(errlog)}"
                    ) from err
                session.error = err
            finally:
                with anyio.CancelScope(shield=True):
                    if self.server.command:
                        self._stragglers += await anyio.to_thread.run_sync(_kill_marked, mark)
                    if directory is not None:
                        await anyio.to_thread.run_sync(
                            lambda: shutil.rmtree(directory, ignore_errors=True)
                        )
                    if session is not None:
                        session._ended.set()

    def _stdio(self, mark: str, directory: Path, errlog: TextIO) -> Any:
        from mcp import StdioServerParameters
        from mcp.client.stdio import stdio_client

        where = str(directory)
        command, *args = (a.replace(EPISODE_DIR, where) for a in self.server.command)
        if os.sep in command and not os.path.isabs(command):
            command = os.path.abspath(command)  # the server starts in the episode's directory
        env = {k: v.replace(EPISODE_DIR, where) for k, v in self.server.env.items()}
        params = StdioServerParameters(
            command=command, args=args, env={**env, MARK_VAR: mark}, cwd=directory
        )
        return stdio_client(params, errlog=errlog)

    def _http(self, stack: AsyncExitStack) -> Any:
        from mcp.client.streamable_http import streamable_http_client

        if _sdk_major() >= 2:
            import httpx2 as httpx  # 2.x's transport takes the httpx fork's client only
        else:
            import httpx

        assert self.server.url is not None
        # A response stream may stay open while a tool runs: reads wait as long as a call may.
        timeout = httpx.Timeout(self.init_timeout_s, read=max(self.call_timeout_s, 300.0))
        http = httpx.AsyncClient(
            headers=dict(self.server.headers), timeout=timeout, follow_redirects=True
        )
        stack.push_async_callback(http.aclose)
        return streamable_http_client(self.server.url, http_client=http)

    async def _initialize(
        self, stack: AsyncExitStack, streams: Any, mark: str, directory: Path | None
    ) -> McpSession:
        from mcp import ClientSession

        read, write, *rest = streams
        client = await stack.enter_async_context(ClientSession(read, write))
        with anyio.fail_after(self.init_timeout_s):
            await client.initialize()
            tools = []
            cursor: str | None = None
            while True:
                page = await _list_tools(client, cursor)
                tools.extend(page.tools)
                cursor = _sdk_field(page, "next_cursor", "nextCursor")
                if not cursor:
                    break
        ref: RemoteRef | None
        if self.server.command:
            leader = await anyio.to_thread.run_sync(_leader, mark)
            detail = {"server": self.server.name, MARK_VAR: mark}
            ref = RemoteRef(kind="process", id=process_remote_id(leader), detail=detail)
        else:
            session_id = rest[0]() if rest else None
            ref = RemoteRef(
                kind="mcp-session", id=session_id or "", detail={"url": str(self.server.url)}
            )
        return McpSession(client, tools, ref, directory)


class McpEnv(Env):
    """One episode with an MCP server's tools, in its own session.

    The task's `data["prompt"]` is the user's message. The tools are the server's, typed from
    `tools/list`, plus `submit(answer)`, which ends the episode: its reward is
    `await score(env, answer)` (0 without a `score`), computed while the session is still
    open so the score can read the server's state.

    Args:
        host: the host that opens the session.
        score: `score(env, answer) -> float`.
        system_prompt: a system message before the prompt.
    """

    def __init__(
        self, host: McpHost, *, score: Score | None = None, system_prompt: str | None = None
    ) -> None:
        super().__init__()
        self.host = host
        self.score = score
        self.system_prompt = system_prompt
        self.task: Task | None = None
        self.session: McpSession | None = None
        self._tool_list: list[Tool] = []

    def tools(self) -> list[Tool]:
        return list(self._tool_list)

    def remote_refs(self) -> list[RemoteRef]:
        if self.session is None or self.session.ref is None:
            return []
        return [self.session.ref]

    async def setup(self, task: Task) -> Observation:
        prompt = task.data.get("prompt")
        if not isinstance(prompt, str) or not prompt:
            raise ConfigError(f"task {task.id!r} needs data['prompt'], the user's message")
        self.task = task
        self.session = session = await self.host.open_session()
        names = {t.name for t in session.tools}
        if SUBMIT_TOOL in names:
            raise ConfigError(
                f"{self.host.server.name} has its own {SUBMIT_TOOL!r} tool, which McpEnv "
                "offers to end the episode"
            )
        self._tool_list = [self._tool(t) for t in session.tools]
        submit = "Submit your final answer; ends the episode."
        self._tool_list.append(Tool(SUBMIT_TOOL, submit, _SUBMIT_SCHEMA, self._submit))
        messages: list[Message] = []
        if self.system_prompt is not None:
            messages.append({"role": "system", "content": self.system_prompt})
        messages.append({"role": "user", "content": prompt})
        return Observation(messages=messages, info={"mcp_server": self.host.server.name})

    async def teardown(self) -> None:
        session, self.session = self.session, None
        if session is not None:
            try:
                await self.host.close_session(session)
            except EnvError:
                self.session = session  # still held: remote_refs names it
                raise

    def _tool(self, spec: mcp_types.Tool) -> Tool:
        import jsonschema

        schema = dict(_sdk_field(spec, "input_schema", "inputSchema")) or {
            "type": "object",
            "properties": {},
        }
        validator = jsonschema.Draft202012Validator(schema)
        name = spec.name

        async def run(arguments: dict[str, Any]) -> ToolResult:
            problems = sorted(validator.iter_errors(arguments), key=lambda e: list(e.path))
            if problems:
                text = "; ".join(
                    f"{'.'.join(str(p) for p in e.path) or 'arguments'}: {e.message}"
                    for e in problems
                )
                raise ToolError(f"invalid arguments: {text}")
            return await self._call(name, arguments)

        return Tool(name=name, description=spec.description or name, parameters=schema, run=run)

    async def _call(self, name: str, arguments: dict[str, Any]) -> ToolResult:
        from mcp.types import CONNECTION_CLOSED

        session = self.session
        if session is None or session._ended.is_set():
            raise EnvError(f"the MCP session of {self.host.server.name} has ended")
        seconds = self.host.call_timeout_s
        timeout = seconds if _sdk_major() >= 2 else timedelta(seconds=seconds)
        try:
            result = await session.client.call_tool(name, arguments, read_timeout_seconds=timeout)
        except _sdk_error() as err:
            code, message = _error_code_message(err)
            if code in (CONNECTION_CLOSED, _REQUEST_TIMEOUT):
                server = self.host.server.name
                raise EnvError(f"{server} did not answer {name!r}: {message}") from err
            raise ToolError(message) from err
        except (anyio.ClosedResourceError, anyio.BrokenResourceError, OSError) as err:
            raise EnvError(f"lost the MCP session of {self.host.server.name}: {err!r}") from err
        info: dict[str, Any] = {}
        structured = _sdk_field(result, "structured_content", "structuredContent")
        if structured is not None:
            info["structured"] = structured
        is_error = bool(_sdk_field(result, "is_error", "isError"))
        return ToolResult(content=content_text(result), error=is_error, info=info)

    async def _submit(self, arguments: dict[str, Any]) -> ToolResult:
        answer = arguments.get("answer")
        if not isinstance(answer, str) or set(arguments) != {"answer"}:
            raise ToolError("submit takes one string argument, answer")
        if self.task is None:
            raise UsageError("submit before reset")
        reward = 0.0 if self.score is None else float(await self.score(self, answer))
        return ToolResult(content="Submitted.", reward=reward, done=True, info={"answer": answer})


def content_text(result: mcp_types.CallToolResult) -> str:
    """The text of a tool result for the model: text blocks as they are, others named."""
    from mcp import types

    parts: list[str] = []
    for block in result.content:
        if isinstance(block, types.TextContent):
            parts.append(block.text)
        elif isinstance(block, types.EmbeddedResource):
            inner = block.resource
            text = getattr(inner, "text", None)
            parts.append(text if isinstance(text, str) else f"[resource {inner.uri}]")
        elif isinstance(block, types.ResourceLink):
            parts.append(f"[resource link {block.uri}]")
        else:
            mime = getattr(block, "mime_type", None) or getattr(block, "mimeType", "")
            parts.append(f"[{block.type} {mime}]".replace(" ]", "]"))
    structured = _sdk_field(result, "structured_content", "structuredContent")
    if not parts and structured is not None:
        parts.append(json.dumps(structured, sort_keys=True))
    return "\n".join(parts)


async def _list_tools(client: ClientSession, cursor: str | None) -> Any:
    """One page of `tools/list`: 2.x takes the cursor in `params`, 1.x as an argument."""
    if _sdk_major() < 2:
        return await client.list_tools(cursor)
    from mcp import types

    params = types.PaginatedRequestParams(cursor=cursor) if cursor else None
    return await client.list_tools(params=params)


def marked_processes(mark: str | None = None) -> list[int]:
    """Pids of live processes carrying `PLIES_MCP_SESSION` (with this value, if given)."""
    return marked_pids(MARK_VAR, mark)


def _leader(mark: str) -> int:
    """The marked process that leads its own group: the server the transport started."""
    for pid in marked_processes(mark):
        with contextlib.suppress(OSError):
            if os.getpgid(pid) == pid:
                return pid
    raise EnvError("the MCP server process exited during initialization")


def _kill_marked(mark: str, wait_s: float = 2.0) -> int:
    """SIGKILL every process carrying `mark` and wait until none is left; how many there were.

    Blocking (it runs in a worker thread): a killed process lingers until the kernel has torn
    it down, and the session is only over once nothing of it is left.
    """
    killed: set[int] = set()
    deadline = time.monotonic() + wait_s
    while pids := marked_processes(mark):
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
                killed.add(pid)
        if time.monotonic() > deadline:
            log.warning("processes of MCP session %s outlived SIGKILL: %s", mark, pids)
            break
        time.sleep(0.01)
    return len(killed)


def _describe(err: BaseException) -> str:
    while isinstance(err, BaseExceptionGroup) and len(err.exceptions) == 1:
        err = err.exceptions[0]
    if isinstance(err, TimeoutError):
        return "timed out"
    return f"{type(err).__name__}: {err}"


def _tail(errlog: TextIO, limit: int = 800) -> str:
    try:
        errlog.flush()
        errlog.seek(0)
        text = errlog.read()[-limit:].strip()
    except OSError:
        return ""
    return f"; its stderr ends: {text}" if text else ""
