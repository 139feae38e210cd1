"""The standing adversarial suite of `plies serve`: every hostile request found so far, replayed
against a real server, each refused with a clear 4xx (or served correctly), and the property
that holds during each one: `/health` answers within 200 ms, and the server's peak resident
memory grows by at most 500 MB.

The server runs with a short Tinker gap (so a wedged queue shows within seconds) and a
trainer checkpoint at every step (so the weights and Adam moments can be read after each
optimizer setting). Hostile requests are raw HTTP; the client that must keep working is the
official `tinker` SDK.
"""

from __future__ import annotations

import contextlib
import io
import json
import random
import socket
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from plies import testing

tinker = pytest.importorskip("tinker")
zstandard = pytest.importorskip("zstandard")
from tinker import types  # noqa: E402
from tinker.proto import tinker_public_pb2 as pb  # noqa: E402

pytestmark = pytest.mark.serial
"""`/health`'s 200 ms is a stall of the server's loop, measured alone: beside two other tests
on two cores, the scheduler alone delayed one answer to 210 ms in a CI run."""

MODEL_NAME = "tiny/qwen3"
GAP_SECONDS = 1.0
HEALTH_BUDGET_S = 0.2
MEMORY_BUDGET = 500 << 20
TOKENS = [9707, 11, 1879, 0, 151644, 872, 198, 3838]

SERVE = """
import sys
from plies.server._serve import serve
raise SystemExit(serve(
    model_dir=sys.argv[1], state_dir=sys.argv[2], model_name=sys.argv[3], threads=1,
    tinker={"gap_seconds": float(sys.argv[4])}, trainer={"checkpoint_seconds": 0.0},
))
"""


@dataclass
class Server:
    url: str
    pid: int
    state: Path
    http: httpx.Client


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory) -> Iterator[Server]:
    root = tmp_path_factory.mktemp("hostile")
    argv = [sys.executable, "-c", SERVE, str(tiny_model_dir), str(root / "state"), MODEL_NAME]
    argv.append(str(GAP_SECONDS))
    with (
        testing.serve_process_sync(argv, log=root / "serve.log", ready_timeout=180) as proc,
        httpx.Client(base_url=proc.url, timeout=60) as http,
    ):
        yield Server(proc.url, proc.pid, root / "state", http)


def _status(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no {key} for {pid}")


@dataclass
class Watch:
    worst_health_s: float = 0.0
    polls: int = 0
    growth: int = 0
    errors: list[str] = field(default_factory=list)


@contextlib.contextmanager
def hostile(server: Server) -> Iterator[Watch]:
    """Hold the property during the block: `/health` polled every 20 ms answers within 200 ms,
    and the peak RSS (`VmHWM`, reset at the start) exceeds the RSS at the start by at most
    500 MB.

    A poll that fails or times out counts as a breach, with the time it waited: the poller
    must not die quietly, or a loop frozen past the client's timeout would leave no slow
    answer on record and pass (the server before issue 32 did exactly that while it cut a
    20,000-stop-string sample on its loop)."""
    watch = Watch()
    before = _status(server.pid, "VmRSS")
    Path(f"/proc/{server.pid}/clear_refs").write_text("5")  # resets VmHWM to the RSS now
    stop, polling = threading.Event(), threading.Event()

    def poll() -> None:
        with httpx.Client(base_url=server.url, timeout=10) as http:
            http.get("/health")  # connected before the request: only answers are timed
            while not stop.is_set():
                started = time.monotonic()
                try:
                    status = http.get("/health").status_code
                except httpx.HTTPError as exc:
                    status = f"no answer ({type(exc).__name__})"
                took = time.monotonic() - started
                if status != 200:
                    watch.errors.append(f"/health: {status} after {took:.2f} s")
                watch.worst_health_s = max(watch.worst_health_s, took)
                watch.polls += 1
                polling.set()
                stop.wait(0.02)

    thread = threading.Thread(target=poll, daemon=True)
    thread.start()
    assert polling.wait(30), "/health never answered"
    try:
        yield watch
    finally:
        stop.set()
        thread.join(15)
    if thread.is_alive():
        watch.errors.append("/health still unanswered 15 s after the request")
    watch.growth = _status(server.pid, "VmHWM") - before
    assert not watch.errors, watch.errors
    assert watch.worst_health_s < HEALTH_BUDGET_S, watch
    assert watch.growth < MEMORY_BUDGET, f"peak RSS grew by {watch.growth >> 20} MiB"


# -- raw Tinker calls --------------------------------------------------------------------------


def post(server: Server, path: str, **kw) -> httpx.Response:
    return server.http.post(f"/api/v1/{path}", **kw)


def result(server: Server, answer: httpx.Response) -> dict:
    assert answer.status_code == 200, answer.text
    rid = answer.json()["request_id"]
    while True:
        got = post(server, "retrieve_future", json={"request_id": rid})
        if got.status_code != 408:
            assert got.status_code == 200, got.text
            return got.json() if "json" in got.headers["content-type"] else {"proto": got.content}


@dataclass
class Tenant:
    model_id: str
    seq: int = 1

    def next(self) -> int:
        self.seq += 1
        return self.seq - 1


def new_tenant(server: Server) -> Tenant:
    session = post(server, "create_session", json={}).json()["session_id"]
    body = {"session_id": session, "model_seq_id": 0, "base_model": MODEL_NAME,
            "lora_config": {"rank": 4, "seed": 0}}  # fmt: skip
    return Tenant(result(server, post(server, "create_model", json=body))["model_id"])


def fb_request(model_id: str, seq: int, tokens=TOKENS, *, target=None, weights=None) -> bytes:
    msg = pb.ForwardBackwardRequest(model_id=model_id, seq_id=seq, loss_fn="cross_entropy")
    d = msg.data.add()
    d.model_input.add().encoded_text.tokens = np.array(tokens[:-1], np.int32).tobytes()
    t = d.loss_fn_inputs["target_tokens"]
    if target is None:
        t.dtype, t.dense = pb.DTYPE_INT64, np.array(tokens[1:], np.int64).tobytes()
        t.shape.append(len(tokens) - 1)
    else:
        t.CopyFrom(target)
    if weights is not None:
        w = d.loss_fn_inputs["weights"]
        w.dtype, w.dense = pb.DTYPE_FLOAT32, np.asarray(weights, np.float32).tobytes()
        w.shape.append(len(tokens) - 1)
    return msg.SerializeToString()


def empty_sparse(rows: int, cols: int) -> pb.Tensor:
    """A CSR tensor of shape [rows, cols] with no values: a few bytes on the wire."""
    t = pb.Tensor(dtype=pb.DTYPE_INT64)
    t.shape.extend([rows, cols])
    t.sparse_csr.crow_indices = np.zeros(rows + 1, np.int64).tobytes()
    return t


def refused(resp: httpx.Response, status: int, says: str) -> None:
    assert resp.status_code == status, resp.text[:500]
    assert says in resp.text, resp.text[:500]
    assert len(resp.content) < 4000, len(resp.content)  # nothing unbounded quoted back


# -- 1. tensors declared far larger than their bytes ---------------------------------------------


def test_a_sparse_tensor_declaring_gigabytes_is_refused_before_it_is_built(server):
    tenant = new_tenant(server)
    rows = len(TOKENS) - 1
    cases = [
        (empty_sparse(rows, 1 << 24), "K = 16777216, outside [1, 151936]"),  # the 185-byte case
        (empty_sparse(rows + 1, 4), "has 8 rows for 7 input tokens"),
        (empty_sparse(rows, 151936), None),  # [7, vocab]: within every bound, answered
    ]
    for target, says in cases:
        body = fb_request(tenant.model_id, tenant.next(), target=target)
        with hostile(server):
            resp = post(server, "forward_backward", content=body)
            if says is None:
                out = result(server, resp)
                assert "proto" in out and len(out["proto"]) < 5 << 20
            else:
                refused(resp, 400, says)
    one = pb.ForwardBackwardRequest.FromString(fb_request(tenant.model_id, tenant.next()))
    weights = empty_sparse(rows, 1 << 24)
    weights.dtype = pb.DTYPE_FLOAT32
    one.data[0].loss_fn_inputs["weights"].CopyFrom(weights)
    with hostile(server):  # a weights tensor wider than its targets is not built either
        refused(post(server, "forward_backward", content=one.SerializeToString()), 400,
                "has shape [7, 16777216], expected [7]")  # fmt: skip
    wide = pb.ForwardBackwardRequest.FromString(
        fb_request(tenant.model_id, tenant.next(), target=empty_sparse(rows, 151936))
    )
    wide.data.extend([wide.data[0]] * 4)  # 5 x 7 x 151936 targets: 21 MB of float32 logprobs
    with hostile(server):
        refused(post(server, "forward_backward", content=wide.SerializeToString()), 400,
                "would exceed 16777216 bytes")  # fmt: skip
    # Every refusal consumed its seq_id, and nothing large reached the tenant's op log.
    body = fb_request(tenant.model_id, tenant.next())
    assert "proto" in result(server, post(server, "forward_backward", content=body))
    run = next(p for p in (server.state / "tinker").iterdir() if (p / "ops.jsonl").is_file()
               and tenant.model_id in (p / "run.json").read_text())  # fmt: skip
    assert (run / "ops.jsonl").stat().st_size < 8 << 20  # the [7, vocab] answer is 5.7 MB


# -- 2. compressed bodies ---------------------------------------------------------------------


def zstd_bomb(prefix: bytes, filler: bytes, size: int, suffix: bytes) -> bytes:
    """A zstd frame that declares (and holds) `size` bytes: prefix, filler repeated, suffix."""
    out = io.BytesIO()
    total = len(prefix) + size + len(suffix)
    with zstandard.ZstdCompressor(level=1).stream_writer(out, size=total, closefd=False) as writer:
        writer.write(prefix)
        chunk = filler * ((1 << 20) // len(filler))
        for _ in range(size // len(chunk)):
            writer.write(chunk)
        writer.write(suffix)
    return out.getvalue()


@pytest.fixture(scope="module")
def gigabyte_model_id() -> bytes:
    """The issue's 32.8 KB request: `{"model_id": "AAA...(1 GiB)"}`, zstd."""
    return zstd_bomb(b'{"model_id": "', b"A", 1 << 30, b'"}')


BODY_ROUTES = ["get_info", "asample", "unload_model", "weights_info", "create_model",
               "optim_step", "save_weights", "save_weights_for_sampler", "load_weights",
               "create_sampling_session", "retrieve_future", "forward_backward"]  # fmt: skip


def test_zstd_bodies_are_decompressed_under_the_cap_whatever_their_frame_declares(
    server, gigabyte_model_id
):
    assert len(gigabyte_model_id) < 64 << 10
    zstd = {"content-encoding": "zstd", "content-type": "application/json"}
    for route in BODY_ROUTES:
        with hostile(server):
            resp = post(server, route, content=gigabyte_model_id, headers=zstd)
            refused(resp, 413, "the decompressed request body exceeds the")
    whole = zstandard.ZstdCompressor().compress(json.dumps({"model_id": "m" * 5000}).encode())
    cut = post(server, "get_info", content=whole[:-4], headers=zstd)
    refused(cut, 400, "the zstd body ends inside a frame")  # not silently a prefix
    refused(post(server, "get_info", content=b"{}", headers={"content-encoding": "br"}), 415,
            "Content-Encoding 'br' is not supported")  # fmt: skip
    # An honest zstd body still works, on the JSON routes and on forward_backward.
    tenant = new_tenant(server)
    body = zstandard.ZstdCompressor().compress(json.dumps({"model_id": tenant.model_id}).encode())
    info = post(server, "get_info", content=body, headers=zstd)
    assert info.status_code == 200 and info.json()["model_id"] == tenant.model_id, info.text
    fb = zstandard.ZstdCompressor().compress(fb_request(tenant.model_id, tenant.next()))
    assert "proto" in result(server, post(server, "forward_backward", content=fb, headers=zstd))


def test_errors_quote_a_long_id_cut_short(server):
    long_id = "m" * 500_000
    for route in ("get_info", "unload_model"):
        refused(post(server, route, json={"model_id": long_id}), 404, "(500000 characters)")


# -- 3. stop strings ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sampler_id(server) -> str:
    session = post(server, "create_session", json={}).json()["session_id"]
    body = {"session_id": session, "sampling_session_seq_id": 0, "base_model": MODEL_NAME}
    resp = post(server, "create_sampling_session", json=body)
    return resp.json()["sampling_session_id"]


def asample(sampler_id: str, n: int, max_tokens: int, stop) -> dict:
    return {
        "sampling_session_id": sampler_id,
        "num_samples": n,
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": TOKENS}]},
        "sampling_params": {"max_tokens": max_tokens, "seed": 3, "stop": stop},
    }


def test_stop_strings_are_bounded(server, sampler_id):
    many = [f"<stop{i}>" for i in range(20_000)]
    with hostile(server):
        refused(post(server, "asample", json=asample(sampler_id, 16, 200, many)), 400,
                "20000 stop strings; at most 32")  # fmt: skip
    refused(post(server, "asample", json=asample(sampler_id, 1, 8, ["x" * 257])), 400,
            "has 257 characters; 1 to 256")  # fmt: skip
    refused(post(server, "asample", json=asample(sampler_id, 1, 8, [""])), 400,
            "has 0 characters")  # fmt: skip


def test_a_stop_string_that_never_matches_keeps_the_server_responsive(server, sampler_id):
    """The issue's case scaled down to CI: 8 samples that all run to 500 tokens, searched for
    the most strings taken (32), one of them the longest taken (256 characters).

    The server before issue 32 decoded every prefix of each sample on the event loop: at this
    size `/health` waited 0.54 s there (measured against that commit), so the property fails
    on it; the cut now runs off the loop in one pass (its linear time and its agreement with
    the shortest-prefix definition are in tests/tinker/test_stop_strings.py). Few samples,
    long ones: the old cost grows with the square of a sample's length, sampling time only
    linearly, so this is a cheap size that fails the old code with a margin (16 samples
    of 120 tokens blocked it for 70 ms, and passed)."""
    samples, length = 8, 500
    longest = ("</answer>" * 29)[:256]
    stops = ["</answer>", longest, *(f"<stop{i}>" for i in range(30))]
    with hostile(server):
        body = asample(sampler_id, samples, length, stops)
        got = result(server, post(server, "asample", json=body))
    response = pb.SampleResponse.FromString(got["proto"])
    assert len(response.sequences) == samples
    assert all(len(s.tokens) // 4 == length for s in response.sequences)  # none was cut


# -- 4. seq_ids far ahead ------------------------------------------------------------------------


def test_a_stray_seq_id_far_ahead_is_refused_and_never_moves_the_queue(server):
    with tinker.ServiceClient(base_url=server.url, api_key="tml-local") as client:
        training = client.create_lora_training_client(base_model=MODEL_NAME, rank=4, seed=0)
        training = training.result() if hasattr(training, "result") else training
        datum = types.Datum(
            model_input=types.ModelInput.from_ints(TOKENS[:-1]),
            loss_fn_inputs={"target_tokens": TOKENS[1:]},
        )
        training.forward_backward([datum], "cross_entropy").result()
        stray = 2**31 - 1
        adam = {"learning_rate": 1e-4}
        for body in (
            {"model_id": training.model_id, "seq_id": stray, "adam_params": adam},  # valid
            {"model_id": training.model_id, "seq_id": stray - 1},  # refused for its body too
        ):
            with hostile(server):
                refused(post(server, "optim_step", json=body), 400, "")
        resp = post(server, "optim_step", json={"model_id": training.model_id, "seq_id": stray,
                                                "adam_params": adam})  # fmt: skip
        refused(resp, 400, f"seq_id {stray} of model {training.model_id} is more than 1024")
        time.sleep(GAP_SECONDS * 2.5)  # a queued stray would now have moved the queue past 2^31
        training.optim_step(types.AdamParams(learning_rate=1e-4)).result()
        out = training.forward_backward([datum], "cross_entropy").result()
        assert np.isfinite(out.metrics["loss:sum"])


# -- 5. optimizer settings on both wires ---------------------------------------------------------


def all_finite(directory: Path) -> None:
    """Every floating tensor in the weight (`*.safetensors`) and state (`*.pt`) files under
    `directory` is finite."""
    tensors: list[torch.Tensor] = []

    def walk(obj) -> None:
        if isinstance(obj, torch.Tensor):
            tensors.append(obj)
        elif isinstance(obj, dict):
            for v in obj.values():
                walk(v)
        elif isinstance(obj, list | tuple):
            for v in obj:
                walk(v)

    files = sorted(directory.rglob("*.safetensors")) + sorted(directory.rglob("*.pt"))
    assert files, directory
    for f in files:
        walk(load_file(f) if f.suffix == ".safetensors" else torch.load(f, weights_only=True))
    bad = [t for t in tensors if t.is_floating_point() and not torch.isfinite(t).all()]
    assert not bad, f"{len(bad)} tensors under {directory} are not finite"


EXTREMES = {
    "lr": [0.0, 1e-45, 1e-6, 1e-2, 1.0, 10.0, 1e3, 1e39, 1e308],
    "eps": [1e-300, 1e-45, 1e-20, 1e-12, 1e-8, 1.0, 1e30],
    "weight_decay": [0.0, 1e-2, 0.1, 1.0, 1e3, 1e38, 1e308],
    "beta1": [0.0, 0.5, 0.9, 1 - 1e-7, 1 - 1e-12, 1 - 1e-17],
    "beta2": [0.0, 0.5, 0.95, 1 - 1e-7, 1 - 1e-12, 1 - 1e-17],
    "grad_clip": [0.0, 1e-300, 1.0, 1e300],
    "scale": [1.0, 1e6, 1e15, 1e30],  # the size of the gradients
}
SANE = {
    "lr": [1e-4, 1e-2, 1.0],
    "eps": [1e-12, 1e-8],
    "weight_decay": [0.0, 0.1],
    "beta1": [0.0, 0.9],
    "beta2": [0.95, 0.999],
    "grad_clip": [0.0, 1.0],
    "scale": [1.0, 1e6, 1e15, 1e30],
}
STEPS = 20
NATIVE_STEPS = 12
"""Each native step that stands writes a checkpoint of the whole model, so fewer of them."""


def draws(seed: int) -> list[dict]:
    """The issue's three settings, then `STEPS` random ones: each value extreme (any of
    `EXTREMES`) or ordinary (`SANE`) by a coin."""
    rng = random.Random(seed)
    fixed = [
        {"lr": 1e-3, "eps": 1e-300, "weight_decay": 0.0},
        {"lr": 1e-3, "weight_decay": 1e308},
        {"lr": 1e39},
    ]
    drawn = [
        {k: rng.choice(EXTREMES[k] if rng.random() < 0.4 else SANE[k]) for k in EXTREMES}
        for _ in range(STEPS)
    ]
    base = {k: v[0] for k, v in SANE.items()}
    return [{**base, **f} for f in fixed] + drawn


def test_no_accepted_optimizer_setting_leaves_a_non_finite_weight_on_the_native_wire(server):
    trainer = server.state / "trainer"
    n = len(TOKENS)
    accepted = refused_ = 0
    for k, s in enumerate(draws(seed=20261205)[:NATIVE_STEPS]):
        datum = {"tokens": TOKENS, "mask": [0] + [1] * (n - 1), "logprobs": [-1.0] * n,
                 "advantages": [min(s["scale"], 1e6)] * n}  # fmt: skip
        fb = server.http.post("/v1/training/forward_backward",
                              json={"op_id": f"n{k}-fb", "batch": {"data": [datum]}})  # fmt: skip
        if fb.status_code != 200:
            assert fb.status_code in (400, 409), fb.text
            continue
        adam = {"lr": s["lr"], "beta1": s["beta1"], "beta2": s["beta2"], "eps": s["eps"],
                "weight_decay": s["weight_decay"]}  # fmt: skip
        if s["grad_clip"] > 0:
            adam["grad_clip"] = s["grad_clip"]
        with hostile(server):
            step = server.http.post(
                "/v1/training/optim_step",
                json={"op_id": f"n{k}-opt", "adam": adam, "forward_backward_ops": [f"n{k}-fb"]},
            )
        assert step.status_code in (200, 400, 409, 422), (s, step.text)
        if step.status_code == 400:  # refused before anything: the gradients are dropped next
            server.http.post(
                "/v1/training/optim_step",
                json={"op_id": f"n{k}-drop", "adam": {"lr": 1e-9}, "forward_backward_ops": []},
            )
        checkpoints = trainer / "checkpoints"
        if (checkpoints / "CURRENT").exists():
            all_finite(checkpoints / (checkpoints / "CURRENT").read_text().strip())
        accepted += step.status_code == 200
        refused_ += step.status_code != 200
    assert accepted >= 3 and refused_ >= 3, (accepted, refused_)
    saved = server.http.post("/v1/training/save_policy", json={"op_id": "n-save"})
    assert saved.status_code == 200, saved.text
    all_finite(Path(saved.json()["policy"]["uri"].removeprefix("file://")))


def test_no_accepted_optimizer_setting_leaves_a_non_finite_weight_on_the_tinker_wire(server):
    tenant = new_tenant(server)
    run = next(
        p
        for p in (server.state / "tinker").iterdir()
        if (p / "run.json").is_file()
        and json.loads((p / "run.json").read_text())["training_run_id"] == tenant.model_id
    )
    accepted = refused_ = 0
    for s in draws(seed=20261206):
        body = fb_request(tenant.model_id, tenant.next(), weights=[s["scale"]] * (len(TOKENS) - 1))
        result(server, post(server, "forward_backward", content=body))
        adam = {"learning_rate": s["lr"], "beta1": s["beta1"], "beta2": s["beta2"],
                "eps": s["eps"], "weight_decay": s["weight_decay"],
                "grad_clip_norm": s["grad_clip"]}  # fmt: skip
        with hostile(server):
            resp = post(server, "optim_step",
                        json={"model_id": tenant.model_id, "seq_id": tenant.next(),
                              "adam_params": adam})  # fmt: skip
            if resp.status_code == 200:
                out = result(server, resp)
                accepted += "error" not in out
                refused_ += "error" in out
            else:
                assert resp.status_code == 400, resp.text
                refused_ += 1
        state = run / "state" / (run / "state" / "CURRENT").read_text().strip()
        all_finite(state)
    assert accepted >= 3 and refused_ >= 3, (accepted, refused_)
    save = post(
        server,
        "save_weights_for_sampler",
        json={"model_id": tenant.model_id, "seq_id": tenant.next(), "path": "final"},
    )
    assert "path" in result(server, save)
    all_finite(run / "policies")


# -- 6. long ids in paths ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "method,path",
    [("GET", "/api/v1/training_runs/{id}"), ("GET", "/api/v1/training_runs/{id}/checkpoints"),
     ("DELETE", "/api/v1/training_runs/{id}/checkpoints/weights/x"),
     ("GET", "/api/v1/samplers/{id}"), ("GET", "/v1/training/ops/{id}")],
)  # fmt: skip
def test_a_very_long_id_in_a_path_is_a_4xx(server, method, path):
    resp = server.http.request(method, path.format(id="a" * 5000))
    assert 400 <= resp.status_code < 500, (resp.status_code, resp.text[:300])
    assert len(resp.content) < 4000
    body = {"tinker_path": f"tinker://{'a' * 5000}/weights/x"}
    resp = post(server, "weights_info", json=body)
    assert resp.status_code == 400 and "1 to 200 characters" in resp.text, resp.text[:300]


# -- 7. headers that never end ----------------------------------------------------------------


ENDLESS_HEADERS = 64 << 20
"""Bytes of header lines the client tries to send: the server must hang up long before."""


def test_headers_that_never_end_are_cut_off(server):
    """A request whose header lines never end is dropped after a bounded amount: uvicorn's
    h11 parser holds at most 16 KiB of an unfinished request. (Its httptools parser holds
    every header line it is sent, which is why plies' servers do not run on it.)"""
    host, port = server.url.removeprefix("http://").rsplit(":", 1)
    line = b"X-Filler: " + b"a" * 8000 + b"\r\n"
    sent = 0
    with hostile(server), socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
        with contextlib.suppress(OSError):  # the server hangs up: reset, or a broken pipe
            while sent < ENDLESS_HEADERS:
                sock.sendall(line)
                sent += len(line)
    assert sent < ENDLESS_HEADERS, f"the server took {sent >> 20} MiB of header lines"
    assert server.http.get("/health").status_code == 200
