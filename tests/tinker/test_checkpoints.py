"""save_weights / load_weights, runs and checkpoints, unload_model, through the unmodified SDK."""

from __future__ import annotations

import httpx
import pytest
import tinker
from tinker import types

SEQ = [9707, 11, 1879, 0, 151644, 872, 198, 3838, 374, 220, 17, 10, 17, 30, 151645]
DATA = [
    types.Datum(
        model_input=types.ModelInput.from_ints(SEQ[:-1]),
        loss_fn_inputs={"target_tokens": SEQ[1:], "weights": [1.0] * 14},
    )
]


def step(tc: tinker.TrainingClient) -> float:
    """One training step; the loss it was taken on."""
    fb = tc.forward_backward(DATA, "cross_entropy")
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    return fb.result().metrics["loss:sum"]


def loss(tc: tinker.TrainingClient) -> float:
    return tc.forward(DATA, "cross_entropy").result().metrics["loss:sum"]


def _post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}/api/v1/{path}", json=body, timeout=30)


def test_a_run_resumed_from_save_weights_steps_as_if_never_stopped(tinker_url, model_name):
    with tinker.ServiceClient() as client:
        tc = client.create_lora_training_client(base_model=model_name, rank=4, seed=5).result()
        for _ in range(3):
            step(tc)
        path = tc.save_state("three").result().path
        assert path == f"tinker://{tc.model_id}/weights/three"
        resumed = client.create_training_client_from_state_with_optimizer(path).result()
        weights_only = client.create_training_client_from_state(path).result()
        legacy = client.create_lora_training_client(base_model=model_name, rank=4, seed=9).result()
        with pytest.warns(FutureWarning, match="deprecated"):
            legacy.load_state_with_optimizer(path).result()
        info = resumed.get_info()
        assert info.is_lora and info.lora_rank == 4 and resumed.model_id != tc.model_id

        # The 4th step's loss is the saved weights'; the loss after it is what the restored
        # Adam moments decide, so a fresh optimizer gives another one.
        uninterrupted = step(tc), loss(tc)
        for other in (resumed, legacy):
            assert (step(other), loss(other)) == pytest.approx(uninterrupted, abs=1e-5)
        fourth, fifth = step(weights_only), loss(weights_only)
        assert fourth == pytest.approx(uninterrupted[0], abs=1e-5)
        assert abs(fifth - uninterrupted[1]) > 1e-3


def test_runs_and_checkpoints_are_listed_and_deleted(tinker_url, new_tenant, model_name):
    tc = new_tenant(rank=4, seed=1)
    step(tc)
    ckpt = tc.save_state("ckpt1", user_metadata={"step": "1"}).result().path
    sampler = tc.save_weights_for_sampler("s1").result().path
    rest = tinker.RestClient(base_url=tinker_url, api_key="tml-local")

    listed = rest.list_checkpoints(tc.model_id).result().checkpoints
    assert [(c.checkpoint_id, c.checkpoint_type, c.tinker_path) for c in listed] == [
        ("weights/ckpt1", "training", ckpt),
        ("sampler_weights/s1", "sampler", sampler),
    ]
    assert listed[0].user_metadata == {"step": "1"} and listed[0].size_bytes > 0
    run = rest.get_training_run(tc.model_id).result()
    assert (run.base_model, run.is_lora, run.lora_rank) == (model_name, True, 4)
    assert run.last_checkpoint.tinker_path == ckpt
    assert run.last_sampler_checkpoint.tinker_path == sampler
    runs = rest.list_training_runs(limit=100).result()
    assert tc.model_id in [r.training_run_id for r in runs.training_runs]
    info = rest.get_weights_info_by_tinker_path(ckpt).result()
    assert (info.base_model, info.is_lora, info.lora_rank, info.train_attn) == (
        model_name,
        True,
        4,
        True,
    )
    mine = [c for c in rest.list_user_checkpoints().result().checkpoints if c.tinker_path == ckpt]
    assert len(mine) == 1

    rest.delete_checkpoint(tc.model_id, "weights/ckpt1").result()
    rest.delete_checkpoint_from_tinker_path(sampler).result()
    assert rest.list_checkpoints(tc.model_id).result().checkpoints == []


def test_paths_stay_inside_the_state_dir(tinker_url, new_tenant):
    tc = new_tenant()
    run = tc.model_id
    for bad in ("../x", ".hidden", "a/b", "/etc/passwd"):
        with pytest.raises(tinker.BadRequestError, match="checkpoint name"):
            tc.save_state(bad).result()
    tc.save_state("ok").result()
    with pytest.raises(tinker.RequestFailedError, match="already exists"):
        tc.save_state("ok").result()
    tc.save_state("ok", overwrite=True).result()  # the refused ones consumed their seq_ids
    cases = [
        ("weights_info", {"tinker_path": "/etc/passwd"}, 400),
        ("weights_info", {"tinker_path": "tinker://../weights/ok"}, 400),
        ("weights_info", {"tinker_path": f"tinker://{run}/weights/../ok"}, 400),
        ("weights_info", {"tinker_path": f"tinker://{run}/weights/.."}, 400),
        ("weights_info", {"tinker_path": "tinker://other:train:0/weights/ok"}, 404),
        ("weights_info", {"tinker_path": f"tinker://{run}/weights/missing"}, 404),
        ("weights_info", {"tinker_path": f"tinker://{run}/weights/ok"}, 200),
        (
            "load_weights",
            {"path": f"tinker://{run}/sampler_weights/ok", "optimizer": False},
            400,
        ),
        (
            "load_weights",
            {"path": "tinker://nope:train:0/weights/ok", "session_id": "s", "model_seq_id": 0},
            404,
        ),
    ]
    for route, body, status in cases:
        r = _post(tinker_url, route, body)
        assert r.status_code == status, (route, body, r.text)
        if status != 200:
            assert r.json()["detail"], r.text
    base = f"{tinker_url}/api/v1/training_runs"
    assert httpx.delete(f"{base}/{run}/checkpoints/weights/a/b").status_code == 400
    assert httpx.delete(f"{base}/{run}/checkpoints/weights/missing").status_code == 404
    assert httpx.delete(f"{base}/other:train:0/checkpoints/weights/ok").status_code == 404
    assert httpx.get(f"{base}/..%2F..").status_code in (400, 404)
    assert httpx.get(f"{base}/other:train:0").status_code == 404


def test_unload_model_frees_one_tenant_and_leaves_the_other(tinker_url, new_tenant):
    kept, dropped = new_tenant(seed=1), new_tenant(seed=2)
    step(kept)
    before = loss(kept)
    dropped.save_state("kept-on-disk").result()
    r = _post(tinker_url, "unload_model", {"model_id": dropped.model_id})
    assert r.json() == {"model_id": dropped.model_id, "type": "unload_model"}
    assert _post(tinker_url, "get_info", {"model_id": dropped.model_id}).status_code == 404
    assert _post(tinker_url, "unload_model", {"model_id": dropped.model_id}).status_code == 404
    assert loss(kept) == before
    step(kept)
    assert loss(kept) < before
    # The run and its checkpoints outlive the tenant.
    checkpoints = (
        tinker.RestClient(base_url=tinker_url, api_key="tml-local")
        .list_checkpoints(dropped.model_id)
        .result()
        .checkpoints
    )
    assert [c.checkpoint_id for c in checkpoints] == ["weights/kept-on-disk"]


def test_unnamed_sampler_snapshots_are_pruned_to_the_newest_few(
    tinker_url, new_tenant, tinker_root
):
    from plies.server._tinker._samplers import KEEP_UNNAMED

    tc = new_tenant(seed=6)
    policies = tinker_root / "state" / "tinker" / tc.model_id.replace(":", "_") / "policies"
    prompt = types.ModelInput.from_ints(SEQ[:6])
    params = types.SamplingParams(max_tokens=2, seed=0)

    def samples(sampler) -> bool:
        return len(sampler.sample(prompt, 1, params).result().sequences[0].tokens) == 2

    named_path = tc.save_weights_for_sampler("kept").result().path
    named = tc.create_sampling_client(named_path).result()
    unnamed = [tc.save_weights_and_get_sampling_client().result() for _ in range(KEEP_UNNAMED + 2)]
    # One model copy per snapshot on disk: the named one and the newest unnamed ones.
    assert len([p for p in policies.iterdir() if p.name.isdigit()]) == 1 + KEEP_UNNAMED
    for old in unnamed[:2]:
        with pytest.raises(tinker.BadRequestError, match="unnamed sampler snapshot that was"):
            old.sample(prompt, 1, params).result()
    assert all(samples(s) for s in [named, *unnamed[2:]])
    # A deleted name makes its snapshot unnamed, and the oldest: it goes at once.
    tinker.RestClient(base_url=tinker_url, api_key="tml-local").delete_checkpoint_from_tinker_path(
        named_path
    ).result()
    with pytest.raises(tinker.BadRequestError, match="was deleted"):
        named.sample(prompt, 1, params).result()
    newest = tc.save_weights_and_get_sampling_client().result()
    with pytest.raises(tinker.BadRequestError, match="was deleted"):
        unnamed[2].sample(prompt, 1, params).result()
    assert samples(newest) and samples(unnamed[3])
    assert len([p for p in policies.iterdir() if p.name.isdigit()]) == KEEP_UNNAMED
