"""Bad requests get Tinker-shaped 4xx answers, and the server keeps serving."""

from __future__ import annotations

import httpx
import numpy as np
import pytest
import tinker
from tinker import types
from tinker.proto import tinker_public_pb2 as pb

TOKENS = [9707, 11, 1879, 0, 151644, 872]


def datum(tokens: list[int], **inputs) -> types.Datum:
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], **inputs},
    )


@pytest.fixture
def training(new_tenant):
    return new_tenant()


def _post(url: str, path: str, **kw) -> httpx.Response:
    return httpx.post(f"{url}/api/v1/{path}", headers={"X-API-Key": "tml-local"}, timeout=30, **kw)


def _raw_request(model_id: str, n_datums: int) -> bytes:
    msg = pb.ForwardBackwardRequest(model_id=model_id, seq_id=10_000, loss_fn="cross_entropy")
    for _ in range(n_datums):
        d = msg.data.add()
        d.model_input.add().encoded_text.tokens = np.array([1, 2], np.int32).tobytes()
        t = d.loss_fn_inputs["target_tokens"]
        t.dtype, t.dense = pb.DTYPE_INT64, np.array([2, 3], np.int64).tobytes()
        t.shape.append(2)
    return msg.SerializeToString()


def test_refusals_through_the_sdk_name_the_problem(training):
    rl = {"logprobs": [-1.0] * 5, "advantages": [1.0] * 5}
    for loss in ("gspo", "stable_reinforce"):
        with pytest.raises(tinker.BadRequestError, match=r"supported: cross_entropy.*cispo, dro"):
            training.forward_backward([datum(TOKENS, **rl)], loss).result()
    with pytest.raises(tinker.BadRequestError, match="dro needs loss_fn_config"):
        training.forward_backward([datum(TOKENS, **rl)], "dro").result()
    with pytest.raises(tinker.BadRequestError, match="outside the vocabulary"):
        training.forward_backward([datum([*TOKENS, 10**6])], "cross_entropy").result()
    nan = [float("nan")] * 5
    with pytest.raises(tinker.BadRequestError, match="non-finite"):
        training.forward([datum(TOKENS, logprobs=nan, advantages=[1.0] * 5)], "ppo").result()
    with pytest.raises(tinker.BadRequestError, match="checkpoint name"):
        training.save_state("../ckpt").result()
    # Each refused request consumed its seq_id: the client's next op still runs.
    out = training.forward([datum(TOKENS)], "cross_entropy").result()
    assert len(out.loss_fn_outputs[0]["logprobs"].tolist()) == 5


def test_raw_bad_requests_get_4xx_with_a_detail(tinker_url, training, model_name):
    cases = [
        ("forward_backward", {"content": b"\xff\xff\xff not protobuf"}, 400),
        ("forward_backward", {"content": _raw_request("no-such:train:0", 1)}, 404),
        ("forward_backward", {"content": _raw_request(training.model_id, 1025)}, 400),
        ("get_info", {"json": {"model_id": "no-such:train:0"}}, 404),
        ("asample", {"json": {"sampling_session_id": "nope", "prompt": {}}}, 400),
        ("optim_step", {"content": b"{not json"}, 400),
        ("retrieve_future", {"json": {"request_id": "req-unknown"}}, 404),
        ("load_weights", {"json": {}}, 400),
        ("save_weights_external", {"json": {}}, 404),
    ]
    for path, kw, status in cases:
        r = _post(tinker_url, path, **kw)
        assert r.status_code == status, (path, r.status_code, r.text)
        assert r.json()["detail"], (path, r.text)
    assert httpx.get(f"{tinker_url}/api/v1/healthz").json() == {"status": "ok"}
    caps = httpx.get(f"{tinker_url}/api/v1/get_server_capabilities").json()
    assert caps["supported_models"][0]["model_name"] == model_name
    out = training.forward([datum(TOKENS)], "cross_entropy").result()
    assert np.all(np.isfinite(out.loss_fn_outputs[0]["logprobs"].to_numpy()))


def test_optim_step_never_steps_on_a_non_finite_loss_or_gradient_norm(training):
    data = [datum(TOKENS, weights=[1.0] * 5)]
    before = training.forward(data, "cross_entropy").result().metrics["loss:sum"]
    adam = types.AdamParams(learning_rate=1e-2)
    overflowing = [datum(TOKENS, weights=[3e38] * 5)]  # finite inputs, an infinite loss
    with pytest.raises(tinker.RequestFailedError, match="loss is not finite"):
        training.forward_backward(overflowing, "cross_entropy").result()
    with pytest.raises(tinker.RequestFailedError, match="optim_step refused: a forward_backward"):
        training.optim_step(adam).result()
    huge = [datum(TOKENS, weights=[1e30] * 5)]  # a finite loss, an infinite gradient norm
    assert np.isfinite(
        training.forward_backward(huge, "cross_entropy").result().metrics["loss:sum"]
    )
    with pytest.raises(tinker.RequestFailedError, match="gradient norm is not finite"):
        training.optim_step(adam).result()
    assert training.forward(data, "cross_entropy").result().metrics["loss:sum"] == before
    training.forward_backward(data, "cross_entropy").result()
    training.optim_step(adam).result()  # the next finite step runs, on its own gradients only
    assert training.forward(data, "cross_entropy").result().metrics["loss:sum"] < before


def test_sampling_options_out_of_range_or_unsupported_are_refused(service, model_name):
    sampler = service.create_sampling_client(base_model=model_name).result()
    prompt = types.ModelInput.from_ints(TOKENS)
    params = types.SamplingParams(max_tokens=1)
    cases = [
        ({"include_prompt_logprobs": True, "topk_prompt_logprobs": 65}, "outside \\[0, 64\\]"),
        ({"topk_sample_logprobs": 2}, "topk_sample_logprobs are not supported"),
    ]
    for options, message in cases:
        with pytest.raises(tinker.BadRequestError, match=message):
            sampler.sample(prompt, 1, params, **options).result()
    got = sampler.sample(prompt, 1, params, include_prompt_logprobs=True).result()
    assert got.prompt_logprobs[0] is None and len(got.prompt_logprobs) == len(TOKENS)
