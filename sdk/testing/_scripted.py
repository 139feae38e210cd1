"""`ScriptedPolicy`: a policy client that answers each turn from a script, in the model's own words.

A tiny random model never writes a tool call, so a test that needs an agent to finish a task
scripts the answers instead. The script is a list of assistant messages; each one is rendered
by the tokenizer's own chat template (tool calls in the model's own format) and encoded by the
real tokenizer, so what the gateway gets back is token ids, as from an engine, and its
renderer and parser stay real. Every session (the `session` argument the gateway passes)
walks the script from its start, so concurrent episodes each get the whole script.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import anyio

from plies import ConfigError, PolicyError, PolicyRef
from plies.policy import Completion, SamplingParams

__all__ = ["SCRIPTED_POLICY", "ScriptStep", "ScriptedPolicy", "render_completion"]

SCRIPTED_POLICY = PolicyRef(uri="file:///plies-scripted-policy", version=0)
"""The `PolicyRef` a `ScriptedPolicy` reports unless given another."""

ScriptAnswer = str | dict[str, Any]
"""A scripted answer: plain text, or `{"content": ..., "tool_calls": [{"name", "arguments"}]}`
(arguments a dict or JSON text)."""
ScriptStep = ScriptAnswer | Callable[[str], ScriptAnswer]
"""One step of a script: an answer, or a function of the prompt's text that returns one (for
answers that depend on what the agent said, such as an absolute path in its system prompt)."""

_SCRIPTED_LOGPROB = -0.1
"""The logprob reported for each scripted token: finite and the same for all, since no model
sampled them."""
STREAM_RUN = 4
"""Ids per run a streamed scripted answer is told in."""


def render_completion(tokenizer: Any, step: ScriptAnswer) -> list[int]:
    """The token ids a model would sample to answer `step`, its stop token included.

    The tokenizer's chat template renders a conversation with the answer in its history and
    one ending at the generation prompt; the answer is the text between them, up to and
    including the end-of-turn token, so tool calls come out in whatever format the template
    writes, and exactly as the template keeps them in history (Qwen3's adds an empty think
    block only to a last assistant turn), so the next prompt extends them token for token.

    Raises:
        ConfigError: the step is malformed, or the template does not render it as a
            continuation of the generation prompt.
    """
    message = _assistant_message(step)
    opening = [{"role": "user", "content": "."}]
    prompt = tokenizer.apply_chat_template(opening, tokenize=False, add_generation_prompt=True)
    full = tokenizer.apply_chat_template([*opening, message, *opening], tokenize=False)
    eos = tokenizer.eos_token
    if not full.startswith(prompt) or eos is None or eos not in full[len(prompt) :]:
        raise ConfigError(
            "the chat template does not render an assistant answer after its generation "
            f"prompt, so {step!r} cannot be scripted with this tokenizer"
        )
    answer = full[len(prompt) :]
    answer = answer[: answer.index(eos) + len(eos)]
    return list(tokenizer.encode(answer, add_special_tokens=False))


def _assistant_message(step: ScriptAnswer) -> dict[str, Any]:
    if isinstance(step, str):
        return {"role": "assistant", "content": step}
    if not isinstance(step, dict) or not set(step) <= {"content", "tool_calls"}:
        raise ConfigError(f"a script step is text or {{'content', 'tool_calls'}}, got {step!r}")
    calls = []
    for call in step.get("tool_calls") or ():
        if not isinstance(call, dict) or "name" not in call:
            raise ConfigError(f"a scripted tool call needs a name, got {call!r}")
        arguments = call.get("arguments", {})
        if isinstance(arguments, str):
            arguments = json.loads(arguments)
        calls.append(
            {"type": "function", "function": {"name": call["name"], "arguments": arguments}}
        )
    message: dict[str, Any] = {"role": "assistant", "content": step.get("content") or ""}
    if calls:
        message["tool_calls"] = calls
    return message


@dataclass
class ScriptedPolicy:
    """A policy client (`plies.policy.StreamingPolicyClient`) whose every answer comes from a
    script; streamed, an answer's ids are told `STREAM_RUN` at a time, as an engine steps.

    Args:
        tokenizer: the served model's tokenizer (its chat template writes the tool calls).
        script: the answers, in order; each session starts again at the first.
        policy: the `PolicyRef` every completion reports.

    Attributes:
        prompts: every prompt asked, in order, with the session that asked it.
        completions: every completion given, in order.

    Raises (from `sample`):
        PolicyError: a session asked for more turns than the script has.

    Example::

        policy = ScriptedPolicy(tokenizer, [
            {"tool_calls": [{"name": "bash", "arguments": {"command": "ls"}}]},
            "All done.",
        ])
        async with Gateway(policy, ChatRenderer(tokenizer)) as gateway: ...
    """

    tokenizer: Any
    script: Sequence[ScriptStep]
    policy: PolicyRef = SCRIPTED_POLICY
    prompts: list[tuple[str | None, list[int]]] = field(default_factory=list)
    completions: list[Completion] = field(default_factory=list)
    _answers: list[list[int] | None] = field(init=False, repr=False)
    _cursor: dict[str | None, int] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        # Fixed answers are rendered once, up front, so a malformed script fails here.
        self._answers = [
            None if callable(step) else render_completion(self.tokenizer, step)
            for step in self.script
        ]

    def turns(self, session: str | None) -> int:
        """How many answers `session` has been given."""
        return self._cursor.get(session, 0)

    async def sample(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        *,
        policy: PolicyRef | str | None = None,
        session: str | None = None,
    ) -> Completion:
        """The session's next scripted answer, cut at `params.max_tokens` like a sampler."""
        k = self._cursor.get(session, 0)
        if k >= len(self._answers):
            raise PolicyError(
                f"the script has {len(self._answers)} answers and session {session!r} asked "
                "for another"
            )
        self._cursor[session] = k + 1
        self.prompts.append((session, list(prompt_ids)))
        ids = self._answers[k]
        if ids is None:
            step = self.script[k]
            assert callable(step)
            ids = render_completion(self.tokenizer, step(self.tokenizer.decode(prompt_ids)))
        finish = "stop"
        if len(ids) > params.max_tokens:
            ids, finish = ids[: params.max_tokens], "length"
        completion = Completion(
            ids=list(ids),
            logprobs=[_SCRIPTED_LOGPROB] * len(ids),
            finish_reason=finish,
            policy=self.policy,
        )
        self.completions.append(completion)
        return completion

    async def sample_streaming(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        on_tokens: Callable[[Sequence[int]], Awaitable[None]],
        *,
        policy: PolicyRef | str | None = None,
        session: str | None = None,
    ) -> Completion:
        """`sample`, its ids told to `on_tokens` a few at a time, yielding between runs."""
        completion = await self.sample(prompt_ids, params, policy=policy, session=session)
        for i in range(0, len(completion.ids), STREAM_RUN):
            await on_tokens(completion.ids[i : i + STREAM_RUN])
            await anyio.sleep(0)
        return completion
