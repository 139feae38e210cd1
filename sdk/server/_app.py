"""The HTTP app: vLLM-shaped sampling routes over the batching engine and the policy store."""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from .._exceptions import ConfigError
from ._config import ServerConfig
from ._engine import Engine, EngineOverloaded, GenerateParams, UnknownPolicy
from ._policies import PolicyStore, served_name
from ._wire import (
    CompletionRequest,
    GenerateRequest,
    LoadPolicyRequest,
    ModelCard,
    UnloadPolicyRequest,
)

__all__ = ["ServerState", "create_app", "server_state"]

log = logging.getLogger("plies.server")


@dataclass
class ServerState:
    """What routes share: set on `app.state.plies` when the app starts."""

    config: ServerConfig
    store: PolicyStore
    engine: Engine
    tokenizer: Any


def server_state(request: Request) -> ServerState:
    """The running server's state, for route handlers (the training routes use it too)."""
    return request.app.state.plies


def _error(status: int, message: str, kind: str) -> JSONResponse:
    return JSONResponse(
        {"error": {"message": message, "type": kind, "code": status}}, status_code=status
    )


def create_app(config: ServerConfig) -> FastAPI:
    """Build the reference server app. Loading happens at startup (the lifespan), off the loop.

    Startup opens the policy store under `config.state_dir` (version 0 = `config.model_dir`)
    and serves the latest published version as `served_name(version)`.
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
            yield
            tg.cancel_scope.cancel()

    app = FastAPI(title="plies reference server", lifespan=lifespan)
    from ._training_routes import router as training_router  # it imports server_state

    app.include_router(training_router)

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

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def list_models(request: Request) -> dict[str, Any]:
        state = server_state(request)
        cards = [
            ModelCard(id=name, root=ref.uri, plies_policy=ref).model_dump(mode="json")
            for name, ref in state.engine.served().items()
        ]
        return {"object": "list", "data": cards}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> dict[str, Any]:
        state = server_state(request)
        params = GenerateParams(
            max_tokens=body.max_tokens,
            temperature=body.temperature,
            top_p=body.top_p,
            top_k=body.top_k if body.top_k and body.top_k > 0 else -1,
            seed=body.seed,
            stop_token_ids=frozenset(body.stop_token_ids or ()),
            ignore_eos=body.ignore_eos,
        )
        result = await state.engine.generate(body.model, body.prompt, params)
        tok = state.tokenizer
        text = tok.decode(result.ids, skip_special_tokens=body.skip_special_tokens)
        logprobs = None
        if body.logprobs is not None:
            if body.return_tokens_as_token_ids:
                tokens = [f"token_id:{t}" for t in result.ids]
            else:
                tokens = tok.convert_ids_to_tokens(result.ids)
            logprobs = {
                "tokens": tokens,
                "token_logprobs": result.logprobs,
                "top_logprobs": None,
                "text_offset": None,
            }
        choice: dict[str, Any] = {
            "index": 0,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": result.finish_reason,
            "stop_reason": result.stop_reason,
        }
        if body.return_token_ids:
            choice["token_ids"] = result.ids
            choice["prompt_token_ids"] = body.prompt
        n_out = len(result.ids)
        return {
            "id": f"cmpl-{uuid.uuid4().hex}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": body.model,
            "choices": [choice],
            "usage": {
                "prompt_tokens": len(body.prompt),
                "completion_tokens": n_out,
                "total_tokens": len(body.prompt) + n_out,
            },
            "plies_policy": result.policy.model_dump(mode="json"),
        }

    @app.post("/generate")
    async def generate(body: GenerateRequest, request: Request) -> dict[str, Any]:
        state = server_state(request)
        served = state.engine.served()
        if not served:
            raise UnknownPolicy("no policy is loaded")
        name = list(served)[-1]
        sp = body.sampling_params
        params = GenerateParams(
            max_tokens=sp.max_new_tokens,
            temperature=sp.temperature,
            top_p=sp.top_p,
            top_k=sp.top_k if sp.top_k > 0 else -1,
            seed=sp.sampling_seed,
            stop_token_ids=frozenset(sp.stop_token_ids or ()),
            ignore_eos=sp.ignore_eos,
        )
        result = await state.engine.generate(name, body.input_ids, params)
        ids = result.ids
        if result.finish_reason == "stop" and not sp.no_stop_trim:
            ids = ids[:-1]
        meta: dict[str, Any] = {
            "id": uuid.uuid4().hex,
            "finish_reason": {
                "type": result.finish_reason,
                "matched": result.ids[-1] if result.finish_reason == "stop" else None,
            },
            "prompt_tokens": len(body.input_ids),
            "completion_tokens": len(result.ids),
            "weight_version": str(result.policy.version),
        }
        if body.return_logprob:
            meta["output_token_logprobs"] = [
                [lp, t, None] for t, lp in zip(result.ids, result.logprobs, strict=True)
            ]
        return {
            "text": state.tokenizer.decode(ids, skip_special_tokens=sp.skip_special_tokens),
            "output_ids": result.ids,
            "meta_info": meta,
        }

    @app.post("/v1/load_lora_adapter")
    async def load_policy(body: LoadPolicyRequest, request: Request) -> dict[str, Any]:
        state = server_state(request)
        ref = await state.engine.load(
            body.lora_name, Path(body.lora_path), replace=body.load_inplace
        )
        return {"status": "loaded", "name": body.lora_name, "plies_policy": ref.model_dump()}

    @app.post("/v1/unload_lora_adapter")
    async def unload_policy(body: UnloadPolicyRequest, request: Request) -> dict[str, Any]:
        ref = server_state(request).engine.unload(body.lora_name)
        return {"status": "unloaded", "name": body.lora_name, "plies_policy": ref.model_dump()}

    @app.get("/plies/stats")
    async def stats(request: Request) -> dict[str, Any]:
        return asdict(server_state(request).engine.statistics())

    @app.get("/plies/policies")
    async def policies(request: Request) -> dict[str, Any]:
        store = server_state(request).store
        refs = [store.get(v).model_dump() for v in store.versions()]
        return {"published": refs}

    return app
