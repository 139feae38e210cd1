"""`state_contrast`: the decision tokens' shared share of the update is removed, nothing else."""

from __future__ import annotations

import math

import pytest

from plies.recipes.blackjack.contrast import decision_tokens, state_contrast
from plies.recipes.blackjack.warm_start import tool_call_ids
from plies.training import Datum, TrainingBatch


def call(tokenizer, name: str, p: float, advantage: float) -> Datum:
    """A prompt token, then a sampled call of `name` whose decision token had probability p."""
    ids = tool_call_ids(tokenizer, name)
    _, hit, stand = decision_tokens(tokenizer)
    logprobs = [0.0] + [math.log(p) if t in (hit, stand) else -0.01 for t in ids]
    return Datum(
        tokens=[9, *ids],
        mask=[0] + [1] * len(ids),
        logprobs=logprobs,
        advantages=[0.0] + [advantage] * len(ids),
    )


def shared_share(batch: TrainingBatch, tokens) -> float:
    before, hit, stand = tokens
    total = 0.0
    for d in batch.data:
        for pos in range(1, len(d.tokens)):
            if d.mask[pos] and d.tokens[pos] in (hit, stand) and d.tokens[pos - 1] == before:
                away = 1 - math.exp(d.logprobs[pos])
                total += d.advantages[pos] * (away if d.tokens[pos] == hit else -away)
    return total


def hit_more(tokenizer) -> TrainingBatch:
    """Three decisions that all say "hit more": a low total's hit paid, a high total's stand
    lost, a middling hit paid a little."""
    return TrainingBatch(
        data=[
            call(tokenizer, "hit", 0.3, 1.0),
            call(tokenizer, "stand", 0.6, -0.5),
            call(tokenizer, "hit", 0.5, 0.2),
        ]
    )


def test_the_decision_tokens_are_where_hit_and_stand_calls_differ(qwen3_tokenizer):
    before, hit, stand = decision_tokens(qwen3_tokenizer)
    assert qwen3_tokenizer.decode([hit]) == "hit" and qwen3_tokenizer.decode([stand]) == "stand"
    assert qwen3_tokenizer.decode([before]).endswith('"')


def test_only_the_shared_share_goes(qwen3_tokenizer):
    tokens = decision_tokens(qwen3_tokenizer)
    batch = hit_more(qwen3_tokenizer)
    assert shared_share(batch, tokens) > 0.5
    out = state_contrast(batch, tokens)
    assert shared_share(out, tokens) == pytest.approx(0.0, abs=1e-12)
    for old, new in zip(batch.data, out.data, strict=True):
        pairs = zip(old.advantages, new.advantages, strict=True)
        changed = [k for k, (a, b) in enumerate(pairs) if a != b]
        assert len(changed) == 1 and new.tokens[changed[0]] in tokens[1:]  # the decision only
        assert (new.tokens, new.mask, new.logprobs) == (old.tokens, old.mask, old.logprobs)
    # The strongest evidence for hitting keeps a positive credit; the weakest turns negative.
    first, last = (d.advantages[d.tokens.index(tokens[1])] for d in (out.data[0], out.data[2]))
    assert first > 0 > last


def test_a_batch_without_decisions_is_unchanged(qwen3_tokenizer):
    tokens = decision_tokens(qwen3_tokenizer)
    datum = Datum(
        tokens=[9, tokens[1], 5], mask=[0, 1, 1], logprobs=[0, -1, -1], advantages=[0, 1.0, 1.0]
    )  # fmt: skip  a hit token not after the name's quote
    batch = TrainingBatch(data=[datum])
    assert state_contrast(batch, tokens) is batch
