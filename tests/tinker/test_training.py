"""Training and sampling through the unmodified `tinker` SDK against `plies serve`."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tinker import types

SEQ = [9707, 11, 1879, 0, 151644, 872, 198, 3838, 374, 220, 17, 10, 17, 30, 151645]


def datum(tokens: list[int], **inputs) -> types.Datum:
    """Predict tokens[1:] from tokens[:-1]; `inputs` are per-position loss inputs."""
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], **inputs},
    )


def test_supervised_cross_entropy_falls_by_a_third_in_20_steps(new_tenant, model_name):
    tc = new_tenant(rank=8, seed=0)
    info = tc.get_info()
    assert info.model_data.model_name == model_name and info.is_lora and info.lora_rank == 8
    data = [datum(SEQ, weights=[0.0] * 6 + [1.0] * 8), datum(SEQ[3:], weights=[1.0] * 11)]
    losses = []
    for _ in range(20):
        fb = tc.forward_backward(data, "cross_entropy")
        opt = tc.optim_step(types.AdamParams(learning_rate=1e-2))
        losses.append(fb.result().metrics["loss:sum"])
        opt.result()
    assert losses[-1] <= 0.7 * losses[0], losses


def test_sampler_logprobs_equal_the_trainers_forward_logprobs(new_tenant):
    tc = new_tenant(seed=1)
    for _ in range(3):  # move the adapter off zero, so the snapshot is not the base model
        tc.forward_backward([datum(SEQ, weights=[1.0] * 14)], "cross_entropy")
        tc.optim_step(types.AdamParams(learning_rate=5e-2))
    sampler = tc.save_weights_and_get_sampling_client().result()
    prompt = SEQ[:6]
    result = sampler.sample(
        types.ModelInput.from_ints(prompt), 2, types.SamplingParams(max_tokens=10, seed=3)
    ).result()
    assert len(result.sequences) == 2
    for seq in result.sequences:
        assert seq.stop_reason in ("stop", "length") and seq.sequence_id
        tokens = prompt + list(seq.tokens)
        out = tc.forward([datum(tokens)], "cross_entropy").result()
        trainer = out.loss_fn_outputs[0]["logprobs"].to_numpy()[len(prompt) - 1 :]
        np.testing.assert_allclose(trainer, seq.logprobs, atol=2e-3)


def _reference_logprobs(model, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([tokens[:-1]])).logits[0].double()
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(tokens[1:])[:, None])[:, 0]


@pytest.mark.parametrize("loss", ["importance_sampling", "ppo", "cispo", "dro"])
def test_policy_gradient_losses_match_an_independent_torch_computation(
    new_tenant, base_model, loss
):
    # A fresh LoRA tenant computes the base model: its adapter starts at zero.
    tc = new_tenant(seed=2)
    rng = np.random.default_rng(0)
    seqs = [SEQ, SEQ[2:12]]
    data, refs = [], []
    for tokens in seqs:
        t = len(tokens) - 1
        lp = _reference_logprobs(base_model, tokens)
        q = (lp + torch.tensor(rng.normal(0, 0.3, t))).float()  # "sampler" logprobs
        adv = torch.tensor(rng.normal(0, 1, t) * (rng.random(t) > 0.3)).float()
        data.append(datum(tokens, logprobs=q.tolist(), advantages=adv.tolist()))
        refs.append((lp, q.double(), adv.double()))
    config = {
        "ppo": {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1},
        "cispo": {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1},
        "dro": {"beta": 0.5},
    }.get(loss)
    out = tc.forward_backward(data, loss, config).result()
    expected = 0.0
    for (lp, q, adv), got in zip(refs, out.loss_fn_outputs, strict=True):
        np.testing.assert_allclose(got["logprobs"].to_numpy(), lp.numpy(), atol=1e-4)
        ratio = torch.exp(lp - q)
        if loss == "importance_sampling":
            expected += float(-(ratio * adv).sum())
        elif loss == "ppo":
            clipped = ratio.clamp(0.9, 1.1)
            expected += float(-torch.minimum(ratio * adv, clipped * adv).sum())
        elif loss == "cispo":
            expected += float(-(ratio.clamp(0.9, 1.1) * lp * adv).sum())
        else:
            expected += float(-(lp * adv - 0.25 * (lp - q) ** 2).sum())
    assert out.metrics["loss:sum"] == pytest.approx(expected, rel=1e-4, abs=1e-4)


def test_cross_entropy_sums_signed_weights_and_reports_every_position(new_tenant, base_model):
    tc = new_tenant(seed=3)
    weights = [0.0, 0.0, 0.5, -1.0, 2.0, 0.0, 1.0, 1.0, 0.0, 3.0, 1.0, 1.0, 0.0, 1.0]
    out = tc.forward([datum(SEQ, weights=weights)], "cross_entropy").result()
    lp = _reference_logprobs(base_model, SEQ)
    np.testing.assert_allclose(out.loss_fn_outputs[0]["logprobs"].to_numpy(), lp, atol=1e-4)
    expected = float(-(lp * torch.tensor(weights, dtype=torch.float64)).sum())
    assert out.metrics["loss:sum"] == pytest.approx(expected, rel=1e-4)


def test_seeded_samples_repeat_and_stop_at_token_ids_and_strings(
    service, model_name, tiny_model_dir
):
    from transformers import AutoTokenizer

    sampler = service.create_sampling_client(base_model=model_name).result()
    prompt = types.ModelInput.from_ints(SEQ[:6])

    def draw(n: int = 1, **params):
        params = types.SamplingParams(max_tokens=8, seed=11, **params)
        return sampler.sample(prompt, n, params).result().sequences

    first, second = draw(2)
    assert first.tokens != second.tokens  # sample i draws with seed + i
    assert draw()[0].tokens == first.tokens  # and again the same on a repeat
    assert first.stop_reason == "length" and len(first.tokens) == 8
    stop_id = first.tokens[2]
    by_id = draw(stop=[stop_id])[0]
    cut = first.tokens.index(stop_id) + 1
    assert (by_id.tokens, by_id.stop_reason) == (first.tokens[:cut], "stop")
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    text = tok.decode(first.tokens[3:5])
    by_text = draw(stop=[text])[0]
    n = next(k for k in range(1, 9) if text in tok.decode(first.tokens[:k]))
    assert (by_text.tokens, by_text.stop_reason) == (first.tokens[:n], "stop")
    np.testing.assert_allclose(by_text.logprobs, first.logprobs[:n], atol=1e-6)


def test_a_tenants_losses_do_not_depend_on_a_busy_neighbour(new_tenant):
    data = [datum(SEQ, weights=[1.0] * 14)]

    def step(tc, lr: float) -> float:
        fb = tc.forward_backward(data, "cross_entropy")
        tc.optim_step(types.AdamParams(learning_rate=lr)).result()
        return fb.result().metrics["loss:sum"]

    alone = new_tenant(seed=7)
    losses_alone = [step(alone, 1e-2) for _ in range(4)]
    watched, busy = new_tenant(seed=7), new_tenant(seed=8)
    losses_beside = []
    for _ in range(4):
        step(busy, 1.0)
        losses_beside.append(step(watched, 1e-2))
        step(busy, 1.0)
    np.testing.assert_allclose(losses_beside, losses_alone, atol=1e-4)
    assert losses_alone[-1] < losses_alone[0]


def test_prompt_logprobs_equal_the_trainers_forward_logprobs(new_tenant):
    tc = new_tenant(seed=4)
    for _ in range(3):  # off the base model, so the sampler must use the snapshot
        tc.forward_backward([datum(SEQ, weights=[1.0] * 14)], "cross_entropy")
        tc.optim_step(types.AdamParams(learning_rate=5e-2))
    sampler = tc.save_weights_and_get_sampling_client().result()
    trainer = tc.forward([datum(SEQ)], "cross_entropy").result()
    trainer_lp = trainer.loss_fn_outputs[0]["logprobs"].to_numpy()
    prompt = types.ModelInput.from_ints(SEQ)
    got = sampler.compute_logprobs(prompt).result()
    assert len(got) == len(SEQ) and got[0] is None
    np.testing.assert_allclose(np.array(got[1:], dtype=float), trainer_lp, atol=2e-3)
    tail = sampler.compute_logprobs(prompt, prompt_logprobs_last_n=4).result()
    assert tail[:-4] == [None] * (len(SEQ) - 4)
    np.testing.assert_allclose(tail[-4:], got[-4:], atol=1e-6)


def test_topk_prompt_logprobs_match_the_model(service, model_name, base_model):
    sampler = service.create_sampling_client(base_model=model_name).result()
    out = sampler.sample(
        types.ModelInput.from_ints(SEQ), 1, types.SamplingParams(max_tokens=2, seed=0),
        include_prompt_logprobs=True, topk_prompt_logprobs=5,
    ).result()  # fmt: skip
    assert len(out.sequences) == 1 and len(out.sequences[0].tokens) == 2
    with torch.no_grad():
        logp = torch.log_softmax(base_model(torch.tensor([SEQ])).logits[0, :-1].double(), -1)
    values, index = logp.topk(5, dim=-1)
    topk = out.topk_prompt_logprobs
    assert len(topk) == len(SEQ) and topk[0] is None
    for row, ids, lps in zip(topk[1:], index.tolist(), values.tolist(), strict=True):
        assert [t for t, _ in row] == ids
        np.testing.assert_allclose([lp for _, lp in row], lps, atol=1e-4)
    expected = logp.gather(1, torch.tensor(SEQ[1:])[:, None])[:, 0].numpy()
    np.testing.assert_allclose(out.prompt_logprobs[1:], expected, atol=1e-4)
