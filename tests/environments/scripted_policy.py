"""A scripted policy: answers each turn with tool calls in Qwen3's own format.

The script sees the episode (the sampler's session, the trajectory id), the turn number and
the prompt decoded to text (tool results included), and returns the calls to make. The ids
come from the real tokenizer, so the harness's renderer and parser under it stay real.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from plies import PolicyRef
from plies.policy import Completion, SamplingParams

POLICY = PolicyRef(uri="plies://scripted/policies/0", version=0)

Call = tuple[str, dict[str, Any]]
Script = Callable[[str, int, str], Awaitable[Sequence[Call]]]


def tool_calls_text(calls: Sequence[Call]) -> str:
    blocks = [
        f"<tool_call>\n{json.dumps({'name': name, 'arguments': args})}\n</tool_call>"
        for name, args in calls
    ]
    return "\n".join(blocks) + "<|im_end|>"


class ScriptedPolicy:
    """A `PolicyClient` whose completions are the script's tool calls."""

    def __init__(self, tokenizer: Any, script: Script):
        self.tokenizer = tokenizer
        self.script = script
        self.turns: dict[str, int] = defaultdict(int)

    async def sample(
        self, prompt_ids: Sequence[int], params: SamplingParams, *, policy=None, session=None
    ) -> Completion:
        key = str(session)
        turn = self.turns[key]
        self.turns[key] += 1
        prompt = self.tokenizer.decode(list(prompt_ids))
        calls = await self.script(key, turn, prompt)
        ids = self.tokenizer.encode(tool_calls_text(calls), add_special_tokens=False)
        return Completion(ids=ids, logprobs=[-0.5] * len(ids), finish_reason="stop", policy=POLICY)

    async def aclose(self) -> None:
        return None
