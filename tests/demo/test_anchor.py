"""`anchor_batch`: each call of a step, canonical, in a cross-entropy datum but its decision."""

from __future__ import annotations

from plies import Group, PolicyRef, Trajectory, Turn
from plies.recipes.blackjack.anchor import anchor_batch
from plies.recipes.blackjack.warm_start import canonical_calls

POLICY = PolicyRef(uri="file:///policies/3", version=3)


def turn(prompt: list[int], completion: list[int], *, extends: bool, name: str | None) -> Turn:
    """A turn as the harness records it; `name` None: its call did not parse."""
    message = None
    if name is not None:
        call = {"type": "function", "function": {"name": name, "arguments": {}}}
        message = {"role": "assistant", "content": "", "tool_calls": [call]}
    return Turn(
        prompt_ids=prompt, extends=extends, completion_ids=completion,
        logprobs=[-0.1] * len(completion), finish_reason="stop", policy=POLICY,
        message=message, ill_formed=name is None,
    )  # fmt: skip


def test_each_call_becomes_canonical_and_only_the_decision_is_left_out(qwen3_tokenizer):
    calls = canonical_calls(qwen3_tokenizer)
    hit, stand = calls["hit"], calls["stand"]
    k = next(i for i, (a, b) in enumerate(zip(hit, stand, strict=False)) if a != b)
    spaced = qwen3_tokenizer.encode('<tool_call>\n{"name":"hit", "arguments": {}}\n</tool_call>')
    leaked = [*stand[: k + 1], 999, 998]  # chose stand, then went wrong after the name
    early = [*hit[: k - 1], 997]  # went wrong before the name
    played = Trajectory(
        task_id="train-0",
        turns=[
            turn([1, 2, 3], spaced, extends=False, name="hit"),  # parsed, not canonical
            turn([4, 5], leaked, extends=True, name=None),
        ],
    )
    restarted = Trajectory(
        task_id="train-0",
        turns=[
            turn([1, 2, 3], hit, extends=False, name="hit"),
            turn([6, 7, 8, 9], early, extends=False, name=None),  # a full re-render
        ],
    )
    group = Group(task_id="train-0", size=2, policy=POLICY, trajectories=[played, restarted])
    batch = anchor_batch([group], calls)

    def fixed(call: list[int]) -> list[int]:
        return [int(i != k) for i in range(len(call))]

    tokens = [(d.tokens, d.mask) for d in batch.data]
    assert tokens == [
        ([1, 2, 3, *hit, 4, 5, *stand], [0, 0, 0, *fixed(hit), 0, 0, *fixed(stand)]),
        ([1, 2, 3, *hit], [0, 0, 0, *fixed(hit)]),
        ([6, 7, 8, 9, *stand], [0, 0, 0, 0, *fixed(stand)]),
    ]
    assert batch.loss_tokens == 4 * (len(hit) - 1)  # hit and stand calls are one length


def test_a_call_cut_off_at_its_name_keeps_the_name_it_sampled(qwen3_tokenizer):
    calls = canonical_calls(qwen3_tokenizer)
    hit, stand = calls["hit"], calls["stand"]
    k = next(i for i, (a, b) in enumerate(zip(hit, stand, strict=False)) if a != b)
    cut = Trajectory(task_id="t", turns=[turn([1, 2], hit[: k + 1], extends=False, name=None)])
    group = Group(task_id="t", size=1, policy=POLICY, trajectories=[cut])
    assert anchor_batch([group], calls).data[0].tokens == [1, 2, *hit]
