"""Shared fixtures: the offline tokenizer and tiny model, built once per machine and cached."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import anyio
import pytest
import smoke_run
from transformers import AutoTokenizer

from plies import PolicyRef, testing
from plies.policy import VLLMClient, publish
from plies.recipes.blackjack import BUDGETS
from plies.recipes.blackjack.config import TEMPLATE_KWARGS
from plies.recipes.blackjack.warm_start import transcripts, warm_start
from plies.tokens import ChatRenderer
from plies.training import TrainingClient

SHARED_ON_ONE_WORKER = ("demo_run", "warm_server")
"""Session fixtures that take minutes to make: under pytest-xdist every test that uses one runs
on the same worker (`--dist loadgroup`), so each is made once, not once per worker."""


def pytest_configure(config: pytest.Config) -> None:
    """One torch thread per process, for the tests and every server and run they start
    (unless OMP_NUM_THREADS says otherwise). The suite runs two tests at a time on two
    cores; two tiny-model processes with two OpenMP threads each spend the cores spinning at
    each other's barriers, so two of the demo's runs side by side took longer than one after
    the other."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


@pytest.hookimpl(tryfirst=True)  # before xdist's own, which reads the marks into the node ids
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        shared = [f for f in SHARED_ON_ONE_WORKER if f in getattr(item, "fixturenames", ())]
        if shared:
            item.add_marker(pytest.mark.xdist_group("+".join(shared)))


@pytest.fixture(scope="session")
def qwen3_tokenizer_dir() -> Path:
    return testing.qwen3_tokenizer_dir()


@pytest.fixture(scope="session")
def qwen3_tokenizer(qwen3_tokenizer_dir: Path):
    return AutoTokenizer.from_pretrained(qwen3_tokenizer_dir)


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    return testing.tiny_model_dir()


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@dataclass
class PolicyServer:
    """A running `plies serve` subprocess, as its ready line described it."""

    url: str
    policy: dict
    model: str
    state_dir: Path
    process: subprocess.Popen
    log: Path


@contextlib.contextmanager
def run_policy_server(
    model_dir: Path, state_dir: Path, *args: str, ready_timeout: float = 180.0
) -> Iterator[PolicyServer]:
    """Start `plies serve MODEL_DIR --state-dir STATE_DIR ARGS` on 127.0.0.1; stop it after.

    Waits for the one JSON ready line on stdout; stderr goes to STATE_DIR/../serve-*.log.
    """
    fd, name = tempfile.mkstemp(prefix="serve-", suffix=".log", dir=Path(state_dir).parent)
    os.close(fd)
    argv = testing.plies_command("serve", str(model_dir), "--state-dir", str(state_dir))
    argv += ["--threads", "1", *args]
    with testing.serve_process_sync(argv, log=Path(name), ready_timeout=ready_timeout) as server:
        yield PolicyServer(
            server.url,
            server.ready["policy"],
            server.ready["model"],
            Path(state_dir),
            server.process,
            server.log,
        )


@pytest.fixture(scope="session")
def policy_server(tiny_model_dir: Path, tmp_path_factory) -> Iterator[PolicyServer]:
    """One reference policy server on the tiny model, shared by the whole session."""
    with run_policy_server(tiny_model_dir, tmp_path_factory.mktemp("policy-server")) as server:
        yield server


@pytest.fixture(scope="session")
def start_policy_server():
    """`run_policy_server` as a fixture, for tests that need their own server process."""
    return run_policy_server


@pytest.fixture(scope="session")
def forward_logprobs():
    """`f(model_dir, prompt, ids, temperature=1.0, top_k=-1)`: the logprobs of `ids` after
    `prompt` from one plain transformers forward pass, under the sampling convention (after
    temperature, renormalised over the top k). What sampler logprobs are checked against."""
    import torch
    from transformers import AutoModelForCausalLM

    loaded: dict[str, object] = {}

    def logprobs(model_dir, prompt, ids, temperature=1.0, top_k=-1) -> list[float]:
        key = str(model_dir)
        if key not in loaded:
            loaded[key] = AutoModelForCausalLM.from_pretrained(
                model_dir, dtype=torch.float32
            ).eval()
        with torch.no_grad():
            out = loaded[key](torch.tensor([list(prompt) + list(ids)]))
        logits = out.logits[0, len(prompt) - 1 : -1].double()
        if temperature > 0:
            logits = logits / temperature
        logp = torch.log_softmax(logits, -1)
        if top_k > 0:
            top = torch.topk(logp, top_k, -1)
            logp = torch.full_like(logp, float("-inf")).scatter(-1, top.indices, top.values)
            logp = logp - torch.logsumexp(logp, -1, keepdim=True)
        return logp.gather(-1, torch.tensor(list(ids))[:, None])[:, 0].tolist()

    return logprobs


# A reference server whose latest policy is the demo's warm start, shared by the session.
# A random tiny model almost never emits a well-formed tool call, so tests that need real
# tool calls sampled by the real server use the policy the demo's supervised step produces
# (`plies.recipes.blackjack.warm_start`, the same code and data the demo runs).

WARM = BUDGETS["quick"]
"""The quick demo's warm start: fast, and at its high rate the calls come out well-formed at
temperature 1 over the whole vocabulary (fewer steps do not give that reliably)."""


@dataclass(frozen=True)
class WarmServer:
    url: str
    model: str
    base: PolicyRef
    warm: PolicyRef
    model_dir: Path


@pytest.fixture(scope="session")
def warm_server(
    tiny_model_dir: Path, tmp_path_factory, start_policy_server
) -> Iterator[WarmServer]:
    state = tmp_path_factory.mktemp("warm-server") / "state"
    with start_policy_server(tiny_model_dir, state, "--max-batch-size", "64") as server:
        tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
        renderer = ChatRenderer(tokenizer, template_kwargs=dict(TEMPLATE_KWARGS))
        base = PolicyRef.model_validate(server.policy)

        async def train() -> PolicyRef:
            data = await transcripts(
                renderer, tokenizer, WARM.warm_hands, policy=base, players=WARM.warm_players
            )
            async with TrainingClient(server.url) as trainer:
                policy = await warm_start(trainer, data, WARM)
            async with VLLMClient(server.url, server.model) as sampler:
                await publish(policy, [sampler])
            return policy

        warm = anyio.run(train)
        yield WarmServer(server.url, server.model, base, warm, tiny_model_dir)


@pytest.fixture(scope="session")
def demo_run(tmp_path_factory) -> Iterator[Path]:
    """`plies demo blackjack` with `smoke_run.ARGS`, run once for every test of the session.

    Stopped with Ctrl-C (SIGINT) on every path, so the demo stops its own server.
    """
    if reuse := os.environ.get(smoke_run.REUSE):
        run = Path(reuse)
        for made in (run / "summary.json", run.parent / smoke_run.LOG):
            assert made.is_file(), f"{smoke_run.REUSE}={reuse}: no finished run there ({made})"
        yield run
        return
    out = tmp_path_factory.mktemp("demo-run") / "run"
    log = out.parent / smoke_run.LOG
    argv = [*testing.plies_command("demo", "blackjack"), "--out", str(out), *smoke_run.ARGS]
    with log.open("wb") as sink:
        proc = subprocess.Popen(argv, stdout=sink, stderr=subprocess.STDOUT, env=smoke_run.ENV)
        try:
            rc = proc.wait(smoke_run.TIMEOUT)
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
                try:
                    proc.wait(60)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
    assert rc == 0, log.read_text(errors="replace")[-3000:]
    yield out
