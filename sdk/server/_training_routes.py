"""Training routes of the reference server, under `/v1/training/`.

- `POST forward_backward`, `POST optim_step`, `POST save_policy`: each body carries an
  `op_id`; a repeat gets the original answer (see `_trainer.py` for the journal).
- `GET ops/{op_id}`: the `OpRecord` of an applied op, 404 when it was never applied.
- `GET state`: generation, step, accumulated ops, the op in flight, the last policy saved.

The trainer opens lazily on the first training request, so a server used only for sampling
never loads a second copy of the model. Work runs in a worker thread; the trainer serialises
ops itself, so reads (`ops`, `state`) answer even while a step runs.

Errors are `{"error": {"message", "type", "code", "op_ids"}}` with `code` an `ErrorCode`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, TypeVar

import anyio
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from .._exceptions import ConfigError, TrainingGradientsLost
from ..training._wire import (
    ErrorCode,
    ForwardBackwardRequest,
    OptimStepRequest,
    SavePolicyRequest,
)
from ._app import server_state
from ._trainer import OpConflict, Trainer, TrainerBroken, TrainerConfig

__all__ = ["router"]

log = logging.getLogger("plies.server.training")

router = APIRouter(prefix="/v1/training")

T = TypeVar("T")


class _Holder:
    """The app's trainer, opened once on first use."""

    def __init__(self) -> None:
        self.trainer: Trainer | None = None
        self.lock = anyio.Lock()


async def _trainer(request: Request) -> Trainer:
    holder = getattr(request.app.state, "plies_trainer", None)
    if holder is None:  # no await since the lookup: only one task creates it
        holder = request.app.state.plies_trainer = _Holder()
    async with holder.lock:
        if holder.trainer is None:
            state = server_state(request)
            config = getattr(state.config, "trainer", None) or TrainerConfig()
            holder.trainer = await anyio.to_thread.run_sync(
                Trainer.open, state.config.state_dir, state.store, config, state.tokenizer
            )
    return holder.trainer


def _error(status: int, code: ErrorCode, message: str, op_ids: list[str] | None = None):
    body = {"message": message, "type": type(code).__name__, "code": code.value}
    if op_ids is not None:
        body["op_ids"] = op_ids
    return JSONResponse({"error": body}, status_code=status)


async def _apply(request: Request, fn: Callable[[Trainer], T]) -> T | JSONResponse:
    trainer = await _trainer(request)
    try:
        return await anyio.to_thread.run_sync(fn, trainer)
    except TrainingGradientsLost as exc:
        return _error(409, ErrorCode.GRADIENTS_LOST, str(exc), exc.op_ids)
    except OpConflict as exc:
        return _error(409, ErrorCode.OP_CONFLICT, str(exc))
    except ConfigError as exc:
        return _error(400, ErrorCode.INVALID_REQUEST, str(exc))
    except TrainerBroken as exc:
        return _error(503, ErrorCode.TRAINER_BROKEN, str(exc))


@router.post("/forward_backward")
async def forward_backward(body: ForwardBackwardRequest, request: Request) -> Any:
    return await _apply(request, lambda t: t.forward_backward(body))


@router.post("/optim_step")
async def optim_step(body: OptimStepRequest, request: Request) -> Any:
    return await _apply(request, lambda t: t.optim_step(body))


@router.post("/save_policy")
async def save_policy(body: SavePolicyRequest, request: Request) -> Any:
    return await _apply(request, lambda t: t.save_policy(body))


@router.get("/ops/{op_id}")
async def op(op_id: str, request: Request) -> Any:
    record = (await _trainer(request)).op(op_id)
    if record is None:
        return _error(404, ErrorCode.UNKNOWN_OP, f"op {op_id} was never applied")
    return record


@router.get("/state")
async def state(request: Request) -> Any:
    return (await _trainer(request)).state()
