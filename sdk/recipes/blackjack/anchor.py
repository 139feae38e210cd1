"""The format anchor: the warm start's loss on the tool call's fixed tokens, kept during GRPO.

A call is `<tool_call>`, a JSON object naming `hit` or `stand`, `</tool_call>` and the end
token: about fifteen tokens, only one of which (the tool's name) is a decision. Sampled at
temperature 1, each fixed token leaks a little probability to the rest of a 151,936-token
vocabulary, and a leaked token ends the hand as a forfeit. GRPO alone does not stop the
leak: a sampled wrong token that a negative advantage pushes down hands its probability back
mostly to the right token, but the thousands of other wrong tokens keep theirs, while every
well-formed call's fixed tokens take their member's advantage up or down with the decision.
Cross-entropy on the right token pulls probability from all of them at once. So each step
also takes the warm start's loss on the fixed tokens of every call it trained on, written
canonically; the decision token is left out, so what to play stays GRPO's to learn.

The anchor is built from the step's own groups, so it costs no data of its own, sits on the
prompts the policy meets, and a replayed step (`plies replay --train-only`) rebuilds it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from plies import Group, Trajectory, Turn
from plies.training import Datum, TrainingBatch

__all__ = ["anchor_batch"]


def anchor_batch(groups: Sequence[Group], calls: Mapping[str, Sequence[int]]) -> TrainingBatch:
    """One cross-entropy datum per segment of every member of `groups`, each call canonical.

    `calls` maps `hit` and `stand` to their canonical ids (`tool_call_ids`). A turn's call
    is replaced by the canonical call it named; an ill-formed or cut-off call by the one its
    decision token chose, else `stand` (the decision is not trained here, and the tokens
    after it are the same for both names but the name's own). Every token of each call is
    in the loss but the decision.
    """
    hit, stand = list(calls["hit"]), list(calls["stand"])
    decision = next(i for i, (a, b) in enumerate(zip(hit, stand, strict=False)) if a != b)
    data: list[Datum] = []
    for group in groups:
        for trajectory in group.trajectories:
            data.extend(_anchored(trajectory, hit, stand, decision))
    return TrainingBatch(data=data)


def _anchored(
    trajectory: Trajectory, hit: list[int], stand: list[int], decision: int
) -> list[Datum]:
    out: list[Datum] = []
    tokens: list[int] = []
    mask: list[int] = []
    for turn in trajectory.turns:
        if not turn.extends and tokens:
            out.append(_datum(tokens, mask))
            tokens, mask = [], []
        call = hit if _named(turn, hit[decision], decision) == "hit" else stand
        tokens += turn.prompt_ids
        mask += [0] * len(turn.prompt_ids)
        tokens += call
        mask += [int(i != decision) for i in range(len(call))]
    if tokens:
        out.append(_datum(tokens, mask))
    return out


def _named(turn: Turn, hit_token: int, decision: int) -> str:
    """The tool a turn called: its parsed message's, else its sampled decision token's."""
    calls = (turn.message or {}).get("tool_calls") or []
    if len(calls) == 1 and calls[0]["function"]["name"] in ("hit", "stand"):
        return str(calls[0]["function"]["name"])
    ids = turn.completion_ids
    return "hit" if len(ids) > decision and ids[decision] == hit_token else "stand"


def _datum(tokens: list[int], mask: list[int]) -> Datum:
    n = len(tokens)
    return Datum(tokens=tokens, mask=mask, logprobs=[0.0] * n, advantages=[0.0] * n)
