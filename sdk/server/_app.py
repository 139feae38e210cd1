"""The app factory: lifespan (store, engine, tokenizer), error mapping, and the routers."""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from .._exceptions import ConfigError
from ..wire.sampling import served_name
from ._config import ServerConfig
from ._engine import Engine, EngineOverloaded, UnknownPolicy
from ._faults import Faults, faults_router
from ._guard import Guard
from ._policies import PolicyStore
from ._quote import bounded
from ._sampling_routes import sampling_router
from ._state import ServerState
from ._training_routes import training_router

__all__ = ["create_app"]

log = logging.getLogger("plies.server")


def _tinker_service(config: ServerConfig, faults: Faults | None) -> Any:
    """The Tinker API service, or None when the `tinker` extra is not installed.

    The routes speak the SDK's own protobuf messages, so they need the SDK and its protobuf
    runtime, which only `plies[tinker]` installs. Their absence is asked of the import system
    first: an import error raised inside a present SDK is a real fault and propagates.
    """
    if importlib.util.find_spec("tinker") is None:
        log.info("the tinker package is not installed: no Tinker API (pip install 'plies[tinker]')")
        return None
    from ._tinker import TinkerService

    return TinkerService(config, faults)


def _error(status: int, message: str, kind: str) -> JSONResponse:
    return JSONResponse(
        {"error": {"message": bounded(message), "type": kind, "code": status}}, status_code=status
    )


def create_app(config: ServerConfig, *, test_faults: bool = False) -> FastAPI:
    """Build the reference server app. Loading happens at startup (the lifespan), off the loop.

    Startup opens the policy store under `config.state_dir` (version 0 = `config.model_dir`)
    and serves the latest published version as `served_name(version)`. With the `tinker`
    package installed, the Tinker API is served under `/api/v1/` too (docs/tinker.md).

    Args:
        config: what the server serves and how.
        test_faults: mount the test-only `/plies/test/` routes that hold the trainer at a
            fault point (see `_faults.py`). Never for a production server.
    """

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        from transformers import AutoTokenizer

        store = await anyio.to_thread.run_sync(PolicyStore.open, config.state_dir, config.model_dir)
        engine = Engine(config, store)
        latest = store.latest()
        path = store.path(latest.version)
        loaded: list[Any] = []

        async def load_tokenizer() -> None:
            loaded.append(await anyio.to_thread.run_sync(AutoTokenizer.from_pretrained, path))

        async with anyio.create_task_group() as tg:  # the two loads overlap
            tg.start_soon(load_tokenizer)
            await engine.load(served_name(latest.version), path)
        app.state.plies = ServerState(config, store, engine, loaded[0])
        async with anyio.create_task_group() as tg:
            await tg.start(engine.run)
            if tinker is not None:
                await tg.start(tinker.run, app.state.plies)
            yield
            tg.cancel_scope.cancel()

    app = FastAPI(title="plies reference server", lifespan=lifespan)
    faults = Faults() if test_faults else None
    app.include_router(sampling_router())
    app.include_router(training_router(faults))
    tinker = _tinker_service(config, faults)
    if tinker is not None:
        from ._tinker import tinker_router

        app.include_router(tinker_router(tinker))
    if faults is not None:
        app.include_router(faults_router(faults))
    app.add_middleware(
        Guard,
        token=config.token.get_secret_value() if config.token else None,
        max_body_bytes=config.max_body_bytes,
        max_training_body_bytes=config.max_training_body_bytes,
    )

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        parts = []
        for err in exc.errors():
            where = ".".join(str(p) for p in err.get("loc", ()) if p != "body")
            parts.append(f"{where}: {err.get('msg')}" if where else str(err.get("msg")))
        return _error(400, "; ".join(parts), "BadRequestError")

    @app.exception_handler(UnknownPolicy)
    async def _unknown(request: Request, exc: UnknownPolicy) -> JSONResponse:
        return _error(404, str(exc), "NotFoundError")

    @app.exception_handler(ConfigError)
    async def _bad(request: Request, exc: ConfigError) -> JSONResponse:
        return _error(400, str(exc), "BadRequestError")

    @app.exception_handler(EngineOverloaded)
    async def _overloaded(request: Request, exc: EngineOverloaded) -> JSONResponse:
        return _error(503, str(exc), "ServiceUnavailableError")

    return app
