"""The op ledger both training clients keep, and the one retry policy they use.

`TrainingClient` (plies' wire) and `TinkerTrainingClient` (the Tinker API) promise the same
thing: every op applies once, and an op whose outcome cannot be learnt stops the client
rather than being sent blind. The bookkeeping behind that promise is the same on both, so it
lives here once, in `OpLedger`:

- op ids: given (checked) or issued, refused while the client is quarantined;
- answered ops: an op id this client completed answers its original result without sending
  anything; reused for another request it is a `ConfigError`;
- pending gradients: the forward_backward ops the next `optim_step` applies;
- the quarantine: why the client refuses further steps, and what `reconcile()` needs to
  learn the outcome (the op id on the native wire, the SDK future on Tinker).

`LedgeredTrainer` writes the `Trainer` operations once over that ledger; each client only
sends.
"""

from __future__ import annotations

import hashlib
import uuid
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from .._exceptions import ConfigError, TrainingQuarantined
from ..trajectory import PolicyRef
from ..wire.training import (
    AdamParams,
    ForwardBackwardResult,
    LossName,
    OptimStepResult,
    TrainingBatch,
    check_op_id,
)

__all__ = [
    "ANSWERED_KEPT",
    "LedgeredTrainer",
    "OpLedger",
    "PendingOp",
    "Quarantine",
    "digest",
]

ANSWERED_KEPT = 1024
"""Answered ops a client remembers (newest first out last): a script repeats an op id only
to resume the step it was on, so the recent ones are all it can ask for, and memory stays
flat over a long run. Older ones are still answered by a native server's own ledger."""

H = TypeVar("H")
R = TypeVar("R")


def digest(*parts: object) -> str:
    """What identifies a request, so a reused op id naming another request is caught."""
    return hashlib.sha256(repr(parts).encode()).hexdigest()


@dataclass(frozen=True, slots=True)
class PendingOp:
    """A forward_backward whose gradients wait for the next `optim_step`."""

    op_id: str
    tokens: int
    """Its batch's masked tokens."""


@dataclass(slots=True)
class Quarantine(Generic[H]):
    """Why a client refuses further steps, and what it holds to learn the outcome."""

    op_id: str
    why: str
    held: H


class OpLedger(Generic[H]):
    """One client's ops: issued ids, answered results, pending gradients, the quarantine.

    Args:
        unique_ids: issue ids unique across clients (`fb-<uuid>`): the native server keeps
            one ledger for every client. Otherwise ids count up per client (`fb-1`), which
            is enough where the ledger is this client's alone (Tinker).
        how_to_resume: what a quarantined client's errors tell the caller to do.
    """

    def __init__(self, *, unique_ids: bool, how_to_resume: str) -> None:
        self.unique_ids = unique_ids
        self.how_to_resume = how_to_resume
        self.pending: list[PendingOp] = []
        self.quarantine: Quarantine[H] | None = None
        self._answered: OrderedDict[str, tuple[str, Any]] = OrderedDict()
        self._issued = 0

    @property
    def why_quarantined(self) -> str | None:
        return None if self.quarantine is None else self.quarantine.why

    def issue(self, op_id: str | None, kind: str) -> str:
        """The op id to send: `op_id` checked, or a new one.

        Raises:
            TrainingQuarantined: the client refuses further steps.
            ConfigError: `op_id` is not a valid op id.
        """
        if self.quarantine is not None:
            raise TrainingQuarantined(
                f"training client quarantined: {self.quarantine.why}; {self.how_to_resume}"
            )
        if op_id is not None:
            return check_op_id(op_id)
        if self.unique_ids:
            return f"{kind}-{uuid.uuid4().hex}"
        self._issued += 1
        return f"{kind}-{self._issued}"

    def answered(self, op_id: str, request: str) -> Any:
        """The result this client already had for `op_id`, or None.

        Raises:
            ConfigError: `op_id` was used for another request.
        """
        known = self._answered.get(op_id)
        if known is None:
            return None
        if known[0] != request:
            raise ConfigError(f"op id {op_id!r} was already used for another request")
        return known[1]

    def answer(self, op_id: str, request: str, result: Any) -> None:
        """Remember `result` as the answer to `op_id`."""
        self._answered[op_id] = (request, result)
        self._answered.move_to_end(op_id)
        while len(self._answered) > ANSWERED_KEPT:
            self._answered.popitem(last=False)

    def add_pending(self, op_id: str, tokens: int) -> None:
        if all(p.op_id != op_id for p in self.pending):
            self.pending.append(PendingOp(op_id, tokens))

    def take_pending(self) -> list[PendingOp]:
        """The pending ops, now applied (or lost): the list starts again empty."""
        pending, self.pending = self.pending, []
        return pending

    def enter_quarantine(self, op_id: str, why: str, held: H) -> TrainingQuarantined:
        """Refuse further steps; the error to raise says why and what to do."""
        self.quarantine = Quarantine(op_id, why, held)
        return TrainingQuarantined(
            f"training client quarantined: {why}. It refuses further steps; {self.how_to_resume}"
        )

    def lift_quarantine(self) -> None:
        self.quarantine = None


class LedgeredTrainer(ABC):
    """The `Trainer` operations of both training clients, written once over their `OpLedger`.

    Before anything is sent, the op id is issued (or checked) and looked up: an op id this
    client completed answers its original result, and one reused for another request is a
    `ConfigError`. Once the op answers, its result is remembered. What each client sends is
    its own: `_forward_backward`, `_optim_step` and `_save_policy`, given the op id.
    """

    _ops: OpLedger[Any]

    @property
    def pending_ops(self) -> list[str]:
        """forward_backward ops whose gradients the next `optim_step` will apply."""
        return [p.op_id for p in self._ops.pending]

    @property
    def quarantined(self) -> str | None:
        """Why the client refuses further steps, or None."""
        return self._ops.why_quarantined

    async def forward_backward(
        self,
        batch: TrainingBatch,
        *,
        loss: LossName = "importance_sampling",
        clip_low: float = 0.2,
        clip_high: float = 0.2,
        op_id: str | None = None,
    ) -> ForwardBackwardResult:
        """Add the gradients of `batch` (mean loss over its masked tokens) to the step.

        Raises:
            TrainingGradientsLost: the trainer lost or failed this step's gradients; redo the
                step's forward_backward calls.
            TrainingQuarantined: the outcome could not be learnt in time.
            ConfigError: the trainer refused the request as invalid.
        """
        request = ("fb", batch.model_dump_json(), loss, clip_low, clip_high)
        return await self._once(
            op_id, request, lambda op: self._forward_backward(op, batch, loss, clip_low, clip_high)
        )

    async def optim_step(self, adam: AdamParams, *, op_id: str | None = None) -> OptimStepResult:
        """Apply the accumulated gradients with AdamW; exactly the ops in `pending_ops`."""
        request = ("step", adam.model_dump_json())
        return await self._once(op_id, request, lambda op: self._optim_step(op, adam))

    async def save_policy(self, *, op_id: str | None = None) -> PolicyRef:
        """Save the current weights as a new immutable policy and return its `PolicyRef`.

        Samplers serve it once it is published to them (`plies.policy.publish`).
        """
        policy = await self._once(op_id, ("save",), self._save_policy)
        await self._after_save()
        return policy

    async def _once(
        self, op_id: str | None, request: tuple[Any, ...], send: Callable[[str], Awaitable[R]]
    ) -> R:
        """`send(op_id)`, unless this client already answered the op id."""
        op_id = self._op_id(op_id, request[0])
        key = digest(*request)
        if (known := self._ops.answered(op_id, key)) is not None:
            return known
        result = await send(op_id)
        self._ops.answer(op_id, key, result)
        return result

    def _op_id(self, op_id: str | None, kind: str) -> str:
        op_id = self._ops.issue(op_id, kind)
        self._client()  # refuses a client that is not open
        return op_id

    @abstractmethod
    def _client(self) -> Any:
        """What sends the ops; raises `UsageError` while the client is not open."""

    @abstractmethod
    async def _forward_backward(
        self, op_id: str, batch: TrainingBatch, loss: LossName, clip_low: float, clip_high: float
    ) -> ForwardBackwardResult: ...

    @abstractmethod
    async def _optim_step(self, op_id: str, adam: AdamParams) -> OptimStepResult: ...

    @abstractmethod
    async def _save_policy(self, op_id: str) -> PolicyRef: ...

    @abstractmethod
    async def _after_save(self) -> None:
        """Housekeeping after a save, once its answer is in the ledger: a cancellation here
        cannot make a retry of the same op id save again."""
