"""Policy clients against real reference-server processes: errors, retries, failover."""

from __future__ import annotations

import time

import anyio
import httpx
import pytest

from plies import (
    PolicyRef,
    PolicyResponseError,
    PolicyUnavailable,
    RetryPolicy,
    UsageError,
)
from plies.policy import (
    Completion,
    PolicyClient,
    SamplingParams,
    SGLangClient,
    VLLMClient,
)
from plies.testing import closed_url

pytestmark = pytest.mark.anyio

PROMPT = [151644, 872, 198, 9707, 0, 151645, 198, 151644, 77091, 198]
FAST_RETRY = RetryPolicy(attempts=3, initial_wait=0.05, max_wait=0.2, down_for=0.5)


async def stats(url: str) -> dict:
    async with httpx.AsyncClient() as http:
        return (await http.get(url + "/plies/stats")).json()


async def test_clients_implement_the_protocol_and_their_lifetime_is_checked(policy_server):
    client = VLLMClient(policy_server.url, policy_server.model)
    assert isinstance(client, PolicyClient)
    with pytest.raises(UsageError, match="cannot sample: this VLLMClient was never opened"):
        await client.sample(PROMPT, SamplingParams(max_tokens=2))
    with pytest.raises(TypeError, match="async with"), client:
        pass
    async with client:
        await client.sample(PROMPT, SamplingParams(max_tokens=2))
    await client.aclose()  # idempotent
    with pytest.raises(UsageError, match="is closed; create a new one"):
        await client.__aenter__()
    assert isinstance(SGLangClient(policy_server.url), PolicyClient)


def test_a_completion_whose_counts_differ_is_refused():
    ref = PolicyRef(uri="file:///p/0", version=0)
    with pytest.raises(PolicyResponseError, match="2 token ids but 1 logprobs"):
        Completion(ids=[1, 2], logprobs=[-0.5], finish_reason="stop", policy=ref)
    client = VLLMClient("http://127.0.0.1:1", "m", policy=ref)
    answer = {
        "choices": [
            {
                "token_ids": [5, 6, 7],
                "logprobs": {"tokens": None, "token_logprobs": [-1.0, -2.0]},
                "finish_reason": "length",
            }
        ]
    }
    with pytest.raises(PolicyResponseError, match="3 token ids but 2 logprobs"):
        client._completion(answer, "m", ref)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_a_non_finite_logprob_is_refused_before_it_is_recorded(bad):
    ref = PolicyRef(uri="file:///p/0", version=0)
    client = VLLMClient("http://127.0.0.1:1", "m", policy=ref)
    answer = {
        "choices": [
            {
                "token_ids": [5, 6],
                "logprobs": {"tokens": None, "token_logprobs": [-1.0, bad]},
                "finish_reason": "stop",
            }
        ]
    }
    with pytest.raises(PolicyResponseError, match=r"logprob 1 is .*not a finite number"):
        client._completion(answer, "m", ref)


async def test_refused_connections_fail_over_to_a_live_engine(policy_server):
    dead = closed_url()
    async with VLLMClient([dead, policy_server.url], "policy-0", retry=FAST_RETRY) as client:
        sessions = [f"episode-{i}" for i in range(8)]
        for s in sessions:  # some sessions hash to the dead engine first
            c = await client.sample(PROMPT, SamplingParams(max_tokens=2), session=s)
            assert len(c.ids) == 2
        health = await client.check_health()
    assert health == {dead: False, policy_server.url: True}


async def test_no_engine_reachable_is_unavailable_after_bounded_retries():
    async with VLLMClient([closed_url(), closed_url()], "policy-0", retry=FAST_RETRY) as client:
        start = time.monotonic()
        with pytest.raises(PolicyUnavailable):
            await client.sample(PROMPT, SamplingParams(max_tokens=2))
    assert time.monotonic() - start < 3


async def test_sessions_stick_to_one_engine(policy_server):
    port = policy_server.url.rsplit(":", 1)[1]
    urls = [policy_server.url, f"http://localhost:{port}", f"http://[::1]:{port}"]
    async with VLLMClient(urls, "policy-0") as client:
        chosen = {s: {await client._choose(s) for _ in range(5)} for s in map(str, range(30))}
    assert all(len(v) == 1 for v in chosen.values())
    assert len({next(iter(v)) for v in chosen.values()}) > 1  # sessions spread out


async def test_overload_503_is_retried_and_nothing_runs_twice(
    start_policy_server, tiny_model_dir, tmp_path
):
    with start_policy_server(tiny_model_dir, tmp_path / "s", "--max-queued", "1") as server:
        retry = RetryPolicy(attempts=30, initial_wait=0.05, max_wait=0.3)
        results = []
        async with VLLMClient(server.url, server.model, retry=retry) as client:

            async def one(i: int) -> None:
                results.append(await client.sample(PROMPT, SamplingParams(max_tokens=8, seed=i)))

            async with anyio.create_task_group() as tg:
                for i in range(4):
                    tg.start_soon(one, i)
        assert len(results) == 4
        assert (await stats(server.url))["requests_finished"] == 4


async def test_sglang_client_speaks_generate(policy_server, tiny_model_dir, forward_logprobs):
    v0 = PolicyRef.model_validate(policy_server.policy)
    async with SGLangClient(policy_server.url, policy=v0, weight_version="0") as client:
        c = await client.sample(PROMPT, SamplingParams(max_tokens=12, temperature=0.8, seed=2))
        assert c.policy == v0 and len(c.ids) == 12 and c.finish_reason == "length"
        expected = forward_logprobs(tiny_model_dir, PROMPT, c.ids, 0.8)
        assert max(abs(a - b) for a, b in zip(c.logprobs, expected, strict=True)) < 1e-4
        stop = await client.sample(
            PROMPT, SamplingParams(max_tokens=12, temperature=0, stop_token_ids=(0,))
        )
        assert stop.ids[-1] == 0 or stop.finish_reason == "length"
    async with SGLangClient(policy_server.url, policy=v0) as client:
        with pytest.raises(PolicyResponseError, match="weight_version '0'"):
            await client.sample(PROMPT, SamplingParams(max_tokens=2))
    # A served name picks the policy (SGLang's `lora_path`); an unknown one is refused.
    named = SGLangClient(
        policy_server.url, model=policy_server.model, policy=v0, weight_version="0"
    )
    async with named as client:
        assert (await client.sample(PROMPT, SamplingParams(max_tokens=2))).policy == v0
    async with SGLangClient(policy_server.url, model="policy-99", policy=v0) as client:
        with pytest.raises(PolicyResponseError, match="policy-99") as err:
            await client.sample(PROMPT, SamplingParams(max_tokens=2))
        assert err.value.status == 404
