"""Drive any OpenEnv server as a plies `Env`, through OpenEnv's own `GenericEnvClient`.

- `OpenEnvEndpoint`: one server as plies sees it. It owns what the envs that target the
  server share: the session limit, and the action schema read once from `GET /schema`.
- `OpenEnvEnv`: one episode in one WebSocket session (`/ws`). OpenEnv's HTTP `/reset` and
  `/step` make a fresh environment per request, so multi-step episodes need the session.
- `action_tools`: how an action schema becomes tools. An action whose only field is a string
  enum becomes one argument-free tool per value (Blackjack's `{"action": "hit" | "stand"}`
  becomes the tools `hit` and `stand`); any other action becomes one tool, `step`, whose
  parameters are the action schema, validated before anything is sent.

Why plies holds its own limit: an OpenEnv server refuses a session beyond its
`max_concurrent_envs` instead of queueing it, so a burst of episodes would fail. Every env of
an endpoint borrows a slot before it opens a session and returns it after the session is
closed, and the server frees its slot before it completes the close handshake, so with the
endpoint's `max_sessions` at or below the server's, no episode is refused. A refusal that
still happens (another client shares the server) is retried with backoff a few times and
counted in `statistics()`.

Errors: the client reports server errors as bare `RuntimeError("Server error: ... (code:
X)")`; plies maps them by code: `CAPACITY_REACHED` to `EnvCapacityError`, a rejected action
(`VALIDATION_ERROR`) to a tool error message for the model, anything else, and lost or timed
out connections, to `EnvError`. After a connection is lost the env refuses further calls:
OpenEnv's client would otherwise reconnect silently into a fresh session and play on in a
different game.

OpenEnv's client runs on asyncio, so these envs need anyio's asyncio backend.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import anyio
import httpx

from plies import ConfigError, EnvCapacityError, EnvError, ToolError
from plies.runtime import RemoteRef

from .._net import http_base_url
from ._env import Env, Message, Observation, Task, Tool, ToolResult, strip_titles

if TYPE_CHECKING:
    from openenv.core import GenericEnvClient

__all__ = [
    "EndpointStatistics",
    "OpenEnvEndpoint",
    "OpenEnvEnv",
    "action_tools",
]

log = logging.getLogger("plies.environments")

_SERVER_ERROR = re.compile(r"^Server error: (?P<message>.*) \(code: (?P<code>[A-Z_]+)\)$", re.S)
_TOOL_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_NO_ARGUMENTS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}


@dataclass(frozen=True, slots=True)
class EndpointStatistics:
    """A snapshot of an endpoint's sessions."""

    max_sessions: int
    sessions_open: int
    waiting: int
    peak_sessions: int
    capacity_refusals: int


class OpenEnvEndpoint:
    """An OpenEnv server and the limit on sessions plies opens to it.

    Make one per server and share it between all the envs that target it; it holds no
    connection, so it needs no closing.

    Args:
        base_url: the server's HTTP URL, e.g. `http://127.0.0.1:8000`.
        max_sessions: at most this many sessions open at once; set it to the server's
            `max_concurrent_envs` (or less, if other clients share the server).
        connect_timeout_s: to open the WebSocket.
        message_timeout_s: to wait for each reply.
        capacity_retries: how often a refused session is retried before `EnvCapacityError`.
        capacity_backoff_s: the first wait between those retries; it doubles each time.

    Example:
        ```python
        endpoint = OpenEnvEndpoint("http://127.0.0.1:8000", max_sessions=4)
        async with OpenEnvEnv(endpoint) as env:
            obs = await env.reset(Task(id="hand-1", seed=1))
            result = await env.call_tool("stand", {})
        ```
    """

    def __init__(
        self,
        base_url: str,
        *,
        max_sessions: int,
        connect_timeout_s: float = 10.0,
        message_timeout_s: float = 60.0,
        capacity_retries: int = 3,
        capacity_backoff_s: float = 0.2,
    ) -> None:
        if max_sessions < 1:
            raise ConfigError(f"max_sessions must be at least 1, got {max_sessions}")
        self.base_url = http_base_url(base_url)
        self.max_sessions = max_sessions
        self.connect_timeout_s = connect_timeout_s
        self.message_timeout_s = message_timeout_s
        self.capacity_retries = capacity_retries
        self.capacity_backoff_s = capacity_backoff_s
        self._limiter = anyio.CapacityLimiter(max_sessions)
        self._schema: dict[str, Any] | None = None
        self._schema_lock = anyio.Lock()
        self._peak = 0
        self._refusals = 0

    def statistics(self) -> EndpointStatistics:
        return EndpointStatistics(
            max_sessions=self.max_sessions,
            sessions_open=self._limiter.borrowed_tokens,
            waiting=self._limiter.statistics().tasks_waiting,
            peak_sessions=self._peak,
            capacity_refusals=self._refusals,
        )

    async def schema(self) -> dict[str, Any]:
        """The server's `GET /schema` (action, observation, state), fetched once."""
        async with self._schema_lock:
            if self._schema is None:
                url = f"{self.base_url}/schema"
                try:
                    async with httpx.AsyncClient(timeout=self.connect_timeout_s) as http:
                        response = await http.get(url)
                    response.raise_for_status()
                    schema = response.json()
                except (httpx.HTTPError, ValueError) as err:
                    raise EnvError(f"could not read the OpenEnv schema at {url}: {err}") from err
                if not isinstance(schema, dict) or not isinstance(schema.get("action"), dict):
                    raise EnvError(f"{url} returned no action schema")
                self._schema = schema
            return self._schema

    async def open_session(
        self, owner: object, **reset_kwargs: Any
    ) -> tuple[GenericEnvClient, dict[str, Any]]:
        """Borrow a slot, open a session and reset it; returns the client and the reset payload.

        The slot is held on behalf of `owner` until `close_session(owner, client)`.
        """
        await self._limiter.acquire_on_behalf_of(owner)
        self._peak = max(self._peak, self._limiter.borrowed_tokens)
        opened = False
        try:
            client, payload = await self._open(reset_kwargs)
            opened = True
            return client, payload
        finally:
            if not opened:
                self._limiter.release_on_behalf_of(owner)

    async def _open(self, reset_kwargs: dict[str, Any]) -> tuple[GenericEnvClient, dict[str, Any]]:
        from openenv.core import GenericEnvClient

        attempt = 0
        while True:
            client = GenericEnvClient(
                base_url=self.base_url,
                connect_timeout_s=self.connect_timeout_s,
                message_timeout_s=self.message_timeout_s,
            )
            opened = False
            try:
                with self._mapped("open a session"):
                    await client.connect()
                    result = await client.reset(**reset_kwargs)
                opened = True
                return client, _payload(result)
            except EnvCapacityError:
                self._refusals += 1
                if attempt >= self.capacity_retries:
                    raise
            finally:
                if not opened:
                    await _close_client(client, self.connect_timeout_s)
            await anyio.sleep(self.capacity_backoff_s * 2**attempt)
            attempt += 1

    async def close_session(self, owner: object, client: GenericEnvClient) -> None:
        """Close the session (shielded, bounded) and return `owner`'s slot.

        Raises:
            EnvError: the close handshake did not finish; the server may still hold the
                session until its socket times out.
        """
        try:
            if not await _close_client(client, self.connect_timeout_s):
                raise EnvError(f"closing an OpenEnv session on {self.base_url} did not finish")
        finally:
            self._limiter.release_on_behalf_of(owner)

    @contextmanager
    def _mapped(self, what: str) -> Iterator[None]:
        """Turn the client's bare errors into plies errors, chained to the original."""
        from websockets.exceptions import WebSocketException

        try:
            yield
        except RuntimeError as err:
            match = _SERVER_ERROR.match(str(err))
            if match is None:
                raise
            code, message = match["code"], match["message"]
            where = f"OpenEnv server {self.base_url}"
            if code == "CAPACITY_REACHED":
                raise EnvCapacityError(f"{where} refused a session: {message}") from err
            if code == "VALIDATION_ERROR":
                raise ToolError(f"the environment rejected the action: {message}") from err
            raise EnvError(f"{where} failed to {what}: {message} ({code})") from err
        except TimeoutError as err:
            raise EnvError(
                f"no reply from OpenEnv server {self.base_url} within {self.message_timeout_s}s "
                f"while trying to {what}; its outcome is unknown"
            ) from err
        except (ConnectionError, OSError, WebSocketException) as err:
            raise EnvError(
                f"lost the connection to OpenEnv server {self.base_url} "
                f"while trying to {what}: {err}"
            ) from err


class OpenEnvEnv(Env):
    """One episode in one OpenEnv WebSocket session; tools come from the action schema.

    Args:
        endpoint: the server, shared with the other envs that target it.
        text_field: the observation field holding the text for the model; observations
            without it are shown to the model as JSON.
        system_prompt: an optional system message before the first observation.
        step_tool_name: the name of the one tool for actions that are not a single enum.
    """

    def __init__(
        self,
        endpoint: OpenEnvEndpoint,
        *,
        text_field: str = "text",
        system_prompt: str | None = None,
        step_tool_name: str = "step",
    ) -> None:
        super().__init__()
        self.endpoint = endpoint
        self.text_field = text_field
        self.system_prompt = system_prompt
        self.step_tool_name = step_tool_name
        self._client: GenericEnvClient | None = None
        self._tool_list: list[Tool] = []
        self._episode_id: str | None = None
        self._lost = False

    def tools(self) -> list[Tool]:
        return list(self._tool_list)

    def remote_refs(self) -> list[RemoteRef]:
        if self._client is None:
            return []
        return [
            RemoteRef(
                kind="openenv-session",
                id=self._episode_id or "",
                detail={"url": self.endpoint.base_url},
            )
        ]

    async def setup(self, task: Task) -> Observation:
        schema = await self.endpoint.schema()
        self._tool_list = action_tools(
            schema["action"], self._send, step_tool_name=self.step_tool_name
        )
        self._episode_id = task.id
        kwargs: dict[str, Any] = {"episode_id": task.id}
        if task.seed is not None:
            kwargs["seed"] = task.seed
        self._client, payload = await self.endpoint.open_session(self, **kwargs)
        content, _, _, info = self._read(payload)
        messages: list[Message] = []
        if self.system_prompt is not None:
            messages.append({"role": "system", "content": self.system_prompt})
        messages.append({"role": "user", "content": content})
        return Observation(messages=messages, info=info)

    async def teardown(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            await self.endpoint.close_session(self, client)

    async def _send(self, action: dict[str, Any]) -> ToolResult:
        if self._client is None:
            raise EnvError("the OpenEnv session is not open")
        if self._lost:
            raise EnvError(
                "the connection to the OpenEnv session was lost earlier; a new call would land "
                "in a fresh server session, so this episode cannot continue"
            )
        settled = False
        try:
            with self.endpoint._mapped("step"):
                result = await self._client.step(action)
            settled = True
        except ToolError:
            settled = True  # the server refused the action and kept the session
            raise
        finally:
            if not settled:
                self._lost = True
        content, reward, done, info = self._read(_payload(result))
        return ToolResult(content=content, reward=reward, done=done, info=info)

    def _read(self, payload: dict[str, Any]) -> tuple[str, float, bool, dict[str, Any]]:
        observation = dict(payload.get("observation") or {})
        text = observation.pop(self.text_field, None)
        content = text if isinstance(text, str) else json.dumps(observation, sort_keys=True)
        if payload.get("metadata"):
            observation["metadata"] = payload["metadata"]
        return content, float(payload.get("reward") or 0.0), bool(payload.get("done")), observation


def action_tools(
    action_schema: dict[str, Any],
    send: Callable[[dict[str, Any]], Awaitable[ToolResult]],
    *,
    step_tool_name: str = "step",
) -> list[Tool]:
    """Tools for an OpenEnv action schema; each validates its arguments and calls `send(action)`.

    The `metadata` field every OpenEnv action inherits is not offered to the model.
    """
    import jsonschema

    properties = {k: v for k, v in action_schema.get("properties", {}).items() if k != "metadata"}
    required = [r for r in action_schema.get("required", []) if r != "metadata"]
    defs = action_schema.get("$defs", {})
    if len(properties) == 1 and required == list(properties):
        ((field, spec),) = properties.items()
        spec = _resolve(spec, defs)
        values = spec.get("enum")
        if (
            isinstance(values, list)
            and values
            and all(isinstance(v, str) and _TOOL_NAME.match(v) for v in values)
        ):
            hint = spec.get("description") or action_schema.get("description") or ""
            return [_enum_tool(field, value, hint, send) for value in values]

    parameters = strip_titles({**action_schema, "properties": properties, "required": required})
    if not _TOOL_NAME.match(step_tool_name):
        raise ConfigError(f"tool name {step_tool_name!r} is not a valid function name")
    validator = jsonschema.Draft202012Validator(parameters)

    async def run(arguments: dict[str, Any]) -> ToolResult:
        problems = sorted(validator.iter_errors(arguments), key=lambda e: list(e.path))
        if problems:
            text = "; ".join(
                f"{'.'.join(str(p) for p in e.path) or 'arguments'}: {e.message}" for e in problems
            )
            raise ToolError(f"invalid arguments: {text}")
        return await send(arguments)

    description = action_schema.get("description") or "Take one action in the environment."
    return [Tool(name=step_tool_name, description=description, parameters=parameters, run=run)]


def _enum_tool(
    field: str, value: str, hint: str, send: Callable[[dict[str, Any]], Awaitable[ToolResult]]
) -> Tool:
    async def run(arguments: dict[str, Any]) -> ToolResult:
        if arguments:
            raise ToolError(f"{value} takes no arguments, got {', '.join(sorted(arguments))}")
        return await send({field: value})

    description = f"Play {value!r}. {hint}".strip()
    return Tool(name=value, description=description, parameters=dict(_NO_ARGUMENTS), run=run)


def _resolve(spec: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    ref = spec.get("$ref")
    if isinstance(ref, str) and ref.startswith("#/$defs/"):
        rest = {k: v for k, v in spec.items() if k != "$ref"}
        return {**defs.get(ref.removeprefix("#/$defs/"), {}), **rest}
    return spec


def _payload(result: Any) -> dict[str, Any]:
    """OpenEnv's `StepResult` back to the wire payload's shape."""
    return {
        "observation": result.observation,
        "reward": result.reward,
        "done": result.done,
        "metadata": result.metadata,
    }


async def _close_client(client: GenericEnvClient, timeout_s: float) -> bool:
    """Close an OpenEnv client, shielded from cancellation; False if it did not finish in time."""
    with anyio.CancelScope(shield=True), anyio.move_on_after(timeout_s) as scope:
        try:
            await client.close()
        except Exception as exc:
            log.warning("closing an OpenEnv client failed: %r", exc)
            return False
    return not scope.cancelled_caught
