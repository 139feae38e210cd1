"""`TrainingClient`: drive a remote trainer so that every step applies exactly once.

Each call carries an operation id (generated, or given for scripts that resume). Outcomes:

- answered: the result, or a typed error (`TrainingGradientsLost`, `ConfigError`);
- never reached the server (connection refused): sent again, with the same id, until
  `reconcile_timeout`;
- unknown (the connection dropped or timed out mid-request, or a 5xx): the client asks the
  server `GET /v1/training/ops/{op_id}`. An applied op's original result comes back; an op
  the server never applied is sent again with the same id (the server deduplicates, so even
  a race with a late first copy applies once); if the server cannot be asked before
  `reconcile_timeout`, the session is quarantined: every later call raises
  `TrainingQuarantined` until `reconcile()` succeeds. Nothing is ever replayed blind.

The client remembers the forward_backward ops whose gradients wait for the next
`optim_step` and names them in it, so the server never steps on partial gradients.
"""

from __future__ import annotations

import time
from typing import Any, TypeVar

import httpx
from pydantic import BaseModel, ValidationError

from .._exceptions import (
    ConfigError,
    TrainingError,
    TrainingGradientsLost,
    TrainingQuarantined,
    UsageError,
)
from .._lifecycle import AsyncCloseable
from .._net import CLIENT_KEEPALIVE_S, http_base_url
from .._retry import RetryPolicy
from ..trajectory import PolicyRef
from ..wire.training import (
    AdamParams,
    ErrorCode,
    ForwardBackwardRequest,
    ForwardBackwardResult,
    LossName,
    OpRecord,
    OpStatus,
    OptimStepRequest,
    OptimStepResult,
    SavePolicyRequest,
    SavePolicyResult,
    TrainerState,
    TrainingBatch,
    check_op_id,
)
from ._ops import LedgeredTrainer, OpLedger

__all__ = ["TrainingClient"]

R = TypeVar("R", bound=BaseModel)

_NEVER_SENT = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout)
"""Transport errors raised before any byte of the request left: the server saw nothing."""


class _Unreachable(Exception):
    """The server could not be asked; internal to reconciliation."""


UNTIL_DEADLINE = RetryPolicy(attempts=None)
"""The training client's default: tries bounded by `reconcile_timeout` alone."""


def _error_body(resp: httpx.Response) -> dict[str, Any]:
    try:
        body = resp.json()
    except ValueError:
        return {"message": resp.text[:500]}
    err = body.get("error", body) if isinstance(body, dict) else body
    return err if isinstance(err, dict) else {"message": str(err)}


class TrainingClient(AsyncCloseable, LedgeredTrainer):
    """Async client of a plies trainer (`plies serve`). Use as `async with`; opens once.

    Args:
        base_url: the server, e.g. the `url` of `plies serve`'s ready line.
        timeout: seconds a request may take (a large forward_backward on CPU is slow).
        reconcile_timeout: seconds to keep asking the server about an op whose outcome is
            unknown (or to keep resending one that never arrived) before giving up.
        retry: the waits between those tries (plies' one `RetryPolicy`); its `attempts`,
            if set, bound them as well as `reconcile_timeout` does.

    Example:
        async with TrainingClient(url) as trainer:
            await trainer.forward_backward(batch, loss="ppo")
            await trainer.optim_step(AdamParams(lr=1e-4))
            policy = await trainer.save_policy()
        await publish(policy, [sampler])  # plies.policy.publish: samplers load it
    """

    def __init__(
        self,
        base_url: str,
        *,
        timeout: float = 600.0,
        reconcile_timeout: float = 60.0,
        retry: RetryPolicy = UNTIL_DEADLINE,
        headers: dict[str, str] | None = None,
    ):
        self.base_url = http_base_url(base_url)
        self.timeout = timeout
        self.reconcile_timeout = reconcile_timeout
        self.retry = retry
        self._headers = dict(headers or {})
        self._http: httpx.AsyncClient | None = None
        self._ops: OpLedger[None] = OpLedger(
            unique_ids=True,
            how_to_resume="call reconcile() once the trainer is reachable, then decide how "
            "to continue",
        )

    # -- lifetime -------------------------------------------------------------------------

    async def __aenter__(self) -> TrainingClient:
        self._open()
        self._http = httpx.AsyncClient(
            base_url=self.base_url,
            timeout=httpx.Timeout(self.timeout, connect=5.0),
            headers=self._headers,
            limits=httpx.Limits(keepalive_expiry=CLIENT_KEEPALIVE_S),
        )
        return self

    async def aclose(self) -> None:
        """Close connections. Safe to call more than once."""
        self._close()
        if self._http is not None:
            http, self._http = self._http, None
            await http.aclose()

    # -- operations -----------------------------------------------------------------------

    async def _forward_backward(
        self, op_id: str, batch: TrainingBatch, loss: LossName, clip_low: float, clip_high: float
    ) -> ForwardBackwardResult:
        req = ForwardBackwardRequest(
            op_id=op_id, batch=batch, loss=loss, clip_low=clip_low, clip_high=clip_high
        )
        result = await self._submit("/v1/training/forward_backward", req, ForwardBackwardResult)
        self._ops.add_pending(result.op_id, batch.loss_tokens)
        return result

    async def _optim_step(self, op_id: str, adam: AdamParams) -> OptimStepResult:
        req = OptimStepRequest(op_id=op_id, adam=adam, forward_backward_ops=self.pending_ops)
        result = await self._submit("/v1/training/optim_step", req, OptimStepResult)
        self._ops.take_pending()
        return result

    async def _save_policy(self, op_id: str) -> PolicyRef:
        req = SavePolicyRequest(op_id=op_id)
        return (await self._submit("/v1/training/save_policy", req, SavePolicyResult)).policy

    async def _after_save(self) -> None:
        """Nothing to tidy: this client keeps no checkpoints besides the policies it saved."""

    async def op(self, op_id: str) -> OpRecord | None:
        """The server's record of an op, or None when it never applied it."""
        resp = await self._get(f"/v1/training/ops/{check_op_id(op_id)}")
        if resp.status_code == 404:
            return None
        return self._parse(resp, OpRecord)

    async def state(self) -> TrainerState:
        """The trainer's step, generation and accumulated ops, as the server sees them."""
        return self._parse(await self._get("/v1/training/state"), TrainerState)

    async def reconcile(self) -> OpRecord | None:
        """Ask again about the op that quarantined the session; lift the quarantine if answered.

        Returns the op's record (None: it was never applied). The caller decides what to do
        next; the client never resends it on its own.

        Raises:
            TrainingQuarantined: the server still cannot be asked.
        """
        quarantine = self._ops.quarantine
        if quarantine is None:
            raise UsageError("the session is not quarantined")
        op_id, why = quarantine.op_id, quarantine.why
        try:
            resp = await self._get(f"/v1/training/ops/{op_id}")
        except TrainingError as exc:
            raise TrainingQuarantined(f"{why}; asking again failed: {exc}") from exc
        if resp.status_code >= 500:
            raise TrainingQuarantined(f"{why}; asking again got HTTP {resp.status_code}")
        self._ops.lift_quarantine()
        return None if resp.status_code == 404 else self._parse(resp, OpRecord)

    # -- internals ------------------------------------------------------------------------

    def _client(self, action: str = "send a request") -> httpx.AsyncClient:
        self._check_open(action)
        assert self._http is not None  # set on open, cleared on close
        return self._http

    async def _get(self, path: str) -> httpx.Response:
        try:
            return await self._client().get(path)
        except httpx.TransportError as exc:
            raise TrainingError(f"could not reach the trainer at {self.base_url}: {exc!r}") from exc

    def _parse(self, resp: httpx.Response, model: type[R]) -> R:
        if resp.status_code != 200:
            self._raise_for(resp)
        try:
            return model.model_validate(resp.json())
        except (ValueError, ValidationError) as exc:
            raise TrainingError(f"unexpected answer from the trainer: {exc}") from exc

    def _raise_for(self, resp: httpx.Response) -> None:
        err = _error_body(resp)
        message = str(err.get("message") or err)
        code = err.get("code")
        if code == ErrorCode.GRADIENTS_LOST:
            self._ops.take_pending()
            raise TrainingGradientsLost(message, op_ids=err.get("op_ids") or [])
        if code == ErrorCode.OP_CONFLICT or resp.status_code in (400, 422):
            raise ConfigError(message)
        raise TrainingError(f"trainer answered HTTP {resp.status_code}: {message}")

    def _quarantine_session(self, op_id: str, why: str) -> TrainingQuarantined:
        return self._ops.enter_quarantine(op_id, why, None)

    async def _submit(self, path: str, req: BaseModel, model: type[R]) -> R:
        """Send `req` until its outcome is known; see the module docstring."""
        op_id = req.op_id
        payload = req.model_dump(mode="json")
        deadline = time.monotonic() + self.reconcile_timeout
        unknown = False
        while True:
            try:
                resp = await self._post(path, payload, deadline)
            except _NEVER_SENT as exc:
                if unknown:
                    raise self._quarantine_session(
                        op_id, f"{op_id} may have been applied and {self.base_url} is unreachable"
                    ) from exc
                raise TrainingError(
                    f"the trainer at {self.base_url} is unreachable; {op_id} was not applied"
                ) from exc
            except httpx.TransportError as exc:
                record = await self._reconcile(op_id, deadline, exc)
            else:
                if resp.status_code < 500:
                    return self._parse(resp, model)
                if _error_body(resp).get("code") == ErrorCode.TRAINER_BROKEN:
                    raise self._quarantine_session(
                        op_id, f"the trainer is broken ({_error_body(resp).get('message')})"
                    )
                record = await self._reconcile(op_id, deadline, None)
            if record is None:
                unknown = True  # never applied: sending it again with the same id is safe
                continue
            if record.status is OpStatus.LOST:
                self._ops.take_pending()
                raise TrainingGradientsLost(
                    f"{op_id} was applied but the trainer lost its gradients (it restarted); "
                    "redo this step's forward_backward calls with new op ids",
                    op_ids=[op_id],
                )
            return model.model_validate(record.result)

    async def _post(self, path: str, payload: dict[str, Any], deadline: float) -> httpx.Response:
        """POST, sent again until `deadline` while no byte of it left (`_NEVER_SENT`)."""
        async for attempt in self.retry.retrying(_NEVER_SENT, deadline=deadline):
            with attempt:
                return await self._client().post(path, json=payload)
        raise AssertionError("unreachable: tenacity either returns or reraises")

    async def _reconcile(
        self, op_id: str, deadline: float, cause: Exception | None
    ) -> OpRecord | None:
        """Ask the server what became of `op_id`, retrying until `deadline`."""
        try:
            async for attempt in self.retry.retrying(_Unreachable, deadline=deadline):
                with attempt:
                    return await self._ask(op_id)
        except _Unreachable as exc:
            raise self._quarantine_session(
                op_id,
                f"the outcome of {op_id} is unknown ({cause!r}) and the trainer at "
                f"{self.base_url} could not be asked within {self.reconcile_timeout:g}s "
                f"(last: {exc})",
            ) from exc
        raise AssertionError("unreachable: tenacity either returns or reraises")

    async def _ask(self, op_id: str) -> OpRecord | None:
        try:
            resp = await self._client().get(f"/v1/training/ops/{op_id}")
        except httpx.TransportError as exc:
            raise _Unreachable(repr(exc)) from exc
        if resp.status_code == 404 and _error_body(resp).get("code") == ErrorCode.UNKNOWN_OP:
            return None
        if resp.status_code == 200:
            return self._parse(resp, OpRecord)
        raise _Unreachable(f"HTTP {resp.status_code}: {_error_body(resp).get('message')}")
