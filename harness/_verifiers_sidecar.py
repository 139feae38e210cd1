"""The verifiers side of `VerifiersHarness`: runs a verifiers environment's rollouts on request.

This file is run as a script by the interpreter of the environment that has `verifiers`
installed (`VerifiersHarness(python=...)`); it imports verifiers and the standard library
only, never plies, so the two packages' dependencies never have to resolve together.

    python _verifiers_sidecar.py ENV [ENV_ARGS_JSON]

ENV is a `.py` file or an installed module that defines `load_environment(**kwargs)`
returning a `vf.Environment` (the form of the Environments Hub). The wire is JSON, one
object a line, on stdin (requests) and stdout (answers); logs go to stderr:

- sidecar -> plies, first: `{"type": "ready", "verifiers", "environment", "group_rewards"}`;
- `{"type": "dataset", "id", "split", "n", "seed"}` -> `{"type": "dataset", "id", "rows"}`;
- `{"type": "rollout", "id", "input", "base_url", "api_key", "model", "sampling_args"}` ->
  `{"type": "result", "id", "reward", "metrics", "is_truncated", "stop_condition", "error",
  "messages", "tools"}`, after verifiers' own rollout, rubric scoring and cleanup;
- `{"type": "cancel", "id"}` -> `{"type": "cancelled", "id"}` once the rollout's task has
  been cancelled and verifiers' cleanup handlers have run;
- end of stdin: every rollout is cancelled as above and the process exits.

Each rollout samples through verifiers' own `OpenAIChatCompletionsClient`, pointed at the
episode's plies gateway session, which renders with plies' renderer and records the tokens.
verifiers is asyncio code, so this bridge is too: one asyncio task per rollout.
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import json
import os
import sys
from pathlib import Path
from typing import Any, TextIO

import verifiers as vf
from openai import AsyncOpenAI
from verifiers.clients import OpenAIChatCompletionsClient

_LIMIT = 1 << 24
"""The longest request line read (a rollout input carries its prompt)."""


def load(spec: str, args: dict[str, Any]) -> vf.Environment:
    """The environment `load_environment(**args)` of a file or an installed module returns."""
    path = Path(spec)
    if path.suffix == ".py":
        module_spec = importlib.util.spec_from_file_location(path.stem, path)
        if module_spec is None or module_spec.loader is None:
            raise SystemExit(f"cannot load {spec}")
        module = importlib.util.module_from_spec(module_spec)
        module_spec.loader.exec_module(module)
    else:
        module = importlib.import_module(spec.replace("-", "_"))
    if not hasattr(module, "load_environment"):
        raise SystemExit(f"{spec} defines no load_environment()")
    env = module.load_environment(**args)
    if not isinstance(env, vf.Environment):
        raise SystemExit(
            f"{spec}: load_environment() returned {type(env).__name__}, not a vf.Environment"
        )
    return env


def jsonable(value: Any) -> Any:
    """A JSON form of what verifiers keeps (pydantic messages, numpy numbers, errors)."""
    if hasattr(value, "model_dump"):
        return jsonable(value.model_dump(exclude_none=True))
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    if isinstance(value, str | int | float | bool) or value is None:
        return value
    if hasattr(value, "item"):  # numpy scalars
        return value.item()
    return str(value)


class Sidecar:
    def __init__(self, env: vf.Environment, out: TextIO):
        self.env = env
        self.rollouts: dict[str, asyncio.Task[None]] = {}
        self.out = out

    def send(self, message: dict[str, Any]) -> None:
        self.out.write(json.dumps(message) + "\n")
        self.out.flush()

    async def serve(self) -> None:
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader(limit=_LIMIT)
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
        self.send(
            {
                "type": "ready",
                "verifiers": vf.__version__,
                "environment": type(self.env).__name__,
                "group_rewards": bool(self.env.rubric.has_group_rewards),  # a property
            }
        )
        while line := await reader.readline():
            request = json.loads(line)
            kind = request["type"]
            if kind == "dataset":
                self.send({"type": "dataset", "id": request["id"], "rows": self.rows(request)})
            elif kind == "rollout":
                task = asyncio.create_task(self.rollout(request))
                self.rollouts[request["id"]] = task
            elif kind == "cancel":
                await self.cancel(request["id"])
        for rid in list(self.rollouts):
            await self.cancel(rid)

    def rows(self, request: dict[str, Any]) -> list[dict[str, Any]]:
        split = request.get("split", "train")
        get = self.env.get_eval_dataset if split == "eval" else self.env.get_dataset
        dataset = get(n=request.get("n", -1), seed=request.get("seed"))
        return [jsonable(dict(row)) for row in dataset]

    async def cancel(self, rid: str) -> None:
        task = self.rollouts.pop(rid, None)
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        self.send({"type": "cancelled", "id": rid})

    async def rollout(self, request: dict[str, Any]) -> None:
        rid = request["id"]
        openai = AsyncOpenAI(
            base_url=request["base_url"], api_key=request["api_key"], max_retries=0
        )
        client = OpenAIChatCompletionsClient(openai)
        try:
            state = await self.env.rollout(
                request["input"], client, request["model"], request.get("sampling_args") or {}
            )
            try:
                if self.env.score_rollouts:
                    await self.env.rubric.score_rollout(state)
                else:
                    await self.env.rubric.dummy_score_rollout(state)
            finally:
                await self.env.rubric.cleanup(state)
            prompt, _ = await client.to_native_prompt(
                list(state["prompt"]) + list(state["completion"] or [])
            )
            tools = await client.to_native_tools(state.get("tool_defs") or None)
            error = state.get("error")
            self.send(
                {
                    "type": "result",
                    "id": rid,
                    "reward": jsonable(state.get("reward")),
                    "metrics": jsonable(state.get("metrics") or {}),
                    "is_truncated": bool(state.get("is_truncated")),
                    "stop_condition": state.get("stop_condition"),
                    "error": None if error is None else f"{type(error).__name__}: {_cause(error)}",
                    "messages": jsonable(prompt),
                    "tools": jsonable(tools or []),
                }
            )
        except Exception as err:  # the env's own code failed: the episode fails, not the sidecar
            self.send({"type": "result", "id": rid, "error": f"{type(err).__name__}: {err}"})
        finally:
            self.rollouts.pop(rid, None)
            await openai.close()


def _cause(error: BaseException) -> str:
    """The message of the innermost cause (verifiers wraps client errors in ModelError)."""
    while error.__cause__ is not None:
        error = error.__cause__
    return f"{error}" or type(error).__name__


def main() -> None:
    # The wire keeps the real stdout; anything else written there (an env's print, a C
    # library) goes to stderr, so it can never break a line of the protocol.
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    spec = sys.argv[1]
    args = json.loads(sys.argv[2]) if len(sys.argv) > 2 else {}
    env = load(spec, args)
    asyncio.run(Sidecar(env, out).serve())


if __name__ == "__main__":
    main()
