"""Hostile requests against a real `plies serve`: each gets a 4xx that says what was wrong,
and the server stays healthy. Also: a completion the client abandoned stops decoding."""

from __future__ import annotations

import json
import time

import httpx
import pytest

PROMPT = [9707, 11, 1879, 0]


@pytest.fixture
def http(policy_server):
    with httpx.Client(base_url=policy_server.url, timeout=60) as client:
        yield client


def completion(model: str, **fields) -> dict:
    return {"model": model, "prompt": PROMPT, "max_tokens": 2, **fields}


def refused(resp: httpx.Response, status: int, says: str) -> None:
    assert resp.status_code == status, resp.text
    assert says in resp.text, resp.text


def healthy(http: httpx.Client, model: str) -> None:
    ok = http.post("/v1/completions", json=completion(model))
    assert ok.status_code == 200, ok.text


@pytest.mark.parametrize(
    "raw,says",
    [
        ('{"prompt": [true]}', "valid integer"),
        ('{"prompt": ["5"]}', "valid integer"),
        ('{"seed": 18446744073709551616}', "less than or equal"),
        ('{"temperature": Infinity}', "finite number"),
        ('{"top_p": NaN}', "finite number"),
        ('{"temperature": 1e-45}', "temperature must be 0 (greedy) or at least"),
        ('{"stop_token_ids": [10000000]}', "stop token id 10000000 is outside the vocabulary"),
        ('{"max_tokens": 1000000000000}', "exceeds max_model_len"),
    ],
    ids=["bool-id", "string-id", "seed-2^64", "inf-temperature", "nan-top-p", "tiny-temp",
         "stop-id-vocab", "max-tokens"],
)  # fmt: skip
def test_bad_sampling_parameters_are_400(http, policy_server, raw, says):
    fields = json.loads(raw.replace("Infinity", '"INF"').replace("NaN", '"NAN"'))
    body = json.dumps(completion(policy_server.model, **fields))
    body = body.replace('"INF"', "Infinity").replace('"NAN"', "NaN")
    resp = http.post("/v1/completions", content=body, headers={"content-type": "application/json"})
    refused(resp, 400, says)
    generate = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2}}
    if "prompt" in fields:
        generate["input_ids"] = fields["prompt"]
        resp = http.post("/generate", json=generate)
        refused(resp, 400, "valid integer")
    healthy(http, policy_server.model)


def test_oversized_bodies_are_413_before_they_are_read_whole(http, policy_server):
    big = json.dumps(completion(policy_server.model, prompt=[1] * 400_000))  # ~1.2 MB
    refused(
        http.post("/v1/completions", content=big, headers={"content-type": "application/json"}),
        413,
        "exceeds the 1048576-byte limit of /v1/completions",
    )

    def chunks():  # no Content-Length: the cap must hold while reading, too
        yield b'{"model": "x", "prompt": ['
        for _ in range(300):
            yield b"1," * 4096
        yield b"1]}"

    resp = http.post(
        "/v1/completions", content=chunks(), headers={"content-type": "application/json"}
    )
    refused(resp, 413, "exceeds the 1048576-byte limit")
    refused(http.post("/api/v1/create_session", content=b"[" * 2_000_000), 413, "limit")
    healthy(http, policy_server.model)


def test_a_body_nested_100k_deep_is_400_not_500(http, policy_server):
    deep = b"[" * 100_000 + b"]" * 100_000
    for path in ("/v1/completions", "/v1/training/forward_backward", "/api/v1/retrieve_future"):
        resp = http.post(path, content=deep, headers={"content-type": "application/json"})
        assert resp.status_code == 400, (path, resp.status_code, resp.text[:300])
    healthy(http, policy_server.model)


def test_a_datum_longer_than_max_model_len_is_400(http, policy_server):
    n = 4097  # the server's --max-model-len is the default, 4096
    datum = {"tokens": [1] * n, "mask": [0] + [1] * (n - 1), "logprobs": [-1.0] * n,
             "advantages": [1.0] * n}  # fmt: skip
    body = {"op_id": "too-long", "batch": {"data": [datum]}}
    resp = http.post("/v1/training/forward_backward", json=body)
    refused(resp, 400, "datum 0 has 4097 tokens, over max_model_len 4096")
    assert http.get("/v1/training/ops/too-long").status_code == 404  # never applied


def test_an_abandoned_completion_stops_decoding(policy_server):
    """A client that times out leaves; its row leaves the engine within a step or two."""
    body = completion(policy_server.model, max_tokens=4000, ignore_eos=True, temperature=1.0)
    with httpx.Client(base_url=policy_server.url, timeout=60) as http:
        before = http.get("/plies/stats").json()["tokens_generated"]
        with pytest.raises(httpx.ReadTimeout):
            http.post("/v1/completions", json=body, timeout=httpx.Timeout(60, read=1.0))
        deadline = time.monotonic() + 3.0
        stats = http.get("/plies/stats").json()
        while stats["running"] + stats["waiting"] and time.monotonic() < deadline:
            time.sleep(0.05)
            stats = http.get("/plies/stats").json()
        assert stats["running"] == 0 and stats["waiting"] == 0, stats
        time.sleep(0.5)  # and it stays stopped: no token is made for nobody
        after = http.get("/plies/stats").json()["tokens_generated"]
        assert after == stats["tokens_generated"] and after - before < 4000, (before, after)
        ok = http.post("/v1/completions", json=completion(policy_server.model))
        assert ok.status_code == 200
