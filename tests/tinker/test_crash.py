"""kill -9 of `plies serve` mid-op, a restart on the same --state-dir: the SDK's retries
complete, and every step is applied exactly once (the losses equal an uninterrupted run's)."""

from __future__ import annotations

import contextlib
import json
import os
import random
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import tinker
from tinker import types

from plies import testing

SEQ = [9707, 11, 1879, 0, 151644, 872, 198, 3838, 374, 220, 17, 10, 17, 30, 151645]
DATA = [
    types.Datum(
        model_input=types.ModelInput.from_ints(SEQ[:-1]),
        loss_fn_inputs={"target_tokens": SEQ[1:], "weights": [1.0] * 14},
    )
]
ADAM = types.AdamParams(learning_rate=1e-2)
MODEL_NAME = "tiny/qwen3"


class Restartable:
    """One `plies serve --test-faults` on a fixed port and state dir, killed and restarted."""

    def __init__(self, model_dir: Path, root: Path):
        port = testing.free_port()
        self.state_dir = root / "state"
        self.argv = testing.plies_command(
            "serve", str(model_dir), "--state-dir", str(self.state_dir), "--port", str(port),
            "--device", "cpu", "--threads", "1", "--model-name", MODEL_NAME, "--test-faults",
        )  # fmt: skip
        self.root = root
        self.url = f"http://127.0.0.1:{port}"
        self._stack = contextlib.ExitStack()
        self._proc = None
        self.starts = 0

    def start(self) -> None:
        self.starts += 1
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        log = self.root / f"serve-{self.starts}.log"
        running = self._stack.enter_context(
            testing.serve_process_sync(self.argv, log=log, env=env, ready_timeout=180)
        )
        assert running.url == self.url
        self._proc = running.process

    def kill(self) -> None:
        """SIGKILL: no shutdown hook runs."""
        assert self._proc is not None
        self._proc.kill()
        self._proc.wait(timeout=30)

    def hold(self, point: str) -> None:
        r = httpx.post(f"{self.url}/plies/test/hold", json={"point": point}, timeout=10)
        r.raise_for_status()

    def journal(self, model_id: str) -> list[dict]:
        path = self.state_dir / "tinker" / model_id.replace(":", "_") / "ops.jsonl"
        lines = path.read_text().splitlines(keepends=True) if path.exists() else []
        return [json.loads(line) for line in lines if line.endswith("\n")]

    def next_seq(self, model_id: str) -> int:
        return max(r["seq"] for r in self.journal(model_id)) + 1

    def answered(self, model_id: str, kind: str) -> tuple[str, int, dict]:
        """The last op of `kind` the log settled: its request id, how many `done` lines it
        has, and what `retrieve_future` answers for it now."""
        log = self.journal(model_id)
        rid = next(r["rid"] for r in reversed(log) if r["event"] == "submit" and r["kind"] == kind)
        done = sum(1 for r in log if r["event"] == "done" and r["rid"] == rid)
        resp = httpx.post(f"{self.url}/api/v1/retrieve_future", json={"request_id": rid})
        resp.raise_for_status()
        return rid, done, resp.json()

    def wait_for(self, model_id: str, event: str, seq: int) -> None:
        """Until the op log holds the `event` (submit or done) line of op `seq`."""
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if any((r["event"], r["seq"]) == (event, seq) for r in self.journal(model_id)):
                return
            time.sleep(0.05)
        raise AssertionError(f"no {event} of seq_id {seq} in {model_id}'s op log")

    def close(self) -> None:
        self._stack.close()


@pytest.fixture
def server(tiny_model_dir: Path, tmp_path: Path) -> Iterator[Restartable]:
    server = Restartable(tiny_model_dir, tmp_path)
    server.start()
    try:
        yield server
    finally:
        server.close()


def test_kill_9_mid_forward_backward_and_mid_optim_step_applies_every_step_once(
    server, monkeypatch
):
    monkeypatch.setenv("TINKER_API_KEY", "tml-local")
    monkeypatch.setenv("TINKER_TELEMETRY", "0")

    with tinker.ServiceClient(base_url=server.url) as client:
        tc = client.create_lora_training_client(base_model=MODEL_NAME, rank=4, seed=11).result()
        losses = []

        def step() -> None:
            fb = tc.forward_backward(DATA, "cross_entropy")
            tc.optim_step(ADAM).result()
            losses.append(fb.result().metrics["loss:sum"])

        step()
        sampler = tc.save_weights_and_get_sampling_client().result()
        path = tc.save_weights_for_sampler("after-1").result().path
        named = client.create_sampling_client(model_path=path).result()

        def killed(point: str, stage: str, submit: Callable[[], Any]) -> Any:
            """`submit()`'s future, the server killed -9 at `point` once that request reached
            `stage`, then restarted."""
            seq = server.next_seq(tc.model_id)
            server.hold(point)
            future = submit()
            server.wait_for(tc.model_id, stage, seq)
            server.kill()
            server.start()
            return future

        def forward_backward() -> Any:
            return tc.forward_backward(DATA, "cross_entropy")

        # An optim_step answered before the kill is answered the same after it, from the log.
        answered = server.answered(tc.model_id, "optim_step")
        # 1. Killed mid-forward_backward: accepted and journaled, its gradients not added.
        fb = killed("before_apply", "submit", forward_backward)
        assert server.answered(tc.model_id, "optim_step") == answered
        losses.append(fb.result().metrics["loss:sum"])
        tc.optim_step(ADAM).result()

        # 2. Killed mid-optim_step, before it applied: the forward_backward before it (answered
        # already) runs again to rebuild the gradients, and the step is applied once.
        losses.append(forward_backward().result().metrics["loss:sum"])
        killed("before_apply", "submit", lambda: tc.optim_step(ADAM)).result()

        # 3. Killed mid-optim_step after it applied and was journaled, before its answer:
        # the retry gets the journaled result, and the step is not applied again.
        losses.append(forward_backward().result().metrics["loss:sum"])
        opt = killed("before_answer", "done", lambda: tc.optim_step(ADAM))
        assert opt.result().metrics["learning_rate:mean"] == pytest.approx(1e-2)

        step()
        final = tc.forward(DATA, "cross_entropy").result().metrics["loss:sum"]
        # The sampling sessions made before the crashes still sample.
        params = types.SamplingParams(max_tokens=4, seed=1)
        prompt = types.ModelInput.from_ints(SEQ[:6])
        for s in (sampler, named):
            assert len(s.sample(prompt, 1, params).result().sequences[0].tokens) == 4
        gone = httpx.post(f"{server.url}/api/v1/retrieve_future", json={"request_id": "sample-x"})
        assert gone.status_code == 410  # a sample lost in a restart: the SDK samples again

        # The same run, uninterrupted, on a tenant with the same seed.
        ref = client.create_lora_training_client(base_model=MODEL_NAME, rank=4, seed=11).result()
        expected = []
        for _ in range(5):
            fb = ref.forward_backward(DATA, "cross_entropy")
            ref.optim_step(ADAM).result()
            expected.append(fb.result().metrics["loss:sum"])
        expected.append(ref.forward(DATA, "cross_entropy").result().metrics["loss:sum"])
    assert [*losses, final] == pytest.approx(expected, abs=1e-5)
    assert expected[-1] < expected[0]


KILLS = int(os.environ.get("PLIES_TINKER_KILLS", "4"))
"""Kills per run of the random-kill test: 4 in CI (each restart costs a server start, about
10 to 30 s on a laptop); `PLIES_TINKER_KILLS=20` is the issue's full run."""


def _phase(server: Restartable, model_id: str) -> str:
    """Where the tenant's op log stood when the server died: an op accepted and not yet
    settled (which kind), or none in flight."""
    submitted, settled = {}, set()
    for r in server.journal(model_id):
        if r["event"] == "submit":
            submitted[r["seq"]] = r["kind"]
        else:
            settled.add(r["seq"])
    open_ops = sorted(set(submitted) - settled)
    return f"mid {submitted[open_ops[0]]}" if open_ops else "between ops"


@pytest.mark.timeout(120 + 60 * KILLS)
def test_kill_9_at_random_moments_of_an_sdk_training_loop(server, monkeypatch):
    """A killer thread SIGKILLs the server `KILLS` times at random moments while the SDK
    trains; the run finishes through the SDK's own retries, and its losses equal an
    uninterrupted run's step for step (a step applied twice or lost would shift them)."""
    monkeypatch.setenv("TINKER_API_KEY", "tml-local")
    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    seed = int(os.environ.get("PLIES_TINKER_KILL_SEED", str(int(time.time()))))
    rng = random.Random(seed)
    tally: Counter[str] = Counter()
    started = time.monotonic()
    with tinker.ServiceClient(base_url=server.url) as client:
        tc = client.create_lora_training_client(base_model=MODEL_NAME, rank=4, seed=5).result()
        model_id = tc.model_id

        def killer() -> None:
            for _ in range(KILLS):
                # Once the SDK is back at work (a new op in the log since the restart), at a
                # random moment of its loop.
                seen = len(server.journal(model_id))
                deadline = time.monotonic() + 120
                while len(server.journal(model_id)) <= seen + 1:
                    assert time.monotonic() < deadline, "the SDK never came back"
                    time.sleep(0.05)
                time.sleep(rng.uniform(0.0, 1.5))
                tally[_phase(server, model_id)] += 1
                server.kill()
                server.start()

        losses: list[float] = []

        def step() -> None:
            fb = tc.forward_backward(DATA, "cross_entropy")
            opt = tc.optim_step(ADAM)
            losses.append(fb.result().metrics["loss:sum"])
            opt.result()

        step()
        thread = threading.Thread(target=killer, daemon=True)
        thread.start()
        while thread.is_alive() and len(losses) < 500:
            step()
        thread.join()
        step()  # the run goes on after the last restart
        final = tc.forward(DATA, "cross_entropy").result().metrics["loss:sum"]

        ref = client.create_lora_training_client(base_model=MODEL_NAME, rank=4, seed=5).result()
        expected: list[float] = []
        for _ in losses:
            fb = ref.forward_backward(DATA, "cross_entropy")
            ref.optim_step(ADAM).result()
            expected.append(fb.result().metrics["loss:sum"])
        expected_final = ref.forward(DATA, "cross_entropy").result().metrics["loss:sum"]
    got, want = np.array([*losses, final]), np.array([*expected, expected_final])
    same = np.isclose(got, want, atol=1e-5, rtol=0)
    # A step applied twice makes later losses run one step ahead of the reference, a lost
    # one one step behind.
    twice = sum(
        1 for i in range(len(got) - 1) if not same[i] and np.isclose(got[i], want[i + 1], atol=1e-5)
    )
    lost = sum(
        1 for i in range(1, len(got)) if not same[i] and np.isclose(got[i], want[i - 1], atol=1e-5)
    )
    print(
        f"\nkill -9 tally (seed {seed}): {KILLS} kills ({dict(tally)}), {len(losses)} steps, "
        f"{int((~same).sum())} losses differ, {twice} applied twice, {lost} lost, "
        f"{server.starts} server starts, {time.monotonic() - started:.0f} s"
    )
    assert sum(tally.values()) == KILLS and server.starts == KILLS + 1
    assert same.all() and twice == 0 and lost == 0, (got, want)
    assert want[-1] < want[0]
