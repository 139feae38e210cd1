"""Several policy versions served at once; the policy store on disk."""

from __future__ import annotations

import hashlib
import json
import os

import anyio
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from plies import ConfigError, PolicyRef, PolicyResponseError
from plies.policy import (
    SamplingParams,
    SGLangClient,
    Timeout,
    VLLMClient,
)
from plies.policy._paths import policy_path
from plies.policy._vllm import load_lora_adapter, unload_lora_adapter
from plies.server import PolicyStore
from plies.testing._models import build_tiny_model

PROMPT = [9707, 11, 1879, 0, 151644, 872, 198, 3838, 374, 220, 17, 10, 17, 30]


@pytest.fixture(scope="module")
def second_model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("seed1") / "tiny", seed=1)


def test_store_publishes_immutable_versions(tmp_path, tiny_model_dir, second_model_dir):
    store = PolicyStore.open(tmp_path, tiny_model_dir)
    v0 = store.get(0)
    weights = (tiny_model_dir / "model.safetensors").read_bytes()
    name_and_bytes = b"model.safetensors\0" + weights
    assert v0.digest == "sha256:" + hashlib.sha256(name_and_bytes).hexdigest()
    assert policy_path(v0) == (tmp_path / "policies" / "0").resolve()

    model = AutoModelForCausalLM.from_pretrained(second_model_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(second_model_dir)
    v1 = store.publish(model, tokenizer)
    v2 = store.publish_dir(second_model_dir)
    assert (v1.version, v2.version) == (1, 2)
    assert v1.digest == v2.digest != v0.digest
    on_disk = json.loads((tmp_path / "policies" / "1" / "policy.json").read_text())
    assert PolicyRef.model_validate(on_disk) == v1
    assert store.read_ref(policy_path(v1)) == v1

    # A crash mid-publication leaves a temp dir; reopening removes it and keeps the versions.
    (tmp_path / "policies" / ".tmp-crashed").mkdir()
    again = PolicyStore.open(tmp_path, tiny_model_dir)
    assert again.versions() == [0, 1, 2] and again.latest() == v2
    assert not (tmp_path / "policies" / ".tmp-crashed").exists()

    with pytest.raises(ConfigError, match="other weights"):
        PolicyStore.open(tmp_path, second_model_dir)
    with pytest.raises(ConfigError, match="not published"):
        store.path(7)
    with pytest.raises(ConfigError, match="not a published policy"):
        PolicyStore.read_ref(second_model_dir)


@pytest.mark.anyio
async def test_two_versions_served_at_once(
    start_policy_server, tiny_model_dir, second_model_dir, tmp_path, forward_logprobs
):
    state = tmp_path / "state"
    with start_policy_server(tiny_model_dir, state) as server:
        v0 = PolicyRef.model_validate(server.policy)
        v1 = PolicyStore(state).publish_dir(second_model_dir)
        async with VLLMClient(server.url, server.model, timeout=Timeout(read=60)) as client:
            await load_lora_adapter(client, "policy-1", v1)
            assert (await client.refresh()) == {"policy-0": v0, "policy-1": v1}
            got: dict[str, object] = {}

            async def sample(policy) -> None:
                params = SamplingParams(max_tokens=16, temperature=0.9, seed=3)
                got[getattr(policy, "version", policy)] = await client.sample(
                    PROMPT, params, policy=policy
                )

            # An episode on version 0 and a new one on version 1, at the same time, by
            # PolicyRef and by served name.
            async with anyio.create_task_group() as tg:
                tg.start_soon(sample, v0)
                tg.start_soon(sample, v1)
                tg.start_soon(sample, "policy-1")
            assert got[0].policy == v0 and got[1].policy == v1
            assert got["policy-1"].policy == v1
            # SGLang's /generate picks a served policy by name too, not only the newest.
            sglang = SGLangClient(server.url, model="policy-0", policy=v0, weight_version="0")
            async with sglang:
                assert (await sglang.sample(PROMPT, SamplingParams(max_tokens=2))).policy == v0
            for c, model_dir in ((got[0], tiny_model_dir), (got[1], second_model_dir)):
                expected = forward_logprobs(model_dir, PROMPT, c.ids, 0.9)
                assert max(abs(a - b) for a, b in zip(c.logprobs, expected, strict=True)) < 1e-4

            with pytest.raises(PolicyResponseError, match="already loaded") as e:
                await load_lora_adapter(client, "policy-1", v1)
            assert e.value.status == 400
            with pytest.raises(PolicyResponseError, match="is outside the directories"):
                await load_lora_adapter(client, "junk", v1, path=second_model_dir)
            inside = state / "not-published"
            inside.mkdir()
            with pytest.raises(PolicyResponseError, match="not a published policy"):
                await load_lora_adapter(client, "junk", v1, path=inside)

            await unload_lora_adapter(client, "policy-0")
            with pytest.raises(PolicyResponseError, match="no policy named 'policy-0'"):
                await client.sample(PROMPT, SamplingParams(max_tokens=2), policy="policy-0")
    # Restarting on the same state dir serves the newest published version.
    with start_policy_server(tiny_model_dir, state) as server:
        assert PolicyRef.model_validate(server.policy) == v1 and server.model == "policy-1"
    assert sorted(os.listdir(state / "policies")) == ["0", "1"]
