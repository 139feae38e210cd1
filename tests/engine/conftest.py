"""The vLLM engine tier: a real vLLM server (CPU build) in its own virtual environment.

`PLIES_VLLM_PYTHON` names the python of that environment (`.ci/vllm-tier` creates it and
sets the variable). Without it the tier is skipped; `.ci/run` always sets it.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from plies import testing
from plies.server import PolicyStore
from plies.testing._models import build_tiny_model

VLLM_PYTHON = os.environ.get("PLIES_VLLM_PYTHON")
READY_TIMEOUT = 420.0


def pytest_collection_modifyitems(config, items):
    if VLLM_PYTHON:
        return
    skip = pytest.mark.skip(reason="PLIES_VLLM_PYTHON is not set (run .ci/vllm-tier)")
    for item in items:
        if "vllm" in item.keywords:
            item.add_marker(skip)


@dataclass
class VLLMServer:
    url: str
    store: PolicyStore
    log: Path


@pytest.fixture(scope="session")
def vllm_store(tmp_path_factory) -> PolicyStore:
    """Version 0 = the tiny model, version 1 = the same architecture with other weights."""
    root = tmp_path_factory.mktemp("vllm-store")
    store = PolicyStore.open(root / "state", testing.tiny_model_dir())
    store.publish_dir(build_tiny_model(root / "seed1", seed=1))
    return store


@pytest.fixture(scope="session")
def vllm_server(vllm_store: PolicyStore, tmp_path_factory) -> Iterator[VLLMServer]:
    """vLLM serving store version 0 as `policy-0`, with LoRA and dev-mode endpoints."""
    assert VLLM_PYTHON, "the vllm marker skips these tests without PLIES_VLLM_PYTHON"
    port = testing.free_port()
    log = tmp_path_factory.mktemp("vllm-log") / "vllm.log"
    cmd = [
        VLLM_PYTHON, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(vllm_store.path(0)), "--served-model-name", "policy-0",
        "--host", "127.0.0.1", "--port", str(port),
        "--dtype", "float32", "--enforce-eager", "--max-model-len", "2048",
        "--logprobs-mode", "processed_logprobs",
        "--enable-lora", "--max-lora-rank", "8",
    ]  # fmt: skip
    env = {
        **os.environ,
        "VLLM_SERVER_DEV_MODE": "1",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True",
        "HF_HUB_OFFLINE": "1",
    }
    url = f"http://127.0.0.1:{port}"
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + READY_TIMEOUT
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"vLLM exited with {proc.returncode}: {log.read_text()[-4000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"vLLM not ready in {READY_TIMEOUT}s: {log.read_text()[-4000:]}")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(1)
        yield VLLMServer(url, vllm_store, log)
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
