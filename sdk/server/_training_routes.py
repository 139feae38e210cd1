"""Training routes of the reference server, under `/v1/training/`.

- `POST forward_backward`, `POST optim_step`, `POST save_policy`: each body carries an
  `op_id`; a repeat gets the original answer (see `_trainer.py` and `_journal.py`).
- `GET ops/{op_id}`: the `OpRecord` of an applied op, 404 when it was never applied.
- `GET state`: generation, step, accumulated ops, the op in flight, the last policy saved.

The trainer opens lazily on the first training request, so a server used only for sampling
never loads a second copy of the model. Work runs in a worker thread; the trainer serialises
ops itself, so reads (`ops`, `state`) answer even while a step runs.

Errors are `{"error": {"message", "type", "code", "op_ids"}}` with `code` an `ErrorCode`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import anyio
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from .._exceptions import ConfigError, TrainingError, TrainingGradientsLost
from ..wire.training import (
    ErrorCode,
    ForwardBackwardRequest,
    OptimStepRequest,
    SavePolicyRequest,
)
from ._faults import Faults
from ._quote import bounded
from ._state import server_state
from ._trainer import OpConflict, Trainer

__all__ = ["training_router"]

T = TypeVar("T")


class _LazyTrainer:
    """The app's trainer, opened once on first use."""

    def __init__(self, faults: Faults | None) -> None:
        self.faults = faults
        self.trainer: Trainer | None = None
        self.lock = anyio.Lock()

    async def get(self, request: Request) -> Trainer:
        async with self.lock:
            if self.trainer is None:
                state = server_state(request)
                self.trainer = await anyio.to_thread.run_sync(
                    lambda: Trainer.open(
                        state.config.state_dir,
                        state.store,
                        state.config.trainer,
                        state.tokenizer,
                        faults=self.faults,
                    )
                )
        return self.trainer


def _error(
    status: int, code: ErrorCode, message: str, op_ids: list[str] | None = None
) -> JSONResponse:
    body: dict[str, Any] = {
        "message": bounded(message),
        "type": type(code).__name__,
        "code": code.value,
    }
    if op_ids is not None:
        body["op_ids"] = op_ids
    return JSONResponse({"error": body}, status_code=status)


def training_router(faults: Faults | None = None) -> APIRouter:
    """The training routes over one lazily opened trainer (held at `faults` in tests)."""
    router = APIRouter(prefix="/v1/training")
    lazy = _LazyTrainer(faults)

    async def apply(request: Request, fn: Callable[[Trainer], T]) -> T | JSONResponse:
        try:
            trainer = await lazy.get(request)
            return await anyio.to_thread.run_sync(fn, trainer)
        except TrainingGradientsLost as exc:
            return _error(409, ErrorCode.GRADIENTS_LOST, str(exc), exc.op_ids)
        except OpConflict as exc:
            return _error(409, ErrorCode.OP_CONFLICT, str(exc))
        except ConfigError as exc:
            return _error(400, ErrorCode.INVALID_REQUEST, str(exc))
        except TrainingError as exc:  # TrainerBroken, or a state dir that cannot be opened
            return _error(503, ErrorCode.TRAINER_BROKEN, str(exc))

    @router.post("/forward_backward")
    async def forward_backward(body: ForwardBackwardRequest, request: Request) -> Any:
        limit = server_state(request).config.max_model_len
        long = next((i for i, d in enumerate(body.batch.data) if len(d.tokens) > limit), None)
        if long is not None:
            size = len(body.batch.data[long].tokens)
            message = f"datum {long} has {size} tokens, over max_model_len {limit}"
            return _error(400, ErrorCode.INVALID_REQUEST, message)
        return await apply(request, lambda t: t.forward_backward(body))

    @router.post("/optim_step")
    async def optim_step(body: OptimStepRequest, request: Request) -> Any:
        return await apply(request, lambda t: t.optim_step(body))

    @router.post("/save_policy")
    async def save_policy(body: SavePolicyRequest, request: Request) -> Any:
        return await apply(request, lambda t: t.save_policy(body))

    @router.get("/ops/{op_id}")
    async def op(op_id: str, request: Request) -> Any:
        record = await apply(request, lambda t: t.op(op_id))
        if record is None:
            return _error(404, ErrorCode.UNKNOWN_OP, f"op {op_id} was never applied")
        return record

    @router.get("/state")
    async def state(request: Request) -> Any:
        return await apply(request, lambda t: t.state())

    return router
