"""Hostile or unlucky requests through a real `plies gateway` process: each is a 4xx or a
clear 5xx naming the cause, and the gateway stays healthy."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator

import httpx
import pytest

from plies.testing import ServerProcess, closed_url, plies_command, serve_process_sync

HELLO = [{"role": "user", "content": "hello"}]


def gateway(sampler: str, tokenizer_dir, log, *args: str) -> Iterator[ServerProcess]:
    cmd = plies_command("gateway", "--sampler", sampler, "--tokenizer", str(tokenizer_dir))
    with serve_process_sync([*cmd, *args], log=log) as gw:
        yield gw


@pytest.fixture(scope="module")
def gw(policy_server, qwen3_tokenizer_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("gateway-abuse") / "gateway.log"
    # A cap past the server's context, so that the server is the one to refuse a long turn.
    yield from gateway(policy_server.url, qwen3_tokenizer_dir, log, "--max-tokens", "100000")


@contextlib.contextmanager
def session(gw) -> Iterator[tuple[httpx.Client, dict[str, str]]]:
    """A client of the gateway, and the headers of a fresh session."""
    with httpx.Client(base_url=gw.url, timeout=60) as http:
        admin = {"authorization": f"Bearer {gw.ready['admin_token']}"}
        key = http.post("/sessions", json={}, headers=admin).json()["key"]
        yield http, {"authorization": f"Bearer {key}", "content-type": "application/json"}


def chat(http: httpx.Client, headers, body: bytes | dict) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return http.post("/chat/completions", content=content, headers=headers)


def health(http: httpx.Client) -> int:
    return http.get(str(http.base_url).removesuffix("/v1/") + "/health").status_code


def still_serves(http: httpx.Client, headers) -> None:
    assert health(http) == 200
    ok = chat(http, headers, {"messages": HELLO, "max_tokens": 2})
    assert ok.status_code == 200, ok.text


def error_of(resp: httpx.Response, status: int, says: str) -> None:
    assert resp.status_code == status, resp.text[:500]
    assert says in resp.json()["error"]["message"], resp.text[:500]


def test_a_body_over_the_cap_is_413(gw):
    with session(gw) as (http, headers):
        huge = {"messages": [{"role": "user", "content": "x" * (9 << 20)}]}
        error_of(chat(http, headers, huge), 413, "exceeds the gateway's 8388608-byte limit")
        still_serves(http, headers)


def test_a_body_nested_100k_deep_is_400(gw):
    with session(gw) as (http, headers):
        deep = b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
        error_of(chat(http, headers, deep), 400, "nested too deeply")
        still_serves(http, headers)


def test_a_seed_past_2_to_the_64_is_400(gw):
    with session(gw) as (http, headers):
        body = {"messages": HELLO, "max_tokens": 2, "seed": 1 << 64}
        error_of(chat(http, headers, body), 400, "less than or equal to 18446744073709551615")
        still_serves(http, headers)


def test_a_request_the_sampler_refuses_is_400_not_502(gw):
    with session(gw) as (http, headers):
        body = {"messages": HELLO, "max_tokens": 100_000}  # the context is 4096
        error_of(chat(http, headers, body), 400, "exceeds max_model_len 4096")
        still_serves(http, headers)


def test_an_unreachable_sampler_is_a_clear_503_and_the_gateway_stays_up(
    qwen3_tokenizer_dir, tmp_path
):
    dead = closed_url()
    for gw in gateway(dead, qwen3_tokenizer_dir, tmp_path / "gw.log", "--model", "policy-0"):
        with session(gw) as (http, headers):
            for _ in range(2):
                resp = chat(http, headers, {"messages": HELLO, "max_tokens": 2})
                error_of(resp, 503, f"cannot connect to {dead}")
                assert resp.json()["error"]["type"] == "service_unavailable"
            assert health(http) == 200


def test_gateway_without_model_and_an_unreachable_sampler_is_one_line(
    qwen3_tokenizer_dir,
):
    import subprocess

    cmd = plies_command("gateway", "--sampler", "http://127.0.0.1:9")
    done = subprocess.run(
        [*cmd, "--tokenizer", str(qwen3_tokenizer_dir)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2, done.stderr
    assert "cannot list the models of http://127.0.0.1:9; pass --model" in done.stderr
    assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1
