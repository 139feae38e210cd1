"""A verifiers environment built from verifiers' own classes, for tests/harness/test_verifiers.py.

A `vf.ToolEnv` with one tool (`add`), a `vf.Rubric` that pays 1.0 when the last answer holds the
expected sum, and an in-memory dataset. It runs in the verifiers sidecar's interpreter only.
With `cleanup_log`, each rollout's cleanup (a `@vf.cleanup` handler) appends its id there;
with `tool_delay_s`, the tool takes that long (for cancelling a rollout midway); with
`rewrite_history`, every prompt after the first replaces the user's question by a summary.
"""

from __future__ import annotations

import asyncio

import verifiers as vf
from datasets import Dataset

QUESTIONS = [(2, 3), (7, 4), (10, 15)]


def correct(completion, answer: str) -> float:
    """1.0 when the final assistant message states the expected sum."""
    last = completion[-1]
    text = last.content if isinstance(last.content, str) else ""
    return 1.0 if last.role == "assistant" and answer in text.split() else 0.0


SUMMARY = "Summary: you asked the add tool; now say the sum."


class AdderEnv(vf.ToolEnv):
    def __init__(self, cleanup_log: str | None, rewrite_history: bool, **kwargs):
        super().__init__(**kwargs)
        self.cleanup_log = cleanup_log
        self.rewrite_history = rewrite_history

    async def get_prompt_messages(self, state: vf.State) -> vf.Messages:
        messages = await super().get_prompt_messages(state)
        if self.rewrite_history and state["trajectory"]:
            # An env that compacts its history: the user's question becomes a summary.
            messages = [*messages]
            messages[1] = vf.UserMessage(content=SUMMARY)
        return messages

    @vf.cleanup
    async def log_cleanup(self, state: vf.State) -> None:
        if self.cleanup_log is not None:
            with open(self.cleanup_log, "a") as f:
                f.write(f"{state['trajectory_id']}\n")


def load_environment(
    max_turns: int = 4,
    cleanup_log: str | None = None,
    tool_delay_s: float = 0.0,
    rewrite_history: bool = False,
) -> vf.Environment:
    async def add(a: int, b: int) -> int:
        """Add two integers.

        Args:
            a: the first integer.
            b: the second integer.
        """
        await asyncio.sleep(tool_delay_s)
        return a + b

    rows = [
        {
            "question": f"What is {a} + {b}? Use the add tool, then say the sum.",
            "answer": str(a + b),
        }
        for a, b in QUESTIONS
    ]
    return AdderEnv(
        cleanup_log,
        rewrite_history,
        dataset=Dataset.from_list(rows),
        tools=[add],
        rubric=vf.Rubric(funcs=[correct]),
        max_turns=max_turns,
        system_prompt="You are a careful calculator.",
    )
