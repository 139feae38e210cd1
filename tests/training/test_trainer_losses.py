"""The trainer's losses against a direct torch computation over full logits on the tiny model."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from plies.server import processed_logprobs
from plies.server._losses import batch_loss
from plies.server._sampling import TOP_P_HEAD
from plies.training import Datum, TrainingBatch

TEMPERATURE = 0.7


def load(model_dir):
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
    return tiny_model_dir


def full_logprobs(model, tokens: list[int], temperature: float) -> torch.Tensor:
    """logprob of token i (i >= 1) under the full-vocabulary distribution at position i - 1."""
    logits = model(input_ids=torch.tensor([tokens])).logits[0]
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    return logp[:-1].gather(1, torch.tensor(tokens[1:]).unsqueeze(1)).squeeze(1)


def make_batch(model, *, noise: float, seed: int = 0) -> TrainingBatch:
    """Three sequences of different lengths with two sampled spans each; sampler logprobs are
    the model's own (sampler convention) plus noise, so ratios straddle the clip range."""
    rng = random.Random(seed)
    data = []
    for n in (21, 34, 27):
        tokens = [rng.randrange(151_000) for _ in range(n)]
        mask = [0] * n
        for i in list(range(3, 9)) + list(range(n - 7, n)):
            mask[i] = 1
        with torch.no_grad():
            own = full_logprobs(model, tokens, TEMPERATURE)
        logprobs = [0.0] * n
        advantages = [0.0] * n
        for i in range(1, n):
            if mask[i]:
                logprobs[i] = float(own[i - 1]) + rng.uniform(-noise, noise)
                advantages[i] = rng.choice([-1.5, -0.5, 0.75, 2.0])
        data.append(Datum(tokens=tokens, mask=mask, logprobs=logprobs, advantages=advantages))
    return TrainingBatch(data=data, temperature=TEMPERATURE)


def direct_loss(model, batch: TrainingBatch, loss: str, clip_low: float, clip_high: float):
    """The textbook losses, written out over full logits, one sequence at a time."""
    terms = []
    for d in batch.data:
        lp_all = full_logprobs(model, d.tokens, batch.temperature)
        for i in range(1, len(d.tokens)):
            if not d.mask[i]:
                continue
            lp = lp_all[i - 1]
            if loss == "cross_entropy":
                terms.append(-lp)
                continue
            ratio = torch.exp(lp - d.logprobs[i])
            a = d.advantages[i]
            if loss == "importance_sampling":
                terms.append(-ratio * a)
            else:
                clipped = torch.clamp(ratio, 1 - clip_low, 1 + clip_high)
                terms.append(-torch.minimum(ratio * a, clipped * a))
    return torch.stack(terms).sum() / len(terms)


def direct_entropy(model, batch: TrainingBatch, top_k: int | None = None) -> float:
    """The mean entropy of the sampling distribution at the loss positions, by
    `torch.distributions` over full logits (top-k: only the k largest logits)."""
    values = []
    with torch.no_grad():
        for d in batch.data:
            logits = model(input_ids=torch.tensor([d.tokens])).logits[0].float() / batch.temperature
            for i in range(1, len(d.tokens)):
                if d.mask[i]:
                    row = logits[i - 1]
                    if top_k is not None:
                        row = torch.topk(row, top_k).values
                    values.append(torch.distributions.Categorical(logits=row).entropy())
    return float(torch.stack(values).mean())


@pytest.mark.parametrize("loss", ["importance_sampling", "ppo", "cross_entropy"])
def test_loss_and_gradients_match_a_direct_full_logits_computation(model_dir, loss):
    ours, reference = load(model_dir), load(model_dir)
    batch = make_batch(reference, noise=0.4)
    head_rows = []
    ours.get_output_embeddings().register_forward_hook(
        lambda mod, args, out: head_rows.append(args[0].shape)
    )
    # Small micro-batches, so splitting is exercised too.
    metrics = batch_loss(ours, batch, loss, clip_low=0.1, clip_high=0.15, max_head_rows=14)
    expected = direct_loss(reference, batch, loss, 0.1, 0.15)
    expected.backward()

    assert metrics["loss"] == pytest.approx(expected.item(), rel=1e-5, abs=1e-7)
    assert metrics["entropy"] == pytest.approx(direct_entropy(reference, batch), rel=1e-5)
    assert metrics["tokens"] == batch.loss_tokens == 39
    # The head saw only loss positions: 2-D (rows, hidden), one row per masked token.
    assert all(len(shape) == 2 for shape in head_rows)
    assert sum(shape[0] for shape in head_rows) == batch.loss_tokens
    assert len(head_rows) == 3
    for (name, p), q in zip(ours.named_parameters(), reference.parameters(), strict=True):
        assert p.grad is not None, name
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-8, msg=name)
    if loss == "ppo":
        assert 0.0 < metrics["clip_fraction"] < 1.0
    if loss != "cross_entropy":
        assert metrics["ratio_min"] < 1.0 < metrics["ratio_max"]


def test_on_policy_logprobs_give_ratio_one_under_the_sampler_convention(model_dir):
    model = load(model_dir)
    batch = make_batch(model, noise=0.0)
    metrics = batch_loss(model, batch, "importance_sampling")
    assert metrics["logprob_diff_max"] < 1e-5
    assert metrics["ratio_mean"] == pytest.approx(1.0, abs=1e-5)
    assert abs(metrics["kl"]) < 1e-8


def test_top_k_sampling_is_part_of_the_convention(model_dir):
    """A batch sampled with top-k carries it; the trainer's logprobs renormalise the same way."""
    model = load(model_dir)
    d = make_batch(model, noise=0.0).data[0]
    # Sample each masked token from inside the top-k set, left to right, as a sampler would.
    tokens = list(d.tokens)
    logprobs = [0.0] * len(tokens)
    for i in range(1, len(tokens)):
        if d.mask[i]:
            with torch.no_grad():
                logits = model(input_ids=torch.tensor([tokens[:i]])).logits[0, -1]
            logp = processed_logprobs(logits, TEMPERATURE, top_k=50)
            tokens[i] = int(torch.topk(logp, 3).indices[i % 3])
            logprobs[i] = float(logp[tokens[i]])
    datum = Datum(tokens=tokens, mask=d.mask, logprobs=logprobs, advantages=d.advantages)
    batch = TrainingBatch(data=[datum], temperature=TEMPERATURE, top_k=50)
    metrics = batch_loss(model, batch, "importance_sampling")
    assert metrics["logprob_diff_max"] < 1e-5
    # The entropy is that of the renormalised top-k distribution: tokens outside add nothing.
    assert metrics["entropy"] == pytest.approx(direct_entropy(model, batch, top_k=50), rel=1e-5)
    plain = TrainingBatch(data=[datum], temperature=TEMPERATURE)
    assert batch_loss(model, plain, "importance_sampling")["logprob_diff_max"] > 1e-3


def assert_nucleus(row: torch.Tensor, logits: torch.Tensor, top_p: float) -> None:
    """`row` keeps a head of the tokens in order of decreasing probability, stopping at the
    first token before which the head's mass reaches `top_p` (to float32's precision in the
    sum, which a cut through thousands of tokens can only be held to), renormalised."""
    probs = torch.softmax(logits.double(), dim=-1)
    order = torch.argsort(probs, descending=True)
    kept = torch.isfinite(row)
    n = int(kept.sum())
    assert bool(kept[order[:n]].all()), "the kept tokens are not the most likely ones"
    mass = torch.cumsum(probs[order], dim=-1)
    assert n == 1 or float(mass[n - 2]) < top_p + 1e-5, "a token too many"
    assert float(mass[n - 1]) >= top_p - 1e-5, "a token too few"
    assert float(torch.logsumexp(row.double(), dim=-1)) == pytest.approx(0.0, abs=1e-5)


@pytest.mark.parametrize("top_p", [0.5, 0.9, 0.99])
def test_top_p_keeps_the_smallest_head_of_mass_narrow_or_wide(top_p):
    """A narrow nucleus is found among the most likely tokens, a wide one (past
    `TOP_P_HEAD` tokens) by sorting the row: the same cut either way, renormalised."""
    generator = torch.Generator().manual_seed(0)
    peaked = torch.randn(151_936, generator=generator)
    peaked[:3] = torch.tensor([20.0, 19.0, 17.0])  # 0.70, 0.26, 0.035 and a thin tail
    flat = torch.randn(151_936, generator=generator) * 0.1  # thousands of tokens: wide
    logits = torch.stack([peaked, flat])
    logp = processed_logprobs(logits, 1.0, top_p=top_p)
    narrow = {0.5: {0}, 0.9: {0, 1}, 0.99: {0, 1, 2}}[top_p]
    assert set(torch.isfinite(logp[0]).nonzero()[:, 0].tolist()) == narrow
    for row, x in zip(logp, logits, strict=True):
        assert_nucleus(row, x, top_p)
    assert int(torch.isfinite(logp[1]).sum()) > TOP_P_HEAD


def test_bad_datum_is_refused_naming_the_problem():
    with pytest.raises(ValueError, match="first token cannot be masked"):
        Datum(tokens=[1, 2], mask=[1, 1], logprobs=[0, 0], advantages=[0, 0])
    with pytest.raises(ValueError, match="advantages has 1 entries for 2 tokens"):
        Datum(tokens=[1, 2], mask=[0, 1], logprobs=[0, 0], advantages=[0])
    with pytest.raises(ValueError, match="no masked token"):
        Datum(tokens=[1, 2], mask=[0, 0], logprobs=[0, 0], advantages=[0, 0])
    with pytest.raises(ValueError, match="non-finite"):
        Datum(tokens=[1, 2], mask=[0, 1], logprobs=[0, float("nan")], advantages=[0, 1])
