"""The counting episode both sampler tiers play (the reference server in tests/policy, vLLM in
tests/engine): sampled turn by turn through a policy client, recorded as a trajectory, and
checked against what was sent, what was sampled, and a plain forward pass."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from plies import Trajectory, Turn
from plies.policy import Completion, PolicyClient, SamplingParams
from plies.tokens import ChatRenderer, Conversation

ChooseParams = Callable[[int, list[int]], Awaitable[SamplingParams]]
"""`params(turn, prompt)`: the sampling parameters of one turn."""


@dataclass
class CountingEpisode:
    conv: Conversation
    trajectory: Trajectory = field(default_factory=lambda: Trajectory(task_id="count"))
    sent: list[list[int]] = field(default_factory=list)
    """Each turn's prompt, as sent."""
    answers: list[Completion] = field(default_factory=list)


async def play_counting(
    client: PolicyClient, tokenizer: Any, turns: int, params: ChooseParams
) -> CountingEpisode:
    """Count with the model: after each answer the user says the next number."""
    conv = ChatRenderer(tokenizer).start([{"role": "user", "content": "Let us count: 1"}])
    episode = CountingEpisode(conv)
    for turn in range(turns):
        prompt = list(await conv.arender())  # the conversation extends its own list
        delta = conv.delta
        chosen = await params(turn, prompt)
        answer = await client.sample(prompt, chosen, session=episode.trajectory.id)
        episode.sent.append(prompt)
        episode.answers.append(answer)
        episode.trajectory.turns.append(Turn.from_completion(delta, answer))
        conv.add_completion(answer.ids, answer.finish_reason)
        conv.add_messages([{"role": "user", "content": str(turn + 2)}])
    return episode


def check_recorded(
    episode: CountingEpisode,
    model_dir: Path,
    forward_logprobs: Callable[..., list[float]],
    temperatures: Sequence[float],
) -> Trajectory:
    """Check the trajectory, through JSON, against the episode; return it as restored.

    Every prompt and sample is recorded exactly, and each logprob matches a forward pass at
    its turn's temperature. A turn extends the previous one unless the renderer fell back
    (and said why); each fallback starts a new training segment. Either way every sampled
    number is kept.
    """
    restored = Trajectory.model_validate_json(episode.trajectory.model_dump_json())
    for k, (prompt, answer) in enumerate(zip(episode.sent, episode.answers, strict=True)):
        assert restored.prompt_ids(k) == prompt
        assert restored.turns[k].completion_ids == answer.ids
        assert restored.turns[k].logprobs == answer.logprobs
        expected = forward_logprobs(model_dir, prompt, answer.ids, temperatures[k])
        assert max(abs(a - b) for a, b in zip(answer.logprobs, expected, strict=True)) < 1e-4
    fell_back = {f.turn for f in episode.conv.fallbacks}
    turns = range(len(restored.turns))
    assert [t.extends for t in restored.turns] == [k > 0 and k not in fell_back for k in turns]
    segments = restored.segments()
    assert len(segments) == 1 + len(fell_back)
    sampled = [lp for s in segments for lp, m in zip(s.logprobs, s.mask, strict=True) if m]
    assert sampled == [lp for a in episode.answers for lp in a.logprobs]
    return restored
