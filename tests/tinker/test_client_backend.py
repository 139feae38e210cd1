"""`TinkerTrainingClient` against a real `plies serve`: one loop trains through both wires to
the same weights, and a Tinker service that is down, slow, loses answers or answers garbage
gives a clear error or a quarantine, never a hang or a step applied twice.

Faults come from a small HTTP proxy in front of the real server (`FaultProxy`): it forwards
every request and, when told, holds one future, answers garbage, or loses the answer of a
request it did forward. The server's op journal (`STATE_DIR/tinker/<run>/ops.jsonl`) shows
what was applied.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import unquote, urlparse

import anyio
import httpx
import numpy as np
import pytest
import tinker
import uvicorn
from safetensors.torch import load_file
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from plies import (
    ConfigError,
    PolicyOutcomeUnknown,
    PolicyRef,
    PolicyResponseError,
    PolicyUnavailable,
    TrainingError,
    TrainingGradientsLost,
    TrainingQuarantined,
    rl,
    testing,
)
from plies.environments import BlackjackEnv, Task
from plies.policy import (
    PolicyClient,
    PolicyLoader,
    SamplingParams,
    Timeout,
    TinkerPolicyClient,
    publish,
)
from plies.rl import RunLog, retain
from plies.rl._retention import RETENTION_FILE, removed_versions
from plies.rl._train import claim_run_dir
from plies.runtime import Interrupts
from plies.testing import closed_url
from plies.training import (
    AdamParams,
    Datum,
    TinkerTrainingClient,
    Trainer,
    TrainingBatch,
    TrainingClient,
)

pytestmark = pytest.mark.anyio

SEQ = [9707, 11, 1879, 0, 151644, 872, 198, 3838, 374, 220, 17, 10, 17, 30, 151645]
BASE = "tiny-qwen3"
KEY = "tml-local"


@dataclass
class Served:
    url: str
    state_dir: Path

    def journal(self, model_id: str) -> list[dict]:
        path = self.state_dir / "tinker" / model_id.replace(":", "_") / "ops.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    def applied(self, model_id: str, kind: str) -> int:
        """Ops of `kind` the server accepted (a resent duplicate gets no second line)."""
        return sum(r["event"] == "submit" and r["kind"] == kind for r in self.journal(model_id))


@pytest.fixture(scope="module")
def served(tiny_model_dir: Path, tmp_path_factory) -> Iterator[Served]:
    """A fresh `plies serve`: its native trainer and a new Tinker tenant start from the same
    base weights."""
    root = tmp_path_factory.mktemp("tinker-backend")
    argv = testing.plies_command(
        "serve", str(tiny_model_dir), "--state-dir", str(root / "state"), "--threads", "1"
    )
    with testing.serve_process_sync(argv, log=root / "serve.log", ready_timeout=180) as server:
        yield Served(server.url, root / "state")


def batch(seed: int = 0) -> TrainingBatch:
    """Two sequences, sampled tokens after the first three, noisy sampler logprobs."""
    rng = np.random.default_rng(seed)
    data = []
    for tokens in (SEQ, SEQ[2:12]):
        mask = [0, 0, 0] + [1] * (len(tokens) - 3)
        logprobs = [float(-12 + rng.normal(0, 0.3)) if m else 0.0 for m in mask]
        advantages = [float(rng.normal()) if m else 0.0 for m in mask]
        data.append(Datum(tokens=tokens, mask=mask, logprobs=logprobs, advantages=advantages))
    return TrainingBatch(data=data)


ADAM = AdamParams(lr=1e-3, grad_clip=1.0)


async def train(trainer: Trainer, data: TrainingBatch) -> tuple[list[float], PolicyRef]:
    """The loop under test, written once against the protocol: three losses, then a save."""
    losses = []
    for loss in ("importance_sampling", "ppo", "cross_entropy"):
        fb = await trainer.forward_backward(data, loss=loss, clip_low=0.2, clip_high=0.28)
        await trainer.optim_step(ADAM)
        losses.append(fb.metrics["loss"])
    return losses, await trainer.save_policy()


def tinker_client(url: str, **kw) -> TinkerTrainingClient:
    kw.setdefault("result_timeout", 120.0)
    return TinkerTrainingClient(url, base_model=BASE, api_key=KEY, **kw)


def _dir(uri: str) -> Path:
    return Path(unquote(urlparse(uri).path))


async def test_one_loop_gives_the_same_losses_and_weights_on_both_wires(served):
    data = batch()
    states = []
    async with TrainingClient(served.url) as native:
        assert isinstance(native, Trainer)
        native_losses, native_policy = await train(native, data)
        states.append(await native.state())
    async with tinker_client(served.url) as tinker:
        assert isinstance(tinker, Trainer)
        tinker_losses, tinker_policy = await train(tinker, data)
        model_id = tinker.model_id
        assert tinker.step == 3
        states.append(await tinker.state())
    # The one protocol says where each stands: three steps, nothing pending, the last save.
    assert [(s.step, s.pending, s.policy) for s in states] == [
        (3, [], native_policy),
        (3, [], tinker_policy),
    ]
    np.testing.assert_allclose(tinker_losses, native_losses, atol=1e-5)
    assert tinker_policy.uri == f"tinker://{model_id}/sampler_weights/plies-v000001"
    assert tinker_policy.version == 1

    # The weights after three steps: the native policy directory against the Tinker
    # tenant's sampler snapshot (both full weights, as saved by the server).
    snapshots = served.state_dir / "tinker" / model_id.replace(":", "_") / "policies"
    snapshot = max(snapshots.iterdir(), key=lambda p: int(p.name))
    ours = load_file(_dir(native_policy.uri) / "model.safetensors")
    theirs = load_file(snapshot / "model.safetensors")
    assert ours.keys() == theirs.keys()
    worst = max(float((ours[k] - theirs[k]).abs().max()) for k in ours)
    assert worst < 1e-5, worst
    moved = max(
        float((ours[k] - b).abs().max())
        for k, b in load_file(_dir(native_policy.uri).parent / "0" / "model.safetensors").items()
    )
    assert moved > 1e-3  # the steps changed the weights, so the comparison means something
    assert served.applied(model_id, "optim_step") == 3


async def test_a_run_resumed_from_a_saved_policy_takes_the_step_it_would_have(served):
    data = batch(1)

    async def step(trainer: Trainer) -> float:
        fb = await trainer.forward_backward(data, loss="importance_sampling")
        await trainer.optim_step(ADAM)
        return fb.metrics["loss"]

    async with tinker_client(served.url) as first:
        await step(first)
        await step(first)
        policy = await first.save_policy(op_id="save-2")
        assert await first.save_policy(op_id="save-2") == policy  # answered, not sent again
        third = await step(first)
        with pytest.raises(ConfigError, match="already used"):
            await first.forward_backward(batch(2), op_id="fb-1")  # fb-1 named another batch
    assert served.applied(first.model_id, "save_weights_for_sampler") == 1
    async with tinker_client(served.url, resume_from=policy, keep_checkpoints=1) as resumed:
        assert resumed.step == 2 and resumed.model_id != first.model_id
        resumed_at = await resumed.state()
        assert (resumed_at.step, resumed_at.policy) == (2, policy)  # the resume point
        assert await step(resumed) == pytest.approx(third, abs=1e-5)
        assert (await resumed.save_policy()).version == policy.version + 1
        newest = await resumed.save_policy()
    # Only the newest training checkpoint is kept; every sampler's weights stay.
    rest = tinker.RestClient(base_url=served.url, api_key=KEY)
    listed = await anyio.to_thread.run_sync(
        lambda: rest.list_checkpoints(resumed.model_id).result().checkpoints
    )
    assert sorted(c.checkpoint_id for c in listed) == [
        "sampler_weights/plies-v000002",
        "sampler_weights/plies-v000003",
        "weights/plies-v000003",
    ]
    assert newest.version == 3


async def test_delete_policy_removes_sampler_weights_of_this_run_and_an_earlier_one(served):
    async with tinker_client(served.url) as first:
        older = await first.save_policy()
    async with tinker_client(served.url, resume_from=older) as trainer:
        kept, doomed = await trainer.save_policy(), await trainer.save_policy()
        await trainer.delete_policy(doomed)
        await trainer.delete_policy(older)  # the run this one resumed from
        with pytest.raises(TrainingError, match=r"plies-v000003.*404|404.*plies-v000003"):
            await trainer.delete_policy(doomed)  # gone already: the service says so
        with pytest.raises(ConfigError, match="not Tinker sampler weights"):
            await trainer.delete_policy(PolicyRef(uri="file:///tmp/model", version=9))
    rest = tinker.RestClient(base_url=served.url, api_key=KEY)

    def sampler_ids(model_id: str) -> list[str]:
        listed = rest.list_checkpoints(model_id).result().checkpoints
        return sorted(c.checkpoint_id for c in listed if c.checkpoint_type == "sampler")

    assert await anyio.to_thread.run_sync(sampler_ids, first.model_id) == []
    assert await anyio.to_thread.run_sync(sampler_ids, trainer.model_id) == [
        "sampler_weights/" + kept.uri.rpartition("/")[2]
    ]


async def test_the_demo_retention_deletes_what_it_does_not_keep_and_records_a_refusal(
    served, tmp_path
):
    async with tinker_client(served.url) as trainer:
        published = [await trainer.save_policy() for _ in range(5)]  # v1 .. v5
        await trainer.delete_policy(published[1])  # v2 gone behind the run's back
        removed, failures = await retain(
            tmp_path, published, trainer=trainer, warm=1, keep=1, max_staleness=None
        )
        assert removed == [3, 4]
        assert len(failures) == 1 and published[1].uri in failures[0]
        # The refused one stays in "kept" and out of "removed", so it is tried again.
        assert json.loads((tmp_path / RETENTION_FILE).read_text()) == {
            "keep_policies": 1, "kept": [1, 2, 5], "removed": [3, 4],
        }  # fmt: skip
        again, _ = await retain(
            tmp_path, published, trainer=trainer, warm=1, keep=1, max_staleness=None
        )
        assert again == [] and removed_versions(tmp_path) == {3, 4}
    rest = tinker.RestClient(base_url=served.url, api_key=KEY)
    listed = await anyio.to_thread.run_sync(
        lambda: rest.list_checkpoints(trainer.model_id).result().checkpoints
    )
    on_service = sorted(c.checkpoint_id for c in listed if c.checkpoint_type == "sampler")
    assert on_service == ["sampler_weights/plies-v000001", "sampler_weights/plies-v000005"]


async def test_a_batch_sampled_off_temperature_one_is_refused(served):
    hot = TrainingBatch(data=batch().data, temperature=0.7)
    async with tinker_client(served.url) as tinker:
        with pytest.raises(ConfigError, match="temperature 1"):
            await tinker.forward_backward(hot)


# -- faults -------------------------------------------------------------------------------


@dataclass
class FaultProxy:
    """Forwards everything to `upstream`; `lose`, `hold` and `garbage` pick requests to
    spoil: by route, and for futures by the route whose submit returned the request id."""

    upstream: str
    url: str = ""
    lose: set[str] = field(default_factory=set)
    """Routes whose next answer is lost (502) after the request was forwarded."""
    refuse: set[str] = field(default_factory=set)
    """Routes whose next request is refused (503) without being forwarded."""
    hold: set[str] = field(default_factory=set)
    """Routes whose futures' polls are held until `released` is set."""
    garbage: set[str] = field(default_factory=set)
    """Routes whose futures are answered with a result that does not parse."""
    released: threading.Event = field(default_factory=threading.Event)
    seen: list[str] = field(default_factory=list)
    rids: dict[str, str] = field(default_factory=dict)  # request id -> submit route

    async def handle(self, request: Request) -> Response:
        route = request.url.path.removeprefix("/api/v1/")
        body = await request.body()
        self.seen.append(route)
        if route in self.refuse:
            self.refuse.discard(route)
            return JSONResponse({"detail": "overloaded; not forwarded"}, status_code=503)
        if route == "retrieve_future":
            submitted_by = self.rids.get(json.loads(body).get("request_id"), "")
            if submitted_by in self.garbage:
                return JSONResponse({"metrics": "not a mapping"})
            if submitted_by in self.hold:
                while not self.released.is_set():
                    await asyncio.sleep(0.05)
        headers = {
            k: v for k, v in request.headers.items() if k.lower() not in ("host", "content-length")
        }
        async with httpx.AsyncClient(timeout=60) as http:
            answer = await http.request(
                request.method, self.upstream + request.url.path, content=body, headers=headers
            )
        if answer.headers.get("content-type", "").startswith("application/json"):
            rid = answer.json().get("request_id") if answer.status_code == 200 else None
            if isinstance(rid, str):
                self.rids[rid] = route
        if route in self.lose:
            self.lose.discard(route)
            return JSONResponse({"detail": "answer lost on the way"}, status_code=502)
        keep = {"content-type": answer.headers.get("content-type", "application/json")}
        return Response(answer.content, status_code=answer.status_code, headers=keep)


@pytest.fixture
def proxy(served) -> Iterator[FaultProxy]:
    fault = FaultProxy(served.url)
    app = Starlette(routes=[Route("/{path:path}", fault.handle, methods=["GET", "POST", "DELETE"])])
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    fault.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    try:
        yield fault
    finally:
        fault.released.set()
        server.should_exit = True
        thread.join(10)
        sock.close()


async def test_an_answer_lost_after_acceptance_is_recovered_and_applied_once(served, proxy):
    async with tinker_client(proxy.url) as tinker:
        await tinker.forward_backward(batch())
        proxy.lose.add("optim_step")
        result = await tinker.optim_step(ADAM)  # the SDK sends the same seq_id again
        assert result.step == 1 and tinker.quarantined is None
        assert proxy.seen.count("optim_step") == 2
        assert served.applied(tinker.model_id, "optim_step") == 1


async def test_a_future_pending_past_the_deadline_quarantines_until_it_answers(served, proxy):
    async with tinker_client(proxy.url, result_timeout=3.0) as tinker:
        await tinker.forward_backward(batch())
        proxy.hold.add("optim_step")
        t0 = time.monotonic()
        with pytest.raises(TrainingQuarantined, match="still pending"):
            await tinker.optim_step(ADAM)
        assert time.monotonic() - t0 < 10
        with pytest.raises(TrainingQuarantined, match="optim_step"):
            await tinker.forward_backward(batch())  # no further step while unknown
        with pytest.raises(TrainingQuarantined, match="still no answer"):
            await tinker.reconcile()
        proxy.released.set()
        result = await tinker.reconcile()  # the same request, polled by its id
        assert result.step == 1 and tinker.quarantined is None
        assert proxy.seen.count("optim_step") == 1
        assert served.applied(tinker.model_id, "optim_step") == 1
        await tinker.forward_backward(batch())
        assert (await tinker.optim_step(ADAM)).step == 2


async def test_a_garbage_answer_quarantines_and_nothing_is_sent_again(served, proxy):
    async with tinker_client(proxy.url) as tinker:
        await tinker.forward_backward(batch())
        proxy.garbage.add("optim_step")
        with pytest.raises(TrainingQuarantined, match="unknown"):
            await tinker.optim_step(ADAM)
        with pytest.raises(TrainingQuarantined, match="no request left"):
            await tinker.reconcile()
        assert proxy.seen.count("optim_step") == 1
        assert served.applied(tinker.model_id, "optim_step") == 1  # applied; its answer unusable


async def test_a_service_that_is_down_or_speaks_garbage_fails_in_seconds():
    closed = closed_url()
    t0 = time.monotonic()
    with pytest.raises(TrainingError, match="no Tinker service answers"):
        async with tinker_client(closed):
            pass

    async def nonsense(request: Request) -> Response:
        return Response("<html>not the Tinker API</html>", media_type="text/html")

    garbage = Starlette(routes=[Route("/{p:path}", nonsense, methods=["POST", "GET"])])
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(garbage, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        while not server.started:
            await anyio.sleep(0.02)
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        with pytest.raises(TrainingError, match="could not open a training run"):
            async with tinker_client(url, connect_timeout=20):
                pass
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()
    assert time.monotonic() - t0 < 30


async def test_an_op_the_service_failed_after_accepting_it_means_redo_the_step(served):
    # exp(lp - q) overflows float32 when the sampler logprob is -100: the Tinker loss is not
    # finite (the native trainer clamps the log-ratio), so plies serve fails the accepted op
    # and discards the step's gradients.
    poison = TrainingBatch(
        data=[
            Datum(
                tokens=d.tokens,
                mask=d.mask,
                logprobs=[-100.0 if m else 0.0 for m in d.mask],
                advantages=[1e6 if m else 0.0 for m in d.mask],
            )
            for d in batch().data
        ]
    )
    async with tinker_client(served.url) as tinker:
        await tinker.forward_backward(batch())
        with pytest.raises(TrainingGradientsLost, match="not finite"):
            await tinker.forward_backward(poison)
        assert tinker.pending_ops == [] and tinker.quarantined is None
        with pytest.raises(TrainingGradientsLost, match="refused"):
            await tinker.optim_step(ADAM)
        await tinker.forward_backward(batch())
        assert (await tinker.optim_step(ADAM)).step == 1


# -- sampling -----------------------------------------------------------------------------

EOS = 151645


def sampler(url: str, **kw) -> TinkerPolicyClient:
    return TinkerPolicyClient(url, base_model=BASE, api_key=KEY, eos_token_ids=[EOS], **kw)


async def test_samples_carry_the_policy_of_the_sampler_that_drew_them(served):
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=5)
    async with tinker_client(served.url) as trainer, sampler(served.url) as tinker:
        assert isinstance(tinker, PolicyClient) and isinstance(tinker, PolicyLoader)
        base = await tinker.sample(SEQ[:6], params)
        assert base.policy == tinker.base and base.finish_reason in ("stop", "length")
        assert len(base.ids) == len(base.logprobs) and all(lp <= 0 for lp in base.logprobs)
        assert (await tinker.sample(SEQ[:6], params)).ids == base.ids  # seeded

        for _ in range(3):  # move the weights far enough to change what is sampled
            await trainer.forward_backward(batch(), loss="cross_entropy")
            await trainer.optim_step(AdamParams(lr=5e-2))
        policy = await trainer.save_policy()
        await publish(policy, [tinker])
        await publish(policy, [tinker])  # harmless when it is loaded already
        new = await tinker.sample(SEQ[:6], params, policy=policy)
        assert new.policy == policy
        # An episode admitted under the base policy keeps sampling from the base weights.
        again = await tinker.sample(SEQ[:6], params, policy=tinker.base)
        assert (again.ids, again.logprobs) == (base.ids, base.logprobs)
        assert (new.ids, new.logprobs) != (base.ids, base.logprobs)

        stop = base.ids[2]
        cut = await tinker.sample(SEQ[:6], params.model_copy(update={"stop_token_ids": (stop,)}))
        assert cut.finish_reason == "stop" and cut.ids == base.ids[: base.ids.index(stop) + 1]
        with pytest.raises(ConfigError, match="not Tinker sampler weights"):
            await tinker.load_policy(PolicyRef(uri="file:///tmp/policy", version=9))


async def test_sampling_failures_say_whether_the_request_may_have_run(served, proxy):
    params = SamplingParams(max_tokens=4, seed=1)
    closed = closed_url()
    with pytest.raises(PolicyUnavailable, match="no Tinker service answers"):
        async with sampler(closed):
            pass
    async with sampler(proxy.url, timeout=Timeout(connect=10.0, read=3.0)) as tinker:
        proxy.refuse.add("asample")  # never reached the service: sent again, same seq_id
        assert len((await tinker.sample(SEQ[:6], params)).ids) == 4
        assert proxy.seen.count("asample") == 2
        proxy.hold.add("asample")
        t0 = time.monotonic()
        with pytest.raises(PolicyOutcomeUnknown, match="may have run"):
            await tinker.sample(SEQ[:6], params)
        assert time.monotonic() - t0 < 10 and proxy.seen.count("asample") == 3  # not repeated
        proxy.hold.clear()
        proxy.garbage.add("asample")
        with pytest.raises(PolicyResponseError):
            await tinker.sample(SEQ[:6], params)
        assert proxy.seen.count("asample") == 4


async def test_plies_rl_resumes_a_run_only_on_a_trainer_that_holds_its_steps(served, tmp_path):
    """`plies.rl.train` on the Tinker API, where a new training run starts from the base
    weights: a run that has taken a step is refused on such a trainer, with nothing written,
    and resumes on one opened from `plies.rl.last_policy(out)`."""
    config = rl.GRPOConfig(steps=1, group_size=2, groups_per_step=1)
    out = tmp_path / "run"
    async with tinker_client(served.url) as first:
        await first.forward_backward(batch(), loss="ppo")
        await first.optim_step(ADAM)
        policy = await first.save_policy()
    claim_run_dir(out, "grpo", dataclasses.asdict(config))
    log = RunLog(out / "metrics.jsonl")
    log.write("step", step=0, policy=policy.model_dump(mode="json"), train_return=0.5)
    log.close()
    assert rl.last_policy(out) == policy
    assert rl.last_policy(out, kinds=("warm_start",)) is None  # a kind this run never logged
    logged = (out / "metrics.jsonl").read_bytes()

    async def no_episode(ctx):
        raise AssertionError("the run's steps are done: nothing is played")

    async def resume(trainer: Trainer) -> PolicyRef:
        async with TinkerPolicyClient(
            served.url, base_model=BASE, api_key=KEY, eos_token_ids=[SEQ[-1]]
        ) as sampler:
            return await rl.train(
                out, config, tasks=lambda i: Task(id=str(i)), env=BlackjackEnv, play=no_episode,
                trainer=trainer, sampler=sampler, policy=sampler.base, interrupts=Interrupts(),
            )  # fmt: skip

    async with tinker_client(served.url) as fresh:
        with pytest.raises(ConfigError, match="took 1 GRPO steps, and the trainer holds 0"):
            await resume(fresh)
    assert (out / "metrics.jsonl").read_bytes() == logged
    assert not (out / "summary.json").exists()

    async with tinker_client(served.url, resume_from=rl.last_policy(out)) as resumed:
        assert await resume(resumed) == policy
    summary = json.loads((out / "summary.json").read_text())
    assert summary["grpo_steps"] == 1 and summary["complete"] is True
