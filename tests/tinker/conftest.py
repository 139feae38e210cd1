"""One `plies serve` on the tiny model, driven by the unmodified `tinker` SDK."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from plies import testing

tinker = pytest.importorskip("tinker")

MODEL_NAME = "tiny/qwen3"
ENV = ("TINKER_API_KEY", "TINKER_BASE_URL", "TINKER_TELEMETRY")


@pytest.fixture(scope="session")
def tinker_root(tmp_path_factory) -> Path:
    """Where the shared server keeps its log and `state/` (its op logs: `tinker_url`)."""
    return tmp_path_factory.mktemp("tinker-server")


@pytest.fixture(scope="session")
def tinker_url(tiny_model_dir: Path, tinker_root: Path) -> Iterator[str]:
    """The base URL of a server whose Tinker API serves the tiny model as `MODEL_NAME`."""
    root = tinker_root
    argv = testing.plies_command(
        "serve", str(tiny_model_dir), "--state-dir", str(root / "state"),
        "--threads", "1", "--model-name", MODEL_NAME,
    )  # fmt: skip
    saved = {
        k: os.environ.get(k) for k in ("TINKER_API_KEY", "TINKER_BASE_URL", "TINKER_TELEMETRY")
    }
    with testing.serve_process_sync(argv, log=root / "serve.log", ready_timeout=180) as server:
        os.environ.update(
            TINKER_API_KEY="tml-local", TINKER_BASE_URL=server.url, TINKER_TELEMETRY="0"
        )
        try:
            yield server.url
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value


@pytest.fixture(scope="session")
def service(tinker_url: str) -> Iterator[tinker.ServiceClient]:
    with tinker.ServiceClient() as client:
        yield client


@pytest.fixture
def new_tenant(tinker_url: str) -> Iterator:
    """`new_tenant(rank, seed)`: a LoRA training client on the served tiny model, in a session
    of the test's own that is finished (freeing its tenants) when the test ends."""
    with tinker.ServiceClient() as client:

        def make(rank: int = 4, seed: int = 0) -> tinker.TrainingClient:
            future = client.create_lora_training_client(base_model=MODEL_NAME, rank=rank, seed=seed)
            return future.result()

        yield make


@pytest.fixture(scope="session")
def model_name() -> str:
    return MODEL_NAME


@pytest.fixture(scope="session")
def base_model(tiny_model_dir: Path):
    """The tiny model in plain transformers: what a fresh LoRA tenant computes."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
