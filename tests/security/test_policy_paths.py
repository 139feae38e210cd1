"""Paths a client names: confined to the state directory (and what the operator allows), no
symlink escapes, no forged policies, no file-content oracle; a damaged journal is one clear
error, not a 500 on every route."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import httpx
import pytest

from plies.server import PolicyStore
from plies.testing._models import build_tiny_model

SECRET = "SECRET-CONTENT-the-server-must-never-echo"


@pytest.fixture(scope="module")
def layout(tmp_path_factory, tiny_model_dir):
    root = tmp_path_factory.mktemp("paths")
    other = build_tiny_model(root / "other-model", seed=1)
    outside = PolicyStore.open(root / "outside", other).get(0)
    allowed = PolicyStore.open(root / "allowed", other).get(0)
    (root / "secret.txt").write_text(SECRET)
    return {"root": root, "other": other, "outside": outside, "allowed": allowed}


@pytest.fixture(scope="module")
def server(start_policy_server, tiny_model_dir, layout):
    state = layout["root"] / "state"
    with start_policy_server(
        tiny_model_dir, state, "--allow-path", str(layout["root"] / "allowed")
    ) as srv:
        yield srv


def load(server, name: str, path: Path | str) -> httpx.Response:
    body = {"lora_name": name, "lora_path": str(path)}
    return httpx.post(f"{server.url}/v1/load_lora_adapter", json=body, timeout=60)


def refused(resp: httpx.Response, says: str) -> None:
    assert resp.status_code == 400, resp.text
    assert says in resp.json()["error"]["message"], resp.text
    assert SECRET not in resp.text


def test_a_policy_outside_the_state_dir_is_refused_unless_allowed(server, layout):
    from plies.policy._paths import policy_path

    refused(load(server, "out", policy_path(layout["outside"])), "is outside the directories")
    refused(load(server, "nowhere", layout["root"] / "missing"), "does not exist")
    ok = load(server, "allowed", policy_path(layout["allowed"]))
    assert ok.status_code == 200, ok.text
    assert ok.json()["plies_policy"]["digest"] == layout["allowed"].digest


def test_a_symlink_out_of_the_state_dir_is_refused(server, layout):
    from plies.policy._paths import policy_path

    link = server.state_dir / "escape"
    link.symlink_to(policy_path(layout["outside"]), target_is_directory=True)
    refused(load(server, "escape", link), "is outside the directories")
    inner = server.state_dir / "inner-link"
    shutil.copytree(server.state_dir / "policies" / "0", inner)
    weights = inner / "model.safetensors"
    weights.unlink()
    weights.symlink_to(server.state_dir / "policies" / "0" / "model.safetensors")
    refused(load(server, "inner", inner), "holds symbolic links (model.safetensors)")


def test_a_forged_policy_is_refused(server, layout):
    forged = server.state_dir / "forged"
    shutil.copytree(server.state_dir / "policies" / "0", forged)  # policy.json says v0
    shutil.copy(layout["other"] / "model.safetensors", forged / "model.safetensors")
    refused(load(server, "policy-0-forged", forged), "a forged or damaged policy")
    honest = server.state_dir / "honest"
    shutil.copytree(server.state_dir / "policies" / "0", honest)
    ok = load(server, "honest", honest)
    assert ok.status_code == 200, ok.text
    assert ok.json()["plies_policy"] == server.policy


@pytest.mark.parametrize("kind", ["symlink", "directory", "garbage"])
def test_a_policy_json_that_is_not_a_file_is_400_and_echoes_nothing(server, layout, kind):
    probe = server.state_dir / f"probe-{kind}"
    shutil.copytree(server.state_dir / "policies" / "0", probe)
    ref = probe / "policy.json"
    ref.unlink()
    if kind == "symlink":
        ref.symlink_to(layout["root"] / "secret.txt")
        refused(load(server, kind, probe), "is a symbolic link")
    elif kind == "directory":
        ref.mkdir()
        refused(load(server, kind, probe), "cannot be read")
    else:
        ref.write_text(SECRET)
        refused(load(server, kind, probe), "is not a valid PolicyRef")
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_a_damaged_journal_is_a_clear_error_and_sampling_goes_on(
    start_policy_server, tiny_model_dir, tmp_path
):
    state = tmp_path / "state"
    (state / "trainer").mkdir(parents=True)
    journal = state / "trainer" / "journal.jsonl"
    journal.write_bytes(b'{"op_id": "a", "kind": "save_policy"\n')  # whole, but not JSON
    with (
        start_policy_server(tiny_model_dir, state) as srv,
        httpx.Client(base_url=srv.url, timeout=60) as http,
    ):
        for method, path in (("GET", "/v1/training/state"), ("GET", "/v1/training/ops/a"),
                             ("POST", "/v1/training/save_policy")):  # fmt: skip
            resp = http.request(method, path, json={"op_id": "b"} if method == "POST" else None)
            assert resp.status_code == 503, (path, resp.text)
            error = resp.json()["error"]
            assert error["code"] == "trainer_broken"
            assert f"{journal}:1 is not a journal record" in error["message"]
        body = {"model": srv.model, "prompt": [1, 2], "max_tokens": 2}
        assert http.post("/v1/completions", json=body).status_code == 200
    assert journal.read_bytes().startswith(b'{"op_id": "a"')  # left as it was, for repair
    assert os.path.getsize(journal) > 0
