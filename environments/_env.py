"""The environment interface: `Env`, its tools, and the records they exchange.

- `Task`: what one episode is about (an id, a seed, free-form data).
- `Observation`: what `Env.reset` returns: the opening chat messages and the tool schemas.
- `ToolResult`: what `Env.call_tool` returns: the text for the model, reward, done, info,
  and whether the call was refused.
- `Tool`: one callable tool with its OpenAI-style JSON schema.
- `tool`: the decorator that turns an `Env` method into a `Tool`.
- `RemoteRef` (from `plies.runtime`): a piece of remote state an env holds (a sandbox, a
  server session), named so that a quarantine report can find and reap it later.

An `Env` is single-use: one instance plays one episode, then is closed. Whatever is
shared between episodes (a server's session limit, a sandbox backend) belongs to the object
that creates the envs.
"""

from __future__ import annotations

import inspect
import json
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Self, get_type_hints

import anyio
from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model

from plies import EnvError, ToolError, UsageError
from plies._lifecycle import AsyncLifecycle, OpenState
from plies.runtime import RemoteRef

__all__ = [
    "DEFAULT_CLOSE_TIMEOUT_S",
    "Env",
    "Message",
    "Observation",
    "Task",
    "Tool",
    "ToolResult",
    "tool",
]

Message = dict[str, Any]
"""One chat message in the OpenAI format: `{"role": ..., "content": ...}`."""

DEFAULT_CLOSE_TIMEOUT_S = 30.0
"""How long `Env.close` waits for teardown before it gives up and reports a failure."""


class Task(BaseModel):
    """What one episode is about. The same task given twice yields the same episode."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    id: str = Field(description="Stable task id; groups of episodes share it.")
    seed: int | None = Field(
        default=None, ge=0, description="Fixes the env's randomness; None draws a fresh one."
    )
    data: dict[str, Any] = Field(default_factory=dict, description="Free-form task payload.")


class Observation(BaseModel):
    """The opening of an episode: the messages the model sees first and the tools it may call."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    messages: list[Message] = Field(description="Opening chat messages, OpenAI format.")
    tools: list[dict[str, Any]] = Field(
        default_factory=list,
        description='OpenAI-style tool schemas: {"type": "function", "function": {...}}.',
    )
    info: dict[str, Any] = Field(default_factory=dict, description="Env-specific facts.")


class ToolResult(BaseModel):
    """The outcome of one tool call, returned to the harness."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    content: str = Field(description="Text of the tool message the model sees next.")
    reward: float = Field(default=0.0, description="Reward earned by this call.")
    done: bool = Field(default=False, description="True when the episode is over.")
    info: dict[str, Any] = Field(default_factory=dict, description="Env-specific facts.")
    error: bool = Field(
        default=False,
        description="True when the call was refused (unknown tool, bad arguments): the "
        "model gets the message and may try again; the env's state did not change.",
    )


ToolFn = Callable[[dict[str, Any]], Awaitable["ToolResult | str"]]


@dataclass(frozen=True, slots=True)
class Tool:
    """A tool the model may call: its schema, and a function that validates and runs it.

    `run` receives the raw argument mapping, raises `ToolError` when the arguments are
    unacceptable, and returns a `ToolResult` (or a bare string for the content).
    """

    name: str
    description: str
    parameters: dict[str, Any]
    run: ToolFn

    def schema(self) -> dict[str, Any]:
        """The OpenAI-style function schema offered to the model."""
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": self.parameters,
            },
        }


@dataclass(frozen=True, slots=True)
class _ToolMarker:
    name: str
    description: str
    args_model: type[BaseModel]


def tool(
    fn: Callable[..., Any] | None = None, *, name: str | None = None, description: str | None = None
) -> Any:
    """Mark an `Env` method as a tool.

    The JSON schema comes from the signature: each parameter after `self` becomes a field of
    a pydantic model (use `Annotated[int, Field(description=...)]` to describe it), which also
    validates the model's arguments before the method runs. The description defaults to the
    first paragraph of the docstring. Async methods are awaited; plain methods run in a
    worker thread through `anyio.to_thread`, so blocking env code never stalls the loop.

    The method returns a `ToolResult`, or a string (a result with no reward that is not done).
    Raise `ToolError` to refuse a call with a message for the model.

    Example:
        ```python
        class Counter(Env):
            @tool
            async def add(self, n: Annotated[int, Field(ge=1)]) -> ToolResult:
                "Add n to the counter."
                self.total += n
                return ToolResult(content=str(self.total), done=self.total >= 10)
        ```
    """

    def mark(f: Callable[..., Any]) -> Callable[..., Any]:
        tool_name = name or f.__name__
        doc = inspect.getdoc(f) or ""
        text = description if description is not None else doc.split("\n\n")[0].strip()
        if not text:
            raise UsageError(f"tool {tool_name!r} needs a docstring or a description")
        f.__plies_tool__ = _ToolMarker(tool_name, text, _args_model(f, tool_name))  # type: ignore[attr-defined]
        return f

    return mark(fn) if fn is not None else mark


def _args_model(fn: Callable[..., Any], tool_name: str) -> type[BaseModel]:
    hints = get_type_hints(fn, include_extras=True)
    fields: dict[str, Any] = {}
    for i, param in enumerate(inspect.signature(fn).parameters.values()):
        if i == 0:  # self
            continue
        if param.kind not in (param.POSITIONAL_OR_KEYWORD, param.KEYWORD_ONLY):
            raise UsageError(f"tool {tool_name!r}: *args and **kwargs cannot be described")
        if param.name not in hints:
            raise UsageError(f"tool {tool_name!r}: parameter {param.name!r} needs a type hint")
        default = ... if param.default is param.empty else param.default
        fields[param.name] = (hints[param.name], default)
    return create_model(  # type: ignore[call-overload]
        f"{tool_name}_arguments", __config__=ConfigDict(extra="forbid"), **fields
    )


def json_schema(model: type[BaseModel]) -> dict[str, Any]:
    """A pydantic model's JSON schema without the `title` keys models need no help with."""
    return strip_titles(model.model_json_schema())


def strip_titles(node: Any) -> Any:
    if isinstance(node, dict):
        out = {}
        for key, value in node.items():
            if key == "title" and isinstance(value, str):
                continue
            if key in ("properties", "$defs"):  # keys here are names, not keywords
                out[key] = {k: strip_titles(v) for k, v in value.items()}
            else:
                out[key] = strip_titles(value)
        return out
    if isinstance(node, list):
        return [strip_titles(v) for v in node]
    return node


def describe_validation_error(err: ValidationError) -> str:
    """A short, model-readable account of what was wrong with the arguments."""
    parts = []
    for e in err.errors(include_url=False):
        where = ".".join(str(x) for x in e["loc"]) or "arguments"
        parts.append(f"{where}: {e['msg']}")
    return "; ".join(parts)


class Env(AsyncLifecycle, ABC):
    """An async, single-use environment: one instance plays one episode, then is closed.

    Its lifetime is `lifecycle`, an `OpenState`: `reset` opens it, `close` closes it. Whether
    the episode is `done` is kept beside it, since a done env is still open (only close is left).
    It is a `plies.runtime.HoldsRemote`: a pool reads `remote_refs()` to report what an env
    it could not tear down still holds.

    Subclasses implement `setup` (start the episode, return the opening messages) and
    declare tools with `@tool`. If they hold anything remote, they implement `teardown`
    (called once by `close`, shielded from cancellation and bounded by `close_timeout_s`)
    and `remote_refs` (what to report if teardown cannot be confirmed).

    The harness drives it: `obs = await env.reset(task)`, then
    `await env.call_tool(name, arguments)` until a result says `done`, then `await
    env.close()` (or `async with env:`). A call to an unknown tool or with bad arguments
    returns a `ToolResult` with `error=True` and leaves the env unchanged.

    Example:
        ```python
        class GuessEnv(Env):
            async def setup(self, task: Task) -> Observation:
                self.secret = random.Random(task.seed).randint(1, 10)
                return Observation(messages=[{"role": "user", "content": "Guess 1-10."}])

            @tool
            async def guess(self, n: Annotated[int, Field(ge=1, le=10)]) -> ToolResult:
                "Guess the number."
                if n == self.secret:
                    return ToolResult(content="Right!", reward=1.0, done=True)
                return ToolResult(content="Higher." if n < self.secret else "Lower.")

        async with GuessEnv() as env:
            obs = await env.reset(Task(id="g", seed=1))
            result = await env.call_tool("guess", {"n": 5})
        ```
    """

    close_timeout_s: ClassVar[float] = DEFAULT_CLOSE_TIMEOUT_S
    _class_tools: ClassVar[dict[str, _ToolMarker]] = {}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        found: dict[str, _ToolMarker] = {}
        for klass in reversed(cls.__mro__):
            for attr, value in vars(klass).items():
                marker = getattr(value, "__plies_tool__", None)
                if isinstance(marker, _ToolMarker):
                    found = {k: v for k, v in found.items() if v.name != marker.name}
                    found[attr] = marker
        cls._class_tools = found

    def __init__(self) -> None:
        self._done = False
        self._lock = anyio.Lock()
        self._tools: dict[str, Tool] | None = None

    # -- what subclasses write -------------------------------------------------------------

    @abstractmethod
    async def setup(self, task: Task) -> Observation:
        """Start the episode and return its opening messages and info.

        `reset` fills in the tool list, so `setup` leaves `tools` empty. If `setup` fails
        part-way, `close` still runs `teardown`: keep handles to whatever was created as
        soon as it exists.
        """

    async def teardown(self) -> None:
        """Release what `setup` and the tools acquired. Called at most once per success."""

    def remote_refs(self) -> list[RemoteRef]:
        """Remote state this env holds now; a quarantine report lists it if teardown fails."""
        return []

    def tools(self) -> list[Tool]:
        """The tools offered to the model. The default: the methods marked with `@tool`."""
        if self._tools is None:
            self._tools = {
                marker.name: Tool(
                    name=marker.name,
                    description=marker.description,
                    parameters=json_schema(marker.args_model),
                    run=self._bind(getattr(self, attr), marker.args_model),
                )
                for attr, marker in self._class_tools.items()
            }
        return list(self._tools.values())

    # -- what the harness calls ------------------------------------------------------------

    @property
    def done(self) -> bool:
        """True once a tool result said the episode is over."""
        return self._done

    async def reset(self, task: Task) -> Observation:
        """Start the episode for `task`; returns the opening messages and the tool schemas.

        Raises:
            UsageError: the env was reset before (envs are single-use) or is closed.
        """
        async with self._lock:
            if self.lifecycle is not OpenState.UNOPENED:
                was = "reset" if self.lifecycle is OpenState.OPEN else "closed"
                raise UsageError(
                    f"{type(self).__name__} is single-use and was already {was}; "
                    "make a new env for each episode"
                )
            self._open()
            obs = await self.setup(task)
            return obs.model_copy(update={"tools": [t.schema() for t in self.tools()]})

    async def call_tool(self, name: str, arguments: Mapping[str, Any] | str | None) -> ToolResult:
        """Call one tool. `arguments` is a mapping or the model's raw JSON text.

        An unknown tool, unparsable JSON or invalid arguments come back as a `ToolResult`
        with `error=True`, so the model can correct itself; env failures raise `EnvError`.

        Raises:
            UsageError: called before `reset`, after the episode is done, or after close.
        """
        async with self._lock:
            if self.lifecycle is not OpenState.OPEN or self._done:
                now = "done" if self.lifecycle is OpenState.OPEN else self._unusable()
                raise UsageError(
                    f"call_tool({name!r}) on an env that is {now}: "
                    "tools can be called after reset and until a result says done"
                )
            tools = {t.name: t for t in self.tools()}
            try:
                args = _parse_arguments(arguments)
                if name not in tools:
                    known = ", ".join(sorted(tools)) or "none"
                    raise ToolError(f"unknown tool {name!r}; available tools: {known}")
                out = await tools[name].run(args)
            except ToolError as err:
                return ToolResult(content=f"Error: {err}", error=True)
            result = out if isinstance(out, ToolResult) else ToolResult(content=str(out))
            if result.done:
                self._done = True
            return result

    async def close(self) -> None:
        """Tear the env down. Idempotent; shielded from cancellation and bounded in time.

        Raises:
            EnvError: teardown failed or did not finish within `close_timeout_s`; the
                remote state in `remote_refs()` may still exist, and calling `close` again
                retries.
        """
        if self.lifecycle is OpenState.CLOSED:
            return
        with anyio.CancelScope(shield=True):
            try:
                with anyio.fail_after(self.close_timeout_s):
                    await self.teardown()
            except TimeoutError as err:
                raise EnvError(
                    f"{type(self).__name__} teardown did not finish in {self.close_timeout_s}s; "
                    f"still held: {self.remote_refs()}"
                ) from err
            except EnvError:
                raise
            except Exception as err:
                raise EnvError(
                    f"{type(self).__name__} teardown failed: {type(err).__name__}: {err}; "
                    f"still held: {self.remote_refs()}"
                ) from err
        self._close()

    def _unusable(self) -> str:
        return "not reset yet" if self.lifecycle is OpenState.UNOPENED else "closed"

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    # -- internals -------------------------------------------------------------------------

    @staticmethod
    def _bind(method: Callable[..., Any], args_model: type[BaseModel]) -> ToolFn:
        is_async = inspect.iscoroutinefunction(method)

        async def run(arguments: dict[str, Any]) -> ToolResult | str:
            try:
                parsed = args_model.model_validate(arguments)
            except ValidationError as err:
                raise ToolError(f"invalid arguments: {describe_validation_error(err)}") from None
            kwargs = {field: getattr(parsed, field) for field in type(parsed).model_fields}
            if is_async:
                return await method(**kwargs)
            return await anyio.to_thread.run_sync(lambda: method(**kwargs))

        return run


def _parse_arguments(arguments: Mapping[str, Any] | str | None) -> dict[str, Any]:
    if arguments is None:
        return {}
    if isinstance(arguments, str):
        if not arguments.strip():
            return {}
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError as err:
            raise ToolError(f"arguments are not valid JSON: {err}") from None
    if not isinstance(arguments, Mapping):
        raise ToolError(f"arguments must be a JSON object, got {type(arguments).__name__}")
    return dict(arguments)
