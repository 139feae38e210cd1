"""Fixtures of the Ray tier: one local Ray per test module, a real loopback server, asyncio.

Ray starts in several seconds on two cores, so a module shares one `ray.init` (with a short
temporary directory of its own: Ray's socket paths must stay short) and always shuts it down.
The shards' actors import `shard_parts` from here (`PYTHONPATH` in the job's runtime env).
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from shard_parts import SKIP

from plies.testing import serve_process_sync

HERE = Path(__file__).parent
OP_SERVER = HERE.parent / "runtime" / "op_server.py"


@pytest.fixture(scope="module")
def local_ray() -> Iterator[object]:
    pytest.importorskip("ray.actor", reason=SKIP)
    import ray

    temp = tempfile.mkdtemp(prefix="ray", dir="/tmp")
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        _temp_dir=temp,
        runtime_env={"env_vars": {"PYTHONPATH": str(HERE)}},
    )
    try:
        yield ray
    finally:
        ray.shutdown()
        shutil.rmtree(temp, ignore_errors=True)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # Ray's object refs are asyncio awaitables


@pytest.fixture(scope="module")
def policy_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The op server: stand-in completions and remote steps, over HTTP."""
    log = tmp_path_factory.mktemp("policy") / "op_server.log"
    with serve_process_sync([sys.executable, str(OP_SERVER)], log=log) as server:
        yield server.url
