"""The Tinker API routes under `/api/v1/`, as `tinker==0.38.0` calls them.

Handlers parse and check the request (a refusal is a 400/404 with a `detail`, see
`_errors.py`), hand the work to the `TinkerService`, and answer submits with a future at
once. Anything else under `/api/v1/` answers 404 with a message saying it is not supported
yet, so the SDK fails fast instead of retrying.
"""

from __future__ import annotations

import contextlib
import functools
import json
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError

from ._errors import TinkerRequestError, error_response
from ._futures import body_digest
from ._proto import check_forward_backward, parse_forward_backward
from ._schemas import (
    AsampleRequest,
    CreateModelRequest,
    CreateSamplingSessionRequest,
    GetInfoRequest,
    LoadWeightsRequest,
    OptimStepRequest,
    SaveForSamplerRequest,
    SaveWeightsRequest,
    UnloadModelRequest,
    WeightsInfoRequest,
)
from ._service import SAMPLE_PREFIX, TinkerService

__all__ = ["tinker_router"]

PROTOBUF = "application/x-protobuf"

Handler = Callable[..., Awaitable[Any]]


def _consume(service: TinkerService, model_id: object, seq_id: object, digest: str) -> None:
    """Mark a refused ordered op's seq_id consumed, so the client's next op is not held."""
    if isinstance(model_id, str) and isinstance(seq_id, int):
        service.refuse(model_id, seq_id, digest)


@contextlib.contextmanager
def _consuming(
    service: TinkerService, model_id: object, seq_id: object, digest: str
) -> Iterator[None]:
    """Validate an ordered op; if it is refused, its seq_id is consumed all the same (the SDK
    moves on to the next seq_id after a 4xx, and the queue must not wait for this one)."""
    try:
        yield
    except (TinkerRequestError, ValidationError):
        _consume(service, model_id, seq_id, digest)
        raise


def _guarded(fn: Handler) -> Handler:
    """Answer a refusal in Tinker's error shape instead of FastAPI's."""

    @functools.wraps(fn)
    async def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return await fn(*args, **kwargs)
        except TinkerRequestError as exc:
            return error_response(str(exc), exc.status)
        except ValidationError as exc:
            parts = []
            for err in exc.errors():
                where = ".".join(str(p) for p in err.get("loc", ()))
                parts.append(f"{where}: {err.get('msg')}" if where else str(err.get("msg")))
            return error_response("invalid request: " + "; ".join(parts))

    return wrapper


async def _raw(request: Request) -> bytes:
    """The body, as the door (`_guard.py`) left it: capped, and decompressed if it was zstd."""
    return await request.body()


def _json(body: bytes) -> dict[str, Any]:
    try:
        data = json.loads(body) if body else {}
    except ValueError:
        raise TinkerRequestError("the request body is not JSON") from None
    except RecursionError:
        raise TinkerRequestError("the request body is nested too deeply") from None
    if not isinstance(data, dict):
        raise TinkerRequestError("the request body is not a JSON object")
    return data


async def _parse(request: Request, model: type[BaseModel]) -> tuple[Any, str]:
    body = await _raw(request)
    return model.model_validate(_json(body)), body_digest(body)


def tinker_router(service: TinkerService) -> APIRouter:
    """The Tinker routes over `service`."""
    router = APIRouter(prefix="/api/v1")
    limits = service.limits

    @router.post("/client/config")
    async def client_config() -> dict[str, Any]:
        return {}  # the SDK's defaults; the three opt-in features stay off

    @router.post("/client/dynamic_config")
    async def dynamic_config() -> dict[str, Any]:
        return {
            "refresh_interval_sec": 300,
            "sample_cancel_enabled": False,
            "sample_cancel_max_batch_size": 64,
        }

    @router.post("/create_session")
    async def create_session() -> dict[str, Any]:
        return {"session_id": service.create_session()}

    @router.post("/session_heartbeat")
    async def heartbeat() -> dict[str, Any]:
        return {"type": "session_heartbeat"}

    @router.post("/sessions/{session_id}/finish")
    async def finish(session_id: str) -> dict[str, Any]:
        service.finish_session(session_id)
        return {}

    @router.post("/telemetry")
    async def telemetry() -> dict[str, Any]:
        return {"status": "accepted"}

    @router.get("/healthz")
    async def healthz() -> dict[str, Any]:
        return {"status": "ok"}

    @router.get("/get_server_capabilities")
    async def capabilities() -> dict[str, Any]:
        model = {
            "model_name": service.model_name,
            "max_context_length": service.config.max_model_len,
            "trainable": True,
            "sampleable": True,
        }
        return {"supported_models": [model]}

    def json_route(path: str, schema: type[BaseModel], handle: Callable[[Any], Any]) -> None:
        """A JSON route: validate the body as `schema`, then `handle(request)`."""

        @router.post(path)
        @_guarded
        async def route(request: Request) -> Any:
            req, _ = await _parse(request, schema)
            return handle(req)

    def ordered_route(
        path: str, schema: type[BaseModel], handle: Callable[[Any, str, bytes], Any]
    ) -> None:
        """A JSON route for an op with a `seq_id` (which a refusal still consumes):
        `handle(request, body_digest, body)`, the body for the tenant's op log."""

        @router.post(path)
        @_guarded
        async def route(request: Request) -> Any:
            body = await _raw(request)
            data = _json(body)
            digest = body_digest(body)
            with _consuming(service, data.get("model_id"), data.get("seq_id"), digest):
                return handle(schema.model_validate(data), digest, body)

    ordered_route("/create_model", CreateModelRequest, service.create_model)
    ordered_route("/optim_step", OptimStepRequest, service.optim_step)
    ordered_route("/save_weights_for_sampler", SaveForSamplerRequest, service.save_for_sampler)
    ordered_route("/save_weights", SaveWeightsRequest, service.save_weights)
    ordered_route("/load_weights", LoadWeightsRequest, service.load_weights)
    json_route("/get_info", GetInfoRequest, lambda req: service.info(req.model_id))
    json_route("/asample", AsampleRequest, service.asample)
    json_route("/unload_model", UnloadModelRequest, lambda req: service.unload_model(req.model_id))
    json_route(
        "/weights_info",
        WeightsInfoRequest,
        lambda req: service.runs_view().weights_info(req.tinker_path),
    )

    @router.get("/training_runs")
    @_guarded
    async def training_runs(limit: int = 20, offset: int = 0) -> Any:
        return service.runs_view().list_runs(limit, offset)

    @router.get("/training_runs/{run_id}")
    @_guarded
    async def training_run(run_id: str) -> Any:
        return service.runs_view().run(run_id)

    @router.get("/training_runs/{run_id}/checkpoints")
    @_guarded
    async def run_checkpoints(run_id: str) -> Any:
        return {"checkpoints": service.runs_view().checkpoints(run_id)}

    @router.delete("/training_runs/{run_id}/checkpoints/{checkpoint_id:path}")
    @_guarded
    async def delete_checkpoint(run_id: str, checkpoint_id: str) -> Any:
        service.runs_view().delete(run_id, checkpoint_id)
        return {}

    @router.get("/checkpoints")
    @_guarded
    async def checkpoints(limit: int = 100, offset: int = 0) -> Any:
        return service.runs_view().list_checkpoints(limit, offset)

    @router.post("/forward_backward")
    @_guarded
    async def forward_backward(request: Request) -> Any:
        body = await _raw(request)
        msg = parse_forward_backward(body)
        digest = body_digest(body)
        service.tenant(msg.model_id)
        with _consuming(service, msg.model_id, msg.seq_id, digest):
            inp = check_forward_backward(
                msg,
                vocab=service.vocab,
                max_len=service.config.max_model_len,
                max_datums=limits.max_datums,
            )
        return service.forward_backward(inp, digest, body)

    @router.post("/create_sampling_session")
    @_guarded
    async def create_sampling_session(request: Request) -> Any:
        req, _ = await _parse(request, CreateSamplingSessionRequest)
        sampler_id = service.create_sampler(
            req.session_id, req.sampling_session_seq_id, req.model_path, req.base_model
        )
        return {"sampling_session_id": sampler_id}

    @router.get("/samplers/{sampler_id}")
    @_guarded
    async def sampler(sampler_id: str) -> Any:
        assert service.samplers is not None
        s = service.samplers.get(sampler_id)
        return {"sampler_id": s.sampler_id, "base_model": s.base_model, "model_path": s.model_path}

    @router.post("/retrieve_future")
    @_guarded
    async def retrieve_future(request: Request) -> Any:
        data = _json(await _raw(request))
        rid = data.get("request_id")
        if not isinstance(rid, str):
            raise TinkerRequestError("retrieve_future needs a request_id")
        try:
            value = await service.futures.wait(rid, limits.poll_seconds)
        except TinkerRequestError:
            if rid.startswith(SAMPLE_PREFIX + "-"):
                raise TinkerRequestError(
                    f"sample {rid} is gone (the server restarted); sample again", status=410
                ) from None
            raise
        if value is None:
            body = {"type": "try_again", "request_id": rid, "queue_state": "active"}
            return JSONResponse(body, status_code=408)
        if isinstance(value, bytes):
            return Response(value, media_type=PROTOBUF)
        return value

    @router.api_route("/{rest:path}", methods=["GET", "POST", "PUT", "DELETE", "PATCH"])
    async def unsupported(rest: str, request: Request) -> JSONResponse:
        body = await request.body()
        with contextlib.suppress(ValueError, TinkerRequestError):
            data = _json(body)  # an ordered op (save_weights) still consumes its seq_id
            _consume(service, data.get("model_id"), data.get("seq_id"), body_digest(body))
        return error_response(
            f"{request.method} /api/v1/{rest} is not supported by plies serve yet", status=404
        )

    return router
