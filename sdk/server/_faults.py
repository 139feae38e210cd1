"""Test-only fault points: hold the trainer at a named point, so a test can crash it there.

Exactly-once is tested by killing the server while an op is in flight at a known point
(before its gradients are applied, or after it is journaled but before it is answered). The
server reaches those points only through `Faults`, which exists only in an app built with
`create_app(config, test_faults=True)` (`plies serve --test-faults`, refused unless bound to
loopback). Production configuration has no such knob, and without the flag these routes do
not exist.

- `POST /plies/test/hold {"point": "before_apply", "timeout_s": 600}`: the next op to reach
  `point` waits there until released (or for `timeout_s`).
- `POST /plies/test/release`: held ops go on; nothing stays armed.
"""

from __future__ import annotations

import threading
from typing import Literal

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, Field

__all__ = ["FaultPoint", "Faults", "faults_router"]

FaultPoint = Literal["before_apply", "before_answer"]
"""`before_apply`: a forward_backward about to add its gradients (nothing journaled yet);
`before_answer`: a forward_backward applied and journaled, its answer not yet sent."""


class HoldRequest(BaseModel):
    """`POST /plies/test/hold`."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    point: FaultPoint
    timeout_s: float = Field(default=600.0, gt=0.0, description="Longest the op is held.")


class Faults:
    """Holds armed by a test; the trainer calls `reached` at each point (in its worker thread)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._armed: dict[str, float] = {}
        self._released = threading.Event()

    def hold(self, point: FaultPoint, timeout_s: float) -> None:
        """Make the next op that reaches `point` wait there."""
        with self._lock:
            self._armed[point] = timeout_s
            self._released.clear()

    def release(self) -> None:
        """Let every held op go on and disarm every point."""
        with self._lock:
            self._armed.clear()
            self._released.set()

    def reached(self, point: FaultPoint) -> None:
        """Block here if `point` is armed (once: the hold is consumed)."""
        with self._lock:
            timeout_s = self._armed.pop(point, None)
        if timeout_s is not None:
            self._released.wait(timeout_s)


def faults_router(faults: Faults) -> APIRouter:
    """The routes that arm and release `faults`; mounted only by `test_faults=True`."""
    router = APIRouter(prefix="/plies/test")

    @router.post("/hold")
    async def hold(body: HoldRequest) -> dict[str, str]:
        faults.hold(body.point, body.timeout_s)
        return {"status": "armed", "point": body.point}

    @router.post("/release")
    async def release() -> dict[str, str]:
        faults.release()
        return {"status": "released"}

    return router
