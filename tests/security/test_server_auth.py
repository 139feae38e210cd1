"""The token of `plies serve` and `plies gateway`: refused beyond loopback without one; with
one, nothing but the health checks answers a request that does not carry it."""

from __future__ import annotations

import json
import subprocess

import httpx
import openai
import pytest

from plies.testing import plies_command, serve_process_sync

TOKEN = "tml-" + "s3cret-test-token-0123456789"
"""The tinker SDK insists its api key starts with `tml-`; the server takes any 16+ chars."""


def run_plies(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(plies_command(*args), capture_output=True, text=True, timeout=120)


def one_line_refusal(done: subprocess.CompletedProcess[str], says: str) -> None:
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert "Traceback" not in done.stderr and says in done.stderr, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "example.com"])
def test_serve_beyond_loopback_without_a_token_is_refused(tiny_model_dir, host):
    done = run_plies("serve", str(tiny_model_dir), "--host", host)
    one_line_refusal(done, f"--host {host} reaches beyond this machine")


def test_a_short_token_is_refused_without_echoing_it(tiny_model_dir):
    done = run_plies("serve", str(tiny_model_dir), "--token", "hunter2")
    one_line_refusal(done, "token: Value should have at least 16")
    assert "hunter2" not in done.stderr


def test_gateway_beyond_loopback_without_a_token_is_refused(qwen3_tokenizer_dir):
    done = run_plies(
        "gateway", "--sampler", "http://127.0.0.1:9", "--tokenizer", str(qwen3_tokenizer_dir),
        "--host", "0.0.0.0", "--model", "m",
    )  # fmt: skip
    one_line_refusal(done, "--host 0.0.0.0 reaches beyond this machine")


@pytest.fixture(scope="module")
def token_server(start_policy_server, tiny_model_dir, tmp_path_factory):
    state = tmp_path_factory.mktemp("token-server") / "state"
    with start_policy_server(
        tiny_model_dir, state, "--token", TOKEN, "--model-name", "tiny/qwen3"
    ) as server:
        yield server


STATE_CHANGING = [
    ("POST", "/v1/training/forward_backward", {}),
    ("POST", "/v1/training/optim_step", {}),
    ("POST", "/v1/training/save_policy", {"op_id": "x"}),
    ("GET", "/v1/training/state", None),
    ("POST", "/v1/load_lora_adapter", {"lora_name": "a", "lora_path": "/"}),
    ("POST", "/v1/unload_lora_adapter", {"lora_name": "policy-0"}),
    ("POST", "/api/v1/create_session", {}),
    ("POST", "/api/v1/create_model", {}),
    ("POST", "/v1/completions", {}),
    ("GET", "/v1/models", None),
]


def test_every_route_but_health_needs_the_token(token_server):
    wrong = [
        {},
        {"authorization": "Bearer " + TOKEN[:-1] + "x"},
        {"authorization": "Basic " + TOKEN},
        {"x-api-key": TOKEN[:-1]},
    ]
    with httpx.Client(base_url=token_server.url, timeout=30) as http:
        for method, path, body in STATE_CHANGING:
            for headers in wrong:
                resp = http.request(method, path, json=body, headers=headers)
                assert resp.status_code == 401, (method, path, headers, resp.text)
                assert "needs its token" in resp.json()["error"]["message"]
        assert http.get("/health").status_code == 200
        assert http.get("/api/v1/healthz").status_code == 200
        # The policy is still the one it started with: nothing was unloaded.
        ok = http.get("/v1/models", headers={"authorization": f"Bearer {TOKEN}"})
        assert [m["id"] for m in ok.json()["data"]] == ["policy-0"]
        ok = http.get("/v1/models", headers={"x-api-key": TOKEN})
        assert ok.status_code == 200


def test_clients_work_with_the_token(token_server):
    import anyio

    from plies.policy import SamplingParams, VLLMClient

    async def sample() -> list[int]:
        headers = {"Authorization": f"Bearer {TOKEN}"}
        async with VLLMClient(token_server.url, token_server.model, headers=headers) as client:
            return (await client.sample([1, 2, 3], SamplingParams(max_tokens=3))).ids

    assert len(anyio.run(sample)) <= 3


def test_the_tinker_sdk_works_with_the_token_as_its_api_key(token_server, monkeypatch):
    tinker = pytest.importorskip("tinker")
    monkeypatch.setenv("TINKER_BASE_URL", token_server.url)
    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    monkeypatch.setenv("TINKER_API_KEY", TOKEN)
    models = tinker.RestClient().get_server_capabilities().result().supported_models
    assert [m.model_name for m in models] == ["tiny/qwen3"]


def test_gateway_with_its_own_token_in_front_of_a_token_server(
    token_server, qwen3_tokenizer_dir, tmp_path, monkeypatch
):
    """The admin token comes from the environment, as in issue 32's finding (the gateway
    printed it on its ready line all the same): a token the user gave is printed nowhere,
    neither on stdout's ready line nor in the log."""
    admin = "gateway-admin-token-0123456789"
    monkeypatch.setenv("PLIES_TOKEN", TOKEN)  # the policy server's, read as --sampler-token
    monkeypatch.setenv("PLIES_GATEWAY_TOKEN", admin)  # read as --token
    cmd = plies_command("gateway", "--sampler", token_server.url)
    cmd += ["--tokenizer", str(qwen3_tokenizer_dir), "--max-tokens", "4"]
    log = tmp_path / "gateway.log"
    with serve_process_sync(cmd, log=log) as gateway:
        assert "admin_token" not in gateway.ready  # a token the user gave is never printed
        assert admin not in json.dumps(gateway.ready)
        with httpx.Client(base_url=gateway.url, timeout=60) as http:
            auth = {"authorization": f"Bearer {admin}"}
            assert http.post("/sessions", headers={"authorization": "Bearer no"}).status_code == 401
            key = http.post("/sessions", json={"task_id": "t"}, headers=auth).json()["key"]
            with openai.OpenAI(base_url=gateway.url, api_key=key, max_retries=0) as client:
                reply = client.chat.completions.create(
                    model="any", messages=[{"role": "user", "content": "hi"}]
                )
            assert reply.usage.completion_tokens <= 4
    assert admin not in log.read_text(errors="replace")
