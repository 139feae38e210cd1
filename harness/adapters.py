"""Adapters: how to start each agent program against a gateway session, offline.

An adapter knows one agent's command line, environment variables and configuration files; it
knows nothing of plies' sessions or sandboxes (`AgentHarness` does). Each one is pinned to the
version it was tested with in `.ci/agents-tier` and names the wire it speaks, because agents
change their flags and their wire often. Every adapter writes:

- a fresh `HOME` (and the agent's own config directory under it), so no user settings leak in
  and nothing the agent saves survives the episode;
- the gateway's base URL and the session key as the API key;
- the agent's offline switches (no update checks, telemetry, model catalogues or plugins);
- a permission mode that runs its tools without asking (the sandbox is the boundary);
- the MCP servers the env offers (`LaunchSpec.mcp_servers`), where the agent speaks MCP
  (Claude Code and Codex; the others refuse them in one line).

| adapter | package (pinned) | wire |
| --- | --- | --- |
| `ClaudeCode` | npm `@anthropic-ai/claude-code` 2.1.197 | Anthropic Messages |
| `Codex` | npm `@openai/codex` 0.171.0 | OpenAI Responses |
| `OpenCode` | npm `opencode-ai` 1.18.33 | Chat Completions |
| `Pi` | npm `@mariozechner/pi-coding-agent` 0.73.1 | Chat Completions |
| `MiniSweAgent` | PyPI `mini-swe-agent` 2.4.6 | Chat Completions |
| `AgentsSdk` | PyPI `openai-agents` 0.24.0 (a script) | Chat Completions or Responses |
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib import resources
from typing import Any, ClassVar, Literal, Protocol, runtime_checkable

from plies import ConfigError
from plies.environments import McpServer

__all__ = [
    "AgentAdapter",
    "AgentLaunch",
    "AgentsSdk",
    "ClaudeCode",
    "Codex",
    "LaunchSpec",
    "MiniSweAgent",
    "OpenCode",
    "Pi",
    "Wire",
]

Wire = Literal["chat", "messages", "responses"]
"""The API an agent speaks: Chat Completions, Anthropic Messages or OpenAI Responses."""

_KEY_VAR = "PLIES_GATEWAY_KEY"
"""The variable that carries the session key, for agents that read it by name."""


@dataclass(frozen=True, slots=True)
class LaunchSpec:
    """What an adapter gets to build one episode's launch.

    Attributes:
        instruction: the task, as the agent's first prompt.
        base_url: the gateway's root URL (no `/v1`), as seen from where the agent runs.
        api_key: the session key.
        model: the model name the gateway serves.
        home: an absolute, empty directory to use as `HOME`.
        workdir: the absolute working directory the agent runs in.
        max_turns: the most model calls the agent should make, where it has a switch.
        mcp_servers: MCP servers the agent is given, by the name its tools appear under.
    """

    instruction: str
    base_url: str
    api_key: str
    model: str
    home: str
    workdir: str
    max_turns: int
    mcp_servers: Mapping[str, McpServer] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class AgentLaunch:
    """How to start one episode's agent.

    Attributes:
        argv: the command line.
        env: environment variables on top of the sandbox's own.
        files: files to write first, by path relative to `HOME`.
    """

    argv: list[str]
    env: dict[str, str]
    files: dict[str, str] = field(default_factory=dict)


@runtime_checkable
class AgentAdapter(Protocol):
    """Starts one agent program. Implementations are small frozen dataclasses.

    Attributes:
        name: a short name for records (`Trajectory.info["agent"]`).
        package: the registry package it comes from.
        version: the version it was tested with.
        wire: the API it speaks.
    """

    name: ClassVar[str]
    package: ClassVar[str]
    version: ClassVar[str]
    wire: Wire

    def launch(self, spec: LaunchSpec) -> AgentLaunch:
        """The command, environment and files for one episode."""
        ...


def _check_command(command: str, name: str) -> str:
    if not command:
        raise ConfigError(f"the {name} adapter needs the path of its command")
    return command


def _no_mcp(spec: LaunchSpec, name: str) -> None:
    if spec.mcp_servers:
        raise ConfigError(
            f"the {name} adapter cannot give its agent MCP servers (ClaudeCode and Codex can); "
            f"the env offers {sorted(spec.mcp_servers)}"
        )


def _claude_mcp(server: McpServer) -> dict[str, Any]:
    if server.url is not None:
        return {"type": "http", "url": server.url, "headers": dict(server.headers)}
    command, *args = server.command
    return {"type": "stdio", "command": command, "args": args, "env": dict(server.env)}


def _toml_table(values: Mapping[str, str]) -> str:
    return "{" + ", ".join(f"{json.dumps(k)} = {json.dumps(v)}" for k, v in values.items()) + "}"


def _codex_mcp(name: str, server: McpServer) -> list[str]:
    lines = ["", f"[mcp_servers.{json.dumps(name)}]"]
    if server.url is not None:
        lines += [f"url = {json.dumps(server.url)}"]
        if server.headers:
            lines += [f"http_headers = {_toml_table(server.headers)}"]
    else:
        command, *args = server.command
        lines += [f"command = {json.dumps(command)}", f"args = {json.dumps(args)}"]
        if server.env:
            lines += [f"env = {_toml_table(server.env)}"]
    return lines


@dataclass(frozen=True, slots=True)
class ClaudeCode:
    """Claude Code in print mode (`claude -p`), bypassing permission prompts.

    `CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC=1` stops its update, telemetry and title calls;
    `IS_SANDBOX=1` lets it bypass permissions as root. It posts `/v1/messages?beta=true`,
    always streamed.

    Args:
        command: the `claude` executable (npm `.bin/claude`).
    """

    command: str = "claude"
    name: ClassVar[str] = "claude-code"
    package: ClassVar[str] = "@anthropic-ai/claude-code"
    version: ClassVar[str] = "2.1.197"
    wire: Wire = "messages"

    def launch(self, spec: LaunchSpec) -> AgentLaunch:
        argv = [
            _check_command(self.command, self.name),
            "-p",
            spec.instruction,
            "--output-format",
            "stream-json",
            "--verbose",
            "--permission-mode",
            "bypassPermissions",
            "--model",
            spec.model,
            "--max-turns",
            str(spec.max_turns),
        ]
        files = {}
        if spec.mcp_servers:
            # In a file, not on the command line: the headers carry the episode's token.
            servers = {name: _claude_mcp(s) for name, s in spec.mcp_servers.items()}
            files["mcp.json"] = json.dumps({"mcpServers": servers})
            argv += ["--strict-mcp-config", "--mcp-config", f"{spec.home}/mcp.json"]
        env = {
            "HOME": spec.home,
            "ANTHROPIC_BASE_URL": spec.base_url,
            "ANTHROPIC_API_KEY": spec.api_key,
            "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
            "DISABLE_AUTOUPDATER": "1",
            "IS_SANDBOX": "1",
        }
        return AgentLaunch(argv, env, files)


@dataclass(frozen=True, slots=True)
class Codex:
    """Codex CLI (`codex exec`), its provider in `$CODEX_HOME/config.toml` on the Responses wire.

    The config names a custom provider (the gateway) with `wire_api = "responses"` and the key in
    `PLIES_GATEWAY_KEY`, and turns off update checks, analytics and plugins (else it tries to
    reach GitHub and ChatGPT).

    Args:
        command: the `codex` executable (npm `.bin/codex`).
    """

    command: str = "codex"
    name: ClassVar[str] = "codex"
    package: ClassVar[str] = "@openai/codex"
    version: ClassVar[str] = "0.171.0"
    wire: Wire = "responses"

    def launch(self, spec: LaunchSpec) -> AgentLaunch:
        config = "\n".join(
            [
                f"model = {json.dumps(spec.model)}",
                'model_provider = "plies"',
                "check_for_update_on_startup = false",
                "",
                "[model_providers.plies]",
                'name = "plies gateway"',
                f"base_url = {json.dumps(spec.base_url + '/v1')}",
                'wire_api = "responses"',
                f'env_key = "{_KEY_VAR}"',
                "",
                "[analytics]",
                "enabled = false",
                "",
                "[features]",
                "plugins = false",
                "remote_plugin = false",
                *(line for n, s in spec.mcp_servers.items() for line in _codex_mcp(n, s)),
                "",
            ]
        )
        argv = [
            _check_command(self.command, self.name),
            "exec",
            "--skip-git-repo-check",
            "--dangerously-bypass-approvals-and-sandbox",
            "--json",
            spec.instruction,
        ]
        env = {"HOME": spec.home, "CODEX_HOME": f"{spec.home}/.codex", _KEY_VAR: spec.api_key}
        return AgentLaunch(argv, env, {".codex/config.toml": config})


@dataclass(frozen=True, slots=True)
class OpenCode:
    """OpenCode (`opencode run`), the gateway as an OpenAI-compatible provider in its config.

    The provider uses the AI SDK's `@ai-sdk/openai-compatible` package, which OpenCode bundles
    (Chat Completions, streamed). Model catalogue fetches, auto-update, LSP downloads, default
    plugins and sharing are switched off; every tool is allowed.

    Args:
        command: the `opencode` executable (npm `.bin/opencode`).
    """

    command: str = "opencode"
    name: ClassVar[str] = "opencode"
    package: ClassVar[str] = "opencode-ai"
    version: ClassVar[str] = "1.18.33"
    wire: Wire = "chat"

    def launch(self, spec: LaunchSpec) -> AgentLaunch:
        _no_mcp(spec, self.name)
        config = {
            "$schema": "https://opencode.ai/config.json",
            "provider": {
                "plies": {
                    "npm": "@ai-sdk/openai-compatible",
                    "name": "plies gateway",
                    "options": {
                        "baseURL": spec.base_url + "/v1",
                        "apiKey": "{env:" + _KEY_VAR + "}",
                    },
                    "models": {spec.model: {"name": spec.model, "tool_call": True}},
                }
            },
            "model": f"plies/{spec.model}",
            "small_model": f"plies/{spec.model}",
            "autoupdate": False,
            "share": "disabled",
            "permission": {"edit": "allow", "bash": "allow", "webfetch": "deny"},
            # Its side calls (a session title, a summary) would be sampled from the policy
            # too; the episode is the agent's own conversation.
            "agent": {"title": {"disable": True}, "summary": {"disable": True}},
        }
        argv = [
            _check_command(self.command, self.name),
            "run",
            "--model",
            f"plies/{spec.model}",
            spec.instruction,
        ]
        env = {
            "HOME": spec.home,
            "XDG_CONFIG_HOME": f"{spec.home}/.config",
            "XDG_DATA_HOME": f"{spec.home}/.local/share",
            "XDG_CACHE_HOME": f"{spec.home}/.cache",
            "XDG_STATE_HOME": f"{spec.home}/.local/state",
            _KEY_VAR: spec.api_key,
            "OPENCODE_DISABLE_AUTOUPDATE": "1",
            "OPENCODE_DISABLE_MODELS_FETCH": "1",
            "OPENCODE_DISABLE_LSP_DOWNLOAD": "1",
            "OPENCODE_DISABLE_DEFAULT_PLUGINS": "1",
            "OPENCODE_DISABLE_SHARE": "1",
            "OPENCODE_DISABLE_CLAUDE_CODE": "1",
            # It looks for project configs in every directory above the workspace too.
            "OPENCODE_DISABLE_PROJECT_CONFIG": "1",
        }
        return AgentLaunch(argv, env, {".config/opencode/opencode.json": json.dumps(config)})


@dataclass(frozen=True, slots=True)
class Pi:
    """The pi coding agent in print mode (`pi -p`), the gateway as a custom provider.

    The provider is declared in `~/.pi/agent/models.json` with the `openai-completions` API
    (Chat Completions, streamed).

    Args:
        command: the `pi` executable (npm `.bin/pi`).
    """

    command: str = "pi"
    name: ClassVar[str] = "pi"
    package: ClassVar[str] = "@mariozechner/pi-coding-agent"
    version: ClassVar[str] = "0.73.1"
    wire: Wire = "chat"

    def launch(self, spec: LaunchSpec) -> AgentLaunch:
        _no_mcp(spec, self.name)
        models = {
            "providers": {
                "plies": {
                    "baseUrl": spec.base_url + "/v1",
                    "api": "openai-completions",
                    "apiKey": _KEY_VAR,
                    # The gateway speaks plain chat: the system prompt as `system`, no
                    # reasoning effort, no `store`.
                    "compat": {
                        "supportsDeveloperRole": False,
                        "supportsReasoningEffort": False,
                        "supportsStore": False,
                    },
                    "models": [
                        {
                            "id": spec.model,
                            "name": spec.model,
                            "reasoning": False,
                            "input": ["text"],
                            "contextWindow": 65536,
                            "maxTokens": 4096,
                            "cost": {"input": 0, "output": 0, "cacheRead": 0, "cacheWrite": 0},
                        }
                    ],
                }
            }
        }
        argv = [
            _check_command(self.command, self.name),
            "-p",
            "--no-session",
            "--provider",
            "plies",
            "--model",
            spec.model,
            spec.instruction,
        ]
        env = {"HOME": spec.home, _KEY_VAR: spec.api_key, "PI_OFFLINE": "1"}
        return AgentLaunch(argv, env, {".pi/agent/models.json": json.dumps(models)})


@dataclass(frozen=True, slots=True)
class MiniSweAgent:
    """mini-swe-agent (`mini`) in yolo mode, through litellm's OpenAI client.

    `MSWEA_CONFIGURED=true` and its own config directory skip the setup wizard; cost tracking
    is off (the gateway's model has no price). It ends only when the model runs `echo
    COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT`, or at `max_turns`.

    Args:
        command: the `mini` executable (in the agents' own virtual environment).
        config: more `-c KEY=VALUE` settings, e.g. `("environment.timeout=120",)` (its shell
            commands time out after 30 s by default).
    """

    command: str = "mini"
    config: tuple[str, ...] = ()
    name: ClassVar[str] = "mini-swe-agent"
    package: ClassVar[str] = "mini-swe-agent"
    version: ClassVar[str] = "2.4.6"
    wire: Wire = "chat"

    def launch(self, spec: LaunchSpec) -> AgentLaunch:
        _no_mcp(spec, self.name)
        argv = [
            _check_command(self.command, self.name),
            "--yolo",
            "--exit-immediately",
            "--cost-limit",
            "0",
            "--model",
            f"openai/{spec.model}",
            "--task",
            spec.instruction,
            "--output",
            f"{spec.home}/trajectory.json",
            "-c",
            "mini.yaml",
            "-c",
            f"agent.step_limit={spec.max_turns}",
            "-c",
            f"model.model_kwargs.api_base={spec.base_url}/v1",
            "-c",
            f"model.model_kwargs.api_key={spec.api_key}",
        ]
        for setting in self.config:
            argv += ["-c", setting]
        env = {
            "HOME": spec.home,
            "MSWEA_CONFIGURED": "true",
            "MSWEA_GLOBAL_CONFIG_DIR": f"{spec.home}/.mswea",
            "MSWEA_COST_TRACKING": "ignore_errors",
            "LITELLM_LOCAL_MODEL_COST_MAP": "True",
        }
        return AgentLaunch(argv, env)


@dataclass(frozen=True, slots=True)
class AgentsSdk:
    """A small agent written on the OpenAI Agents SDK: two tools (write a file, run a command).

    The script ships with plies (`plies.harness`) and runs with `python`, an interpreter that
    has `openai-agents` installed. `wire="chat"` uses `OpenAIChatCompletionsModel`;
    `"responses"` the SDK's default Responses model. Tracing is off.

    Args:
        python: the interpreter with `openai-agents` (the agents' own virtual environment).
        wire: "chat" or "responses".
    """

    python: str = "python3"
    wire: Wire = "chat"
    name: ClassVar[str] = "openai-agents"
    package: ClassVar[str] = "openai-agents"
    version: ClassVar[str] = "0.24.0"

    def __post_init__(self) -> None:
        if self.wire not in ("chat", "responses"):
            raise ConfigError(f"the Agents SDK speaks 'chat' or 'responses', not {self.wire!r}")

    def launch(self, spec: LaunchSpec) -> AgentLaunch:
        _no_mcp(spec, self.name)
        script = resources.files("plies.harness").joinpath("_agents_sdk_script.py").read_text()
        argv = [
            _check_command(self.python, self.name),
            f"{spec.home}/agent.py",
            "--wire",
            self.wire,
            "--model",
            spec.model,
            "--max-turns",
            str(spec.max_turns),
            spec.instruction,
        ]
        env = {
            "HOME": spec.home,
            "OPENAI_BASE_URL": spec.base_url + "/v1",
            "OPENAI_API_KEY": spec.api_key,
            "OPENAI_AGENTS_DISABLE_TRACING": "1",
        }
        return AgentLaunch(argv, env, {"agent.py": script})
