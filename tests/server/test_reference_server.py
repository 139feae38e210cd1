"""The reference server over HTTP: a real `plies serve` subprocess on the tiny model."""

from __future__ import annotations

import anyio
import httpx
import pytest

from plies import PolicyRef, PolicyResponseError
from plies.policy import SamplingParams, Timeout, VLLMClient
from plies.server._serve import serve

pytestmark = pytest.mark.anyio

PROMPT = [9707, 11, 1879, 0, 151644, 872, 198, 3838, 374, 220, 17, 10, 17, 30]


def client_for(server, **kw) -> VLLMClient:
    return VLLMClient(server.url, server.model, timeout=Timeout(read=120), **kw)


async def test_ready_line_names_a_loopback_url_and_the_initial_policy(policy_server):
    assert policy_server.url.startswith("http://127.0.0.1:")
    ref = PolicyRef.model_validate(policy_server.policy)
    assert ref.version == 0 and ref.digest.startswith("sha256:")
    assert policy_server.model == "policy-0"
    async with httpx.AsyncClient() as http:
        assert (await http.get(policy_server.url + "/health")).status_code == 200
        cards = (await http.get(policy_server.url + "/v1/models")).json()["data"]
    assert [c["id"] for c in cards] == ["policy-0"]
    assert PolicyRef.model_validate(cards[0]["plies_policy"]) == ref


@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.6])
async def test_token_in_token_out_logprobs_match_a_forward_pass(
    policy_server, tiny_model_dir, forward_logprobs, temperature
):
    async with client_for(policy_server) as client:
        c = await client.sample(
            PROMPT, SamplingParams(max_tokens=24, temperature=temperature, seed=5)
        )
    assert c.policy == PolicyRef.model_validate(policy_server.policy)
    assert len(c.ids) == len(c.logprobs) == 24 and c.finish_reason == "length"
    expected = forward_logprobs(tiny_model_dir, PROMPT, c.ids, temperature)
    assert max(abs(a - b) for a, b in zip(c.logprobs, expected, strict=True)) < 1e-4


async def test_top_k_logprobs_are_those_of_the_truncated_distribution(
    policy_server, tiny_model_dir, forward_logprobs
):
    params = SamplingParams(max_tokens=16, temperature=0.8, top_k=20, seed=1)
    async with client_for(policy_server) as client:
        c = await client.sample(PROMPT, params)
    expected = forward_logprobs(tiny_model_dir, PROMPT, c.ids, 0.8, top_k=20)
    assert max(abs(a - b) for a, b in zip(c.logprobs, expected, strict=True)) < 1e-4
    # 20 survivors of a near-uniform distribution: about log(1/20) each.
    assert all(-4.0 < lp < -2.0 for lp in c.logprobs)


async def test_greedy_and_seeds_are_reproducible(policy_server):
    async with client_for(policy_server) as client:
        g1 = await client.sample(PROMPT, SamplingParams(max_tokens=8, temperature=0))
        g2 = await client.sample(PROMPT, SamplingParams(max_tokens=8, temperature=0))
        s1 = await client.sample(PROMPT, SamplingParams(max_tokens=8, seed=11))
        s2 = await client.sample(PROMPT, SamplingParams(max_tokens=8, seed=11))
        s3 = await client.sample(PROMPT, SamplingParams(max_tokens=8, seed=12))
    assert g1.ids == g2.ids and s1.ids == s2.ids and s1.logprobs == s2.logprobs
    assert s1.ids != s3.ids


async def test_stop_token_is_kept_and_finish_reasons_are_right(policy_server):
    async with client_for(policy_server) as client:
        free = await client.sample(PROMPT, SamplingParams(max_tokens=12, temperature=0))
        assert free.finish_reason == "length" and len(free.ids) == 12
        k = next(i for i in range(3, 12) if free.ids[i] not in free.ids[:i])
        stopped = await client.sample(
            PROMPT, SamplingParams(max_tokens=12, temperature=0, stop_token_ids=(free.ids[k],))
        )
    assert stopped.finish_reason == "stop"
    assert stopped.ids == free.ids[: k + 1]
    assert stopped.logprobs == pytest.approx(free.logprobs[: k + 1], abs=1e-5)


async def test_concurrent_requests_share_forward_passes(policy_server):
    async with httpx.AsyncClient() as http:
        before = (await http.get(policy_server.url + "/plies/stats")).json()
        results = []
        async with client_for(policy_server) as client:

            async def one(i: int) -> None:
                results.append(
                    await client.sample(PROMPT[: 4 + i], SamplingParams(max_tokens=20, seed=i))
                )

            async with anyio.create_task_group() as tg:
                for i in range(8):
                    tg.start_soon(one, i)
        after = (await http.get(policy_server.url + "/plies/stats")).json()
    tokens = sum(len(c.ids) for c in results)
    assert tokens == 8 * 20
    passes = (after["decode_passes"] - before["decode_passes"]) + (
        after["prefill_passes"] - before["prefill_passes"]
    )
    # One request at a time would take one pass per token.
    assert passes <= tokens / 3, (passes, tokens)
    assert after["max_rows"] >= 4


async def test_bad_requests_get_clear_errors(policy_server):
    async with client_for(policy_server) as client:
        with pytest.raises(PolicyResponseError, match="no policy named 'policy-9'") as e:
            await client.sample(PROMPT, SamplingParams(max_tokens=4), policy="policy-9")
        assert e.value.status == 404
        with pytest.raises(PolicyResponseError, match="outside the vocabulary") as e:
            await client.sample([5, 10**7], SamplingParams(max_tokens=4))
        assert e.value.status == 400
        with pytest.raises(PolicyResponseError, match="max_model_len"):
            await client.sample(PROMPT, SamplingParams(max_tokens=5000))
    async with httpx.AsyncClient() as http:
        resp = await http.post(
            policy_server.url + "/v1/completions",
            json={"model": "policy-0", "prompt": "hello", "presence_penalty": 1.0},
        )
    assert resp.status_code == 400
    message = resp.json()["error"]["message"]
    assert "token ids only" in message and "presence_penalty" in message


async def test_fault_routes_exist_only_on_a_test_server_bound_to_loopback(
    policy_server, tiny_model_dir, tmp_path
):
    async with httpx.AsyncClient() as http:
        resp = await http.post(policy_server.url + "/plies/test/hold", json={"point": "x"})
    assert resp.status_code == 404  # a production server has no such route
    refused = serve(model_dir=tiny_model_dir, state_dir=tmp_path, host="0.0.0.0", test_faults=True)
    assert refused == 2


async def test_a_streamed_completion_is_the_unstreamed_one_step_by_step(policy_server):
    params = SamplingParams(max_tokens=24, seed=11)
    runs: list[list[int]] = []

    async def on_tokens(ids) -> None:
        runs.append(list(ids))

    async with client_for(policy_server) as client:
        streamed = await client.sample_streaming(PROMPT, params, on_tokens)
        whole = await client.sample(PROMPT, params)
    assert (streamed.ids, streamed.logprobs) == (whole.ids, whole.logprobs)
    assert streamed.finish_reason == whole.finish_reason and streamed.policy == whole.policy
    # One run per decode step (the prefill's step samples two), told as each step ended.
    assert len(runs) >= len(whole.ids) - 1 and [t for r in runs for t in r] == whole.ids

    body = {"model": policy_server.model, "prompt": PROMPT, "max_tokens": 6, "stream": True}
    async with httpx.AsyncClient(timeout=60) as http:
        text = (await http.post(policy_server.url + "/v1/completions", json=body)).text
    records = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
    assert records[-1] == "[DONE]"
    assert '"finish_reason": "length"' in records[-2] and "plies_policy" in records[-2]


async def test_a_stream_is_refused_before_it_opens_and_ends_when_the_client_leaves(
    policy_server,
):
    url = policy_server.url + "/v1/completions"
    async with httpx.AsyncClient(timeout=60) as http:
        body = {"model": "nope", "prompt": PROMPT, "max_tokens": 4, "stream": True}
        refused = await http.post(url, json=body)
        assert refused.status_code == 404 and "no policy named 'nope'" in refused.text

        # A client that reads two events of a long stream and leaves: its row is dropped.
        stats_url = policy_server.url + "/plies/stats"
        before = (await http.get(stats_url)).json()["tokens_generated"]
        body = {
            "model": policy_server.model,
            "prompt": PROMPT,
            "max_tokens": 2000,
            "ignore_eos": True,
            "stream": True,
        }
        async with http.stream("POST", url, json=body) as resp:
            assert resp.status_code == 200
            seen = 0
            async for line in resp.aiter_lines():
                seen += line.startswith("data: ")
                if seen == 2:
                    break
        with anyio.fail_after(30):
            while (stats := (await http.get(stats_url)).json())["running"] or stats["waiting"]:
                await anyio.sleep(0.1)
    assert stats["tokens_generated"] - before < 500  # not the 2,000 it asked for
