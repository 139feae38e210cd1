"""Dockerfiles read into a plan a local sandbox can build, or refused in one line.

`plan_dockerfile(path)` reads a Dockerfile (continuation lines, comments, shell and exec
forms) into a `DockerfilePlan`: the base image's name, the workspace (`WORKDIR`), the `ENV`s,
and the steps to build it, in order: `CopyStep`s (local `COPY`/`ADD` into the workspace) and
`RunStep`s (each with the environment set before it). The host's system stands in for the
base image, so `FROM` is read, not pulled.

Honoured: `FROM`, `WORKDIR`, `ENV`, `ARG` defaults, `COPY`/`ADD` of the build context into the
workspace (`--chown`/`--chmod` accepted: commands run as the caller), `RUN`, `USER root`.
Ignored, since they change nothing an episode sees: `CMD`, `ENTRYPOINT`, `EXPOSE`, `LABEL`,
`MAINTAINER`, `HEALTHCHECK`, `STOPSIGNAL`. Refused, in one line naming the file, the line and
the instruction: a second stage, URLs, archives to extract, sources outside the build context,
destinations outside the workspace, other users, `RUN --mount` and the like, `RUN`s that need
the network (package managers, downloads), and every other instruction.
"""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from plies import ConfigError

__all__ = ["CopyStep", "DockerfilePlan", "RunStep", "plan_dockerfile"]

_IGNORED = {"CMD", "ENTRYPOINT", "EXPOSE", "LABEL", "MAINTAINER", "HEALTHCHECK", "STOPSIGNAL"}
_NETWORK_WORDS = re.compile(
    r"\b(apt-get|apt|apk|yum|dnf|curl|wget)\b"
    r"|\b(pip3?|uv pip|uv|npm|pnpm|yarn|poetry) (install|add|ci|sync)\b|\bgit clone\b"
)
_VAR = re.compile(r"\$(\w+)|\$\{(\w+)\}")


@dataclass(frozen=True, slots=True)
class CopyStep:
    """`COPY`/`ADD` of a file or directory of the build context into the workspace."""

    source: Path
    dest: str
    """Relative to the workspace."""


@dataclass(frozen=True, slots=True)
class RunStep:
    """A `RUN`, with the environment the Dockerfile had set by then."""

    line: int
    command: str
    env: dict[str, str]


@dataclass(frozen=True, slots=True)
class DockerfilePlan:
    """What building a Dockerfile's workspace in the sandbox takes, in order.

    Attributes:
        base: the `FROM` image (read, not pulled: the host's system stands in for it).
        workdir: the workspace's absolute path inside the sandbox.
        env: variables from `ENV` (and `[environment].env`), seen by the agent and the tests.
        steps: the copies and runs, in Dockerfile order.
    """

    base: str
    workdir: str
    env: dict[str, str]
    steps: list[CopyStep | RunStep] = field(default_factory=list)


def plan_dockerfile(path: Path, *, workdir: str | None = None) -> DockerfilePlan:
    """Read a Dockerfile into a `DockerfilePlan`, or refuse it in one line.

    Args:
        path: the Dockerfile; its directory is the build context.
        workdir: `[environment].workdir`, which overrides the Dockerfile's `WORKDIR`.

    Raises:
        ConfigError: "<path>:<line>: <INSTRUCTION> ...: why", for the first instruction the
            sandbox cannot honour.
    """
    context = path.parent.resolve()
    base: str | None = None
    current = "/"
    args: dict[str, str] = {}
    env: dict[str, str] = {}
    raw: list[tuple[int, str, str]] = []
    for number, line in _logical_lines(path):
        keyword, _, rest = line.partition(" ")
        raw.append((number, keyword.upper(), rest.strip()))

    def refuse(number: int, text: str, why: str) -> ConfigError:
        shown = text if len(text) <= 60 else text[:57] + "..."
        return ConfigError(f"{path}:{number}: {shown}: {why}")

    copies_and_runs: list[tuple[Path, str] | RunStep] = []
    for number, keyword, rest in raw:
        text = f"{keyword} {rest}".strip()
        if keyword == "FROM":
            if base is not None:
                raise refuse(number, text, "multi-stage builds cannot be honoured")
            words = rest.split()
            flags = [w for w in words if w.startswith("--")]
            if flags:
                raise refuse(number, text, f"{flags[0]} cannot be honoured")
            base = _expand(words[0], args) if words else ""
        elif keyword == "ARG":
            name, _, default = rest.partition("=")
            args[name.strip()] = default.strip().strip('"')
        elif keyword == "ENV":
            env.update(_env_pairs(rest, {**args, **env}))
        elif keyword == "WORKDIR":
            target = PurePosixPath(current) / _expand(rest.strip('"'), {**args, **env})
            if copies_and_runs and str(target) != current:
                raise refuse(number, text, "a second WORKDIR after COPY or RUN is not honoured")
            current = str(target)
        elif keyword in ("COPY", "ADD"):
            copies_and_runs.extend(_copies(number, keyword, rest, context, current, refuse, text))
        elif keyword == "RUN":
            if rest.startswith("--"):
                raise refuse(number, text, f"{rest.split()[0]} cannot be honoured")
            command = _exec_form(rest) or rest
            needs = _NETWORK_WORDS.search(command)
            if needs:
                raise refuse(number, text, f"needs the network ({needs[0]}); the sandbox has none")
            copies_and_runs.append(RunStep(number, command, dict(env)))
        elif keyword == "USER":
            if rest.split(":")[0] not in ("root", "0"):
                raise refuse(number, text, "only root is honoured (commands run as the caller)")
        elif keyword in _IGNORED:
            continue
        else:
            raise refuse(number, text, f"{keyword} cannot be honoured")
    if base is None:
        raise ConfigError(f"{path}: no FROM instruction")
    final = workdir or current
    if final == "/":
        raise ConfigError(f"{path}: no WORKDIR: the workspace needs a directory of its own")
    steps: list[CopyStep | RunStep] = []
    for step in copies_and_runs:
        if isinstance(step, RunStep):
            steps.append(step)
            continue
        source, dest = step
        try:
            relative = PurePosixPath(dest).relative_to(final)
        except ValueError:
            raise ConfigError(
                f"{path}: COPY to {dest} is outside the workspace {final}; only the "
                "workspace is honoured"
            ) from None
        steps.append(CopyStep(source, str(relative)))
    return DockerfilePlan(base=base, workdir=final, env=env, steps=steps)


def _logical_lines(path: Path) -> list[tuple[int, str]]:
    try:
        lines = path.read_text().splitlines()
    except OSError as err:
        raise ConfigError(f"cannot read {path}: {err}") from err
    out: list[tuple[int, str]] = []
    pending: list[str] = []
    start = 0
    for number, line in enumerate(lines, start=1):
        stripped = line.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if pending and stripped.startswith("#"):
            continue
        if not pending:
            start = number
        if stripped.endswith("\\"):
            pending.append(stripped[:-1].strip())
            continue
        pending.append(stripped)
        out.append((start, " ".join(p for p in pending if p)))
        pending = []
    if pending:
        out.append((start, " ".join(pending)))
    return out


def _expand(text: str, values: dict[str, str]) -> str:
    return _VAR.sub(lambda m: values.get(m[1] or m[2], ""), text)


def _env_pairs(rest: str, values: dict[str, str]) -> dict[str, str]:
    words = shlex.split(rest)
    if words and "=" not in words[0]:  # legacy `ENV KEY value words`
        return {words[0]: _expand(" ".join(words[1:]), values)}
    pairs = {}
    for word in words:
        key, _, value = word.partition("=")
        pairs[key] = _expand(value, {**values, **pairs})
    return pairs


def _exec_form(rest: str) -> str | None:
    if not rest.startswith("["):
        return None
    try:
        argv = json.loads(rest)
    except ValueError:
        return None
    return shlex.join(str(a) for a in argv) if isinstance(argv, list) else None


def _copies(
    number: int,
    keyword: str,
    rest: str,
    context: Path,
    current: str,
    refuse: Callable[[int, str, str], ConfigError],
    text: str,
) -> list[tuple[Path, str]]:
    words = _exec_form(rest)
    parts = shlex.split(words if words is not None else rest)
    flags = [p for p in parts if p.startswith("--")]
    for flag in flags:
        if not flag.startswith(("--chown", "--chmod")):  # ownership is the caller's anyway
            raise refuse(number, text, f"{flag.split('=')[0]} cannot be honoured")
    parts = [p for p in parts if not p.startswith("--")]
    if len(parts) < 2:
        raise refuse(number, text, f"{keyword} needs a source and a destination")
    *sources, dest = parts
    target = PurePosixPath(current) / dest
    out = []
    for source in sources:
        if "://" in source:
            raise refuse(number, text, "a URL source needs the network; the sandbox has none")
        if keyword == "ADD" and re.search(r"\.(tar|tgz|tar\.\w+)$", source):
            raise refuse(number, text, "ADD's archive extraction is not honoured; use RUN tar")
        matches = sorted(context.glob(source)) if any(c in source for c in "*?[") else []
        paths = matches or [context / source]
        for p in paths:
            resolved = p.resolve()
            if not resolved.is_relative_to(context) or not resolved.exists():
                raise refuse(number, text, f"{source} is not in the build context {context}")
            into_dir = dest.endswith("/") or len(paths) > 1 or len(sources) > 1
            name = target / p.name if into_dir and not resolved.is_dir() else target
            out.append((resolved, str(name)))
    return out
