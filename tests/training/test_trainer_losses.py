"""The trainer's losses against a direct torch computation over full logits on the tiny model."""

from __future__ import annotations

import math
import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from plies.server import PolicyStore, processed_logprobs
from plies.server._losses import batch_loss
from plies.server._sampling import TOP_P_HEAD
from plies.server._trainer import Trainer
from plies.training import AdamParams, Datum, TrainingBatch
from plies.wire.training import ForwardBackwardRequest, OptimStepRequest

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


def sampled_top_p_batch(model, top_p: float, noise: float, seed: int = 0) -> TrainingBatch:
    """Three sequences whose masked tokens are drawn left to right from the cut distribution,
    as the sampler draws them, with the sampler's logprobs plus noise."""
    rng = random.Random(seed)
    data = []
    for n in (19, 26, 23):
        tokens = [rng.randrange(151_000) for _ in range(n)]
        mask = [0] * 4 + [1] * (n - 4)
        logprobs, advantages = [0.0] * n, [0.0] * n
        for i in range(4, n):
            with torch.no_grad():
                logits = model(input_ids=torch.tensor([tokens[:i]])).logits[0, -1]
            logp = processed_logprobs(logits, TEMPERATURE, top_p=top_p)
            kept = torch.isfinite(logp).nonzero()[:, 0].tolist()
            tokens[i] = rng.choice(kept)
            logprobs[i] = float(logp[tokens[i]]) + rng.uniform(-noise, noise)
            advantages[i] = rng.choice([-1.5, -0.5, 0.75, 2.0])
        data.append(Datum(tokens=tokens, mask=mask, logprobs=logprobs, advantages=advantages))
    return TrainingBatch(data=data, temperature=TEMPERATURE, top_p=top_p)


@pytest.mark.parametrize("loss", ["importance_sampling", "ppo"])
def test_top_p_rows_with_one_certain_token_skip_the_gradient_path_exactly(model_dir, loss):
    """A row whose most likely token alone holds top_p has logprob 0 and no gradient, so the
    trainer keeps it out of the head's gradient pass; loss, entropy and every gradient are
    those of the cut distribution over full logits, row by row."""
    ours, reference = load(model_dir), load(model_dir)
    for model in (ours, reference):  # sharpen the random model: about half the rows certain
        with torch.no_grad():
            model.get_output_embeddings().weight.mul_(70.0)
    top_p = 0.8
    batch = sampled_top_p_batch(reference, top_p, noise=0.3)
    grad_rows = []
    ours.get_output_embeddings().register_forward_hook(
        lambda mod, args, out: grad_rows.append(args[0].shape[0]) if out.requires_grad else None
    )
    metrics = batch_loss(ours, batch, loss, clip_low=0.1, clip_high=0.15)

    terms, entropies, certain = [], [], 0
    for d in batch.data:
        logits = reference(input_ids=torch.tensor([d.tokens])).logits[0]
        logp = processed_logprobs(logits, TEMPERATURE, top_p=top_p)
        for i in range(1, len(d.tokens)):
            if d.mask[i]:
                row = logp[i - 1]
                certain += int(torch.isfinite(row).sum()) == 1
                kept = row[torch.isfinite(row)]
                entropies.append(float(-(kept.exp() * kept).sum().detach()))
                ratio = torch.exp(row[d.tokens[i]] - d.logprobs[i])
                a = d.advantages[i]
                clipped = torch.clamp(ratio, 0.9, 1.15)
                terms.append(
                    -ratio * a
                    if loss == "importance_sampling"
                    else -torch.min(ratio * a, clipped * a)
                )
    expected = torch.stack(terms).sum() / len(terms)
    expected.backward()

    assert 0 < certain < batch.loss_tokens
    assert sum(grad_rows) == batch.loss_tokens - certain
    assert metrics["loss"] == pytest.approx(expected.item(), rel=1e-5, abs=1e-7)
    assert metrics["entropy"] == pytest.approx(sum(entropies) / len(entropies), rel=1e-4)
    for (name, p), q in zip(ours.named_parameters(), reference.parameters(), strict=True):
        # Leaving certain rows out of the head's pass reorders float32 sums: each element's
        # rounding error scales with the tensor's largest terms, not with its own value, so
        # a fixed absolute tolerance refuses near-zero elements on some CPUs.
        scale = float(q.grad.abs().max())
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5 * scale, msg=name)


def test_a_batch_of_only_certain_rows_adds_no_gradient_and_steps_nothing(tmp_path, model_dir):
    """Every trained token alone in its nucleus: the loss is a constant, no backward runs,
    and the optimizer step that follows reports a gradient norm of 0 and changes no weight
    (a real GRPO run met such a micro-batch at top_p 0.8 and failed its step)."""
    trainer = Trainer.open(tmp_path, PolicyStore.open(tmp_path, model_dir))
    with torch.no_grad():
        trainer.model.get_output_embeddings().weight.mul_(70.0)
    batch = sampled_top_p_batch(trainer.model, 0.05, noise=0.0)
    assert {lp for d in batch.data for lp, m in zip(d.logprobs, d.mask, strict=True) if m} == {0.0}
    kept = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    fb = trainer.forward_backward(ForwardBackwardRequest(op_id="fb", batch=batch, loss="ppo"))
    assert math.isfinite(fb.metrics["loss"]) and fb.metrics["entropy"] == 0.0
    assert all(p.grad is None for p in trainer.model.parameters())
    step = trainer.optim_step(
        OptimStepRequest(op_id="step", adam=AdamParams(lr=1e-2), forward_backward_ops=["fb"])
    )
    assert step.metrics["grad_norm"] == 0.0
    for name, w in trainer.model.state_dict().items():
        assert torch.equal(w, kept[name]), name


def test_bad_datum_is_refused_naming_the_problem():
    with pytest.raises(ValueError, match="first token cannot be masked"):
        Datum(tokens=[1, 2], mask=[1, 1], logprobs=[0, 0], advantages=[0, 0])
    with pytest.raises(ValueError, match="advantages has 1 entries for 2 tokens"):
        Datum(tokens=[1, 2], mask=[0, 1], logprobs=[0, 0], advantages=[0])
    with pytest.raises(ValueError, match="no masked token"):
        Datum(tokens=[1, 2], mask=[0, 0], logprobs=[0, 0], advantages=[0, 0])
    with pytest.raises(ValueError, match="non-finite"):
        Datum(tokens=[1, 2], mask=[0, 1], logprobs=[0, float("nan")], advantages=[0, 1])
