"""`plies serve`: run the reference server and announce it with one JSON line on stdout."""

from __future__ import annotations

import ctypes
import json
import logging
import os
import shutil
import socket
import sys
import tempfile
from pathlib import Path
from typing import Any

import anyio
from pydantic import ValidationError

from .._exceptions import ConfigError
from .._net import SERVER_HTTP, SERVER_KEEPALIVE_S, is_loopback
from ..wire.sampling import served_name
from ._app import create_app
from ._config import ServerConfig
from ._policies import weights_digest

__all__ = ["reuse_freed_memory", "serve"]

log = logging.getLogger("plies.server")

M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
"""glibc's `mallopt` parameters (malloc.h)."""

KEPT_FREE_BYTES = 1 << 30
"""Free memory glibc may keep at the top of the heap rather than hand back to the kernel."""


def reuse_freed_memory() -> bool:
    """Make glibc's malloc serve large tensors from memory already freed, not from the kernel.

    The trainer's vocabulary-wide passes allocate and free tensors of hundreds of megabytes at
    every step. By default glibc maps each one fresh and unmaps it when freed, so the kernel
    faults in and zeroes every page again: on the Blackjack warm start that was 1.1 s of the
    kernel's CPU a step, 0.09 s with this (`bench/trainer_bench.py`). Without mmap for large
    blocks and with a high trim threshold, freed blocks stay in the heap and are reused; the
    cost is a resident size that stays near its peak. Returns False where there is no glibc
    (nothing to tune).
    """
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    if mallopt is None:
        return False
    return bool(mallopt(M_MMAP_MAX, 0)) and bool(mallopt(M_TRIM_THRESHOLD, KEPT_FREE_BYTES))


def serve(
    config: ServerConfig | None = None,
    *,
    threads: int | None = None,
    test_faults: bool = False,
    **options: object,
) -> int:
    """Run the server until SIGINT/SIGTERM; return the exit code.

    Without a `state_dir` the published policies go to a temporary directory that is removed
    at exit. Logs go to stderr; stdout carries only the ready line.

    Args:
        config: the whole configuration; or pass `ServerConfig`'s fields as `options`.
        threads: torch intra-op threads.
        test_faults: mount the test-only fault routes (`plies serve --test-faults`); refused
            unless the server binds a loopback address.
    """
    import torch

    logging.basicConfig(
        stream=sys.stderr, level=logging.INFO, format="%(asctime)s %(name)s %(message)s"
    )
    if threads:
        torch.set_num_threads(threads)
    scratch = None
    try:
        if config is None:
            config = ServerConfig(**{**options, "state_dir": options.get("state_dir") or "."})
        if config.token is None and not is_loopback(config.host):
            raise ConfigError(
                f"--host {config.host} reaches beyond this machine, where anyone who reaches "
                "the port could train, publish or replace the served policy: set a token "
                "(--token or PLIES_TOKEN; see docs/operations.md) or bind 127.0.0.1"
            )
        if test_faults and not is_loopback(config.host):
            raise ConfigError(
                f"--test-faults lets any client hold the trainer; it is refused on {config.host}, "
                "bind a loopback address"
            )
        if not config.model_dir.is_dir():
            raise ConfigError(f"model directory {config.model_dir} does not exist")
        weights_digest(config.model_dir)  # fail before binding a port, with a clear message
        sock = _listen(config.host, config.port)
    except ValidationError as e:  # its own words, without the input (it may be the token)
        parts = (f"{'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors())
        log.error("cannot serve: %s", "; ".join(parts))
        return 2
    except ConfigError as e:
        log.error("cannot serve: %s", e)
        return 2
    if "state_dir" in options and options["state_dir"] is None:
        scratch = Path(tempfile.mkdtemp(prefix="plies-serve-"))
        config = config.model_copy(update={"state_dir": scratch})
        log.info("no --state-dir: publishing to %s, removed at exit", scratch)
    if reuse_freed_memory():
        log.info("malloc: large blocks come from the heap and freed ones are reused")
    try:
        return anyio.run(_run, config, test_faults, sock)
    finally:
        sock.close()
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)


def _listen(host: str, port: int) -> socket.socket:
    """The bound socket, made before the model loads, so a busy port is one line of error."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        # Accepted connections inherit it: without it each kept-alive response waits out a
        # delayed ACK (about 40 ms on Linux loopback).
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.bind((host, port))
    except OSError as err:
        sock.close()
        raise ConfigError(f"cannot bind {host}:{port}: {err.strerror or err}") from err
    return sock


async def _run(config: ServerConfig, test_faults: bool, sock: socket.socket) -> int:
    import uvicorn

    app = create_app(config, test_faults=test_faults)
    host, port = sock.getsockname()[:2]
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            lifespan="on",
            log_level="warning",
            access_log=False,
            timeout_graceful_shutdown=5,
            timeout_keep_alive=SERVER_KEEPALIVE_S,
            http=SERVER_HTTP,
        )
    )
    async with anyio.create_task_group() as tg:

        async def run_server() -> None:
            try:
                await server.serve(sockets=[sock])
            finally:
                tg.cancel_scope.cancel()

        tg.start_soon(run_server)
        if (parent := os.environ.get(PARENT_PID_ENV)) is not None:
            tg.start_soon(_exit_with_parent, server, int(parent))
        while not server.started:
            await anyio.sleep(0.02)
        ref = app.state.plies.store.latest()
        url_host = f"[{host}]" if ":" in host else host
        line = {
            "url": f"http://{url_host}:{port}",
            "policy": ref.model_dump(mode="json"),
            "model": served_name(ref.version),
        }
        print(json.dumps(line), flush=True)
        decoding = "each request alone" if config.batch_invariant else "batched"
        log.info("ready at %s serving %s, decoding %s", line["url"], line["model"], decoding)
    return 0 if server.started else 1


PARENT_PID_ENV = "PLIES_PARENT_PID"
"""Set by `plies.testing`'s spawners to the spawning process's pid."""


async def _exit_with_parent(server: Any, parent: int) -> None:
    """Shut down gracefully once the process that started this server is gone.

    A spawned server runs in its own session so that a Ctrl-C meant for its parent does not
    reach it; a parent killed outright (SIGKILL, OOM) then cannot stop it, and nothing else
    would: the server would hold its port, memory and state directory forever.
    """
    while os.getppid() == parent:
        await anyio.sleep(1.0)
    log.warning("the process that started this server (pid %d) is gone; shutting down", parent)
    server.should_exit = True
