"""`TinkerTrainingClient`: the `Trainer` surface on any Tinker-API service, via the `tinker` SDK.

Hosted Tinker, SkyRL's Tinker server, twinkle and `plies serve` speak the same API; this
client drives them with the official SDK (`pip install 'plies[tinker]'`), so a script written
against `TrainingClient` trains on any of them by changing the constructor. Batches are
converted so that one batch and one learning rate give the same update as on the native
wire (`_tinker_data.py`).

Exactly once, mapped onto the SDK. Tinker ops carry a per-model `seq_id` and the service
runs them in that order; the SDK resends a submit whose answer was lost with the same
`seq_id` (a service deduplicates it) and keeps polling a future by its request id across
lost answers and restarts. So an answer lost after the service accepted an op is recovered
by its request id inside the SDK. What this client adds:

- a deadline: an op whose future is still pending after `result_timeout` (or whose wait is
  cancelled) quarantines the client. The SDK keeps polling that request; `reconcile()`
  waits for it again and, once it answers, returns its result and lifts the quarantine;
- errors as plies types: a submit the service refused (a 4xx) is a `ConfigError` (nothing
  was applied); a step's op the service accepted and then failed is `TrainingGradientsLost`
  (the step's gradients are discarded, as `plies serve` does; redo the step), a failed save
  a `TrainingError`; anything else,
  where the outcome cannot be known (the request vanished from the service, an answer that
  does not parse, retries exhausted), quarantines the client: `TrainingQuarantined`, with
  the op, its kind and the error. Nothing is ever sent again with a new `seq_id`;
- op ids, as on the native client (both keep an `OpLedger`): an op id this client
  completed answers its original result without sending anything; reused for another
  request it is a `ConfigError`.

Across processes the Tinker API has no op ids: a run resumes from a saved policy. Each
`save_policy` saves a training checkpoint (weights and Adam state) and sampler weights under
one name; `resume_from=policy` creates the model from that checkpoint, with its optimizer
state, so the next step is the one that policy's run would have taken, and the steps after
it (applied by the old model, never published) are simply not part of the new run.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from .._exceptions import (
    ConfigError,
    TrainingError,
    TrainingGradientsLost,
    TrainingQuarantined,
    UsageError,
)
from .._lifecycle import AsyncCloseable
from .._tinker_sdk import (
    SdkFuture,
    blocking,
    close_service,
    create_full_weights_client,
    service_url,
    unreachable,
)
from ..trajectory import PolicyRef
from ..wire.training import (
    AdamParams,
    ForwardBackwardResult,
    LossName,
    OptimStepResult,
    TrainerState,
    TrainingBatch,
)
from ._ops import LedgeredTrainer, OpLedger
from ._tinker_data import forward_backward_metrics, loss_config, tinker_datums

if TYPE_CHECKING:
    import tinker

__all__ = ["TinkerTrainingClient", "tinker_checkpoint"]

R = TypeVar("R")

log = logging.getLogger(__name__)

STEP_KEY = "plies_step"
"""Checkpoint metadata: optimizer steps applied before the checkpoint, for a resumed run."""
VERSION_KEY = "plies_version"
_REFUSED = frozenset({400, 401, 403, 404, 422})
"""Submit answers that mean the service did not accept the op (the SDK does not retry them)."""


def tinker_checkpoint(policy: PolicyRef) -> str:
    """The training checkpoint saved with `policy`: `tinker://run/weights/<name>`.

    Raises:
        ConfigError: `policy` is not sampler weights saved by `TinkerTrainingClient`.
    """
    head, sep, name = policy.uri.rpartition("/sampler_weights/")
    if not (sep and head.startswith("tinker://") and name and "/" not in name):
        raise ConfigError(
            f"policy {policy.uri} is not Tinker sampler weights (tinker://run/sampler_weights/"
            "name); resume a Tinker run from a policy its save_policy returned"
        )
    return f"{head}/weights/{name}"


def _strip_reductions(metrics: dict[str, float]) -> dict[str, float]:
    """Tinker names metrics `name:reduction`; plies names them `name`."""
    out = {}
    for key, value in metrics.items():
        name = key.split(":", 1)[0]
        out[{"learning_rate": "lr"}.get(name, name)] = float(value)
    return {k: v for k, v in out.items() if math.isfinite(v)}


@dataclass
class _InFlight:
    """An op whose outcome is not known yet: the SDK future polling it (None once none can
    answer), and what its result becomes once it answers."""

    kind: str
    op_id: str
    waiter: SdkFuture | None
    finish: Callable[[Any], Any]


class TinkerTrainingClient(AsyncCloseable, LedgeredTrainer):
    """A `Trainer` on a Tinker-API service. Use as `async with`; opens once.

    Args:
        base_url: the service (`plies serve`'s URL, SkyRL's, ...); default `TINKER_BASE_URL`,
            then hosted Tinker, as the SDK resolves it.
        base_model: the model to train, as the service names it.
        api_key: default `TINKER_API_KEY` (the SDK wants a key starting `tml-`; `plies serve`
            accepts any, e.g. `tml-local`).
        lora_rank: train a LoRA adapter of this rank; None trains every weight (what the
            native trainer does, and `plies serve` offers; hosted Tinker trains LoRA only).
        seed: the LoRA initialisation seed.
        resume_from: a policy an earlier `save_policy` returned: the model is created from
            its checkpoint, Adam state included, and the run continues after it.
        keep_checkpoints: delete this client's training checkpoints but the newest this
            many (each holds the weights and Adam state); None keeps all. Sampler weights
            are deleted only by `delete_policy`: only the caller knows which episodes may
            still sample from them.
        result_timeout: seconds to wait for one op's result before quarantining.
        connect_timeout: seconds allowed to open the session and create the model.

    Example:
        async with TinkerTrainingClient(url, base_model="Qwen/Qwen3-8B", lora_rank=32) as t:
            await t.forward_backward(batch, loss="importance_sampling")
            await t.optim_step(AdamParams(lr=1e-4))
            policy = await t.save_policy()  # tinker://.../sampler_weights/...
    """

    def __init__(
        self,
        base_url: str | None = None,
        *,
        base_model: str,
        api_key: str | None = None,
        lora_rank: int | None = None,
        seed: int | None = None,
        resume_from: PolicyRef | None = None,
        keep_checkpoints: int | None = None,
        result_timeout: float = 600.0,
        connect_timeout: float = 60.0,
    ):
        self.base_url = service_url(base_url, "TinkerTrainingClient")
        if lora_rank is not None and lora_rank < 1:
            raise ConfigError(f"lora_rank must be at least 1 (None: all weights), not {lora_rank}")
        if keep_checkpoints is not None and keep_checkpoints < 1:
            raise ConfigError(f"keep_checkpoints must be at least 1, not {keep_checkpoints}")
        if result_timeout <= 0 or connect_timeout <= 0:
            raise ConfigError("result_timeout and connect_timeout must be positive")
        self.base_model = base_model
        self.lora_rank = lora_rank
        self.seed = seed
        self.resume_from = resume_from
        self.keep_checkpoints = keep_checkpoints
        self._saved: list[str] = []  # this client's training checkpoints, oldest first
        self.result_timeout = result_timeout
        self.connect_timeout = connect_timeout
        self._checkpoint = tinker_checkpoint(resume_from) if resume_from is not None else None
        self._api_key = api_key
        self._service: tinker.ServiceClient | None = None
        self._training: tinker.TrainingClient | None = None
        self._step = 0
        self._version = resume_from.version if resume_from is not None else 0
        self._policy = resume_from
        self._ops: OpLedger[_InFlight] = OpLedger(
            unique_ids=False,
            how_to_resume="call reconcile(), or resume from the last saved policy with a new "
            "client",
        )
        self._model_id: str | None = None

    # -- lifetime -------------------------------------------------------------------------

    async def __aenter__(self) -> TinkerTrainingClient:
        self._open()
        try:
            down = await unreachable(self.base_url, min(self.connect_timeout, 10.0))
            if down is not None:
                raise TrainingError(f"no Tinker service answers at {self.base_url}: {down}")
            self._service, self._training, self._step = await blocking(
                self._connect, timeout=self.connect_timeout, what="connect"
            )
            self._model_id = self._training.model_id
        except TimeoutError as exc:
            await self.aclose()
            raise TrainingError(
                f"the Tinker service at {self.base_url} did not open a session and create "
                f"the model within {self.connect_timeout:g}s"
            ) from exc
        except Exception as exc:
            await self.aclose()
            if isinstance(exc, TrainingError | ConfigError):
                raise
            raise TrainingError(
                f"could not open a training run on {self.base_url}: {type(exc).__name__}: {exc}"
            ) from exc
        return self

    async def aclose(self) -> None:
        """Finish the session (the service frees the model; saved policies stay). Idempotent."""
        self._close()
        service, self._service, self._training = self._service, None, None
        if service is not None:
            await close_service(service)

    def _connect(self) -> tuple[tinker.ServiceClient, tinker.TrainingClient, int]:
        """Blocking: open the session and create (or restore) the model."""
        import tinker

        try:
            service = tinker.ServiceClient(base_url=self.base_url, api_key=self._api_key)
        except tinker.TinkerError as exc:
            raise ConfigError(f"cannot open a Tinker session: {exc}") from exc
        try:
            if self._checkpoint is not None:
                training = service.create_training_client_from_state_with_optimizer(
                    self._checkpoint
                ).result()
                return service, training, self._resumed_step(self._checkpoint)
            if self.lora_rank is not None:
                training = service.create_lora_training_client(
                    base_model=self.base_model, rank=self.lora_rank, seed=self.seed
                ).result()
            else:
                training = create_full_weights_client(service, self.base_model)
        except Exception:
            service.close("errored")  # not waited for: the caller reports the error now
            raise
        return service, training, 0

    def _resumed_step(self, path: str) -> int:
        """Blocking: the step count saved with checkpoint `path`."""
        import tinker

        run = path.removeprefix("tinker://").split("/", 1)[0]
        rest = tinker.RestClient(base_url=self.base_url, api_key=self._api_key)
        listed = rest.list_checkpoints(run).result().checkpoints
        for checkpoint in listed:
            if checkpoint.tinker_path == path:
                step = (checkpoint.user_metadata or {}).get(STEP_KEY)
                if step is None:
                    raise ConfigError(f"checkpoint {path} was not saved by plies (no {STEP_KEY})")
                return int(step)
        raise ConfigError(f"the service lists no checkpoint {path}")

    # -- state ----------------------------------------------------------------------------

    @property
    def model_id(self) -> str:
        """The service's id of the model trained (also its training run's id); kept after
        the client closes, for reports."""
        if self._model_id is None:
            raise UsageError("the client has not opened a training run yet")
        return self._model_id

    @property
    def step(self) -> int:
        """Optimizer steps applied in this run, those before `resume_from` included."""
        return self._step

    async def state(self) -> TrainerState:
        """Where the run stands: its steps (those before `resume_from` included), the ops
        whose gradients wait, the last policy saved. The Tinker API keeps no such record,
        so this is the client's own; `generation` is always 0 (a restarted Tinker service
        is a new run, resumed from a saved policy)."""
        self._check_open("read the state")
        quarantine = self._ops.quarantine
        return TrainerState(
            generation=0,
            step=self._step,
            pending=self.pending_ops,
            pending_tokens=sum(p.tokens for p in self._ops.pending),
            in_flight=None if quarantine is None else quarantine.op_id,
            policy=self._policy,
        )

    # -- operations -----------------------------------------------------------------------

    async def _forward_backward(
        self, op_id: str, batch: TrainingBatch, loss: LossName, clip_low: float, clip_high: float
    ) -> ForwardBackwardResult:
        """Raises `ConfigError` also for a batch not sampled at temperature 1 (Tinker's
        logprob convention)."""
        data = tinker_datums(batch, loss)
        config = loss_config(loss, clip_low, clip_high)
        training = self._client()

        def finish(output: Any) -> ForwardBackwardResult:
            metrics = forward_backward_metrics(batch, loss, output, clip_low, clip_high)
            self._ops.add_pending(op_id, batch.loss_tokens)
            return ForwardBackwardResult(
                op_id=op_id, generation=0, step=self._step, metrics=metrics
            )

        submitted = training.forward_backward(data, loss, config)
        return await self._await_result(op_id, "forward_backward", submitted, finish)

    async def _optim_step(self, op_id: str, adam: AdamParams) -> OptimStepResult:
        from tinker import types

        params = types.AdamParams(
            learning_rate=adam.lr,
            beta1=adam.beta1,
            beta2=adam.beta2,
            eps=adam.eps,
            weight_decay=adam.weight_decay,
            grad_clip_norm=adam.grad_clip or 0.0,
        )

        def finish(output: Any) -> OptimStepResult:
            metrics = _strip_reductions(output.metrics or {})
            applied = self._ops.take_pending()
            metrics["forward_backward_calls"] = float(len(applied))
            metrics["tokens"] = float(sum(p.tokens for p in applied))
            self._step += 1
            return OptimStepResult(op_id=op_id, step=self._step, metrics=metrics)

        submitted = self._client().optim_step(params)
        return await self._await_result(op_id, "optim_step", submitted, finish)

    async def _save_policy(self, op_id: str) -> PolicyRef:
        """A training checkpoint and sampler weights saved under one name; the sampler
        weights' `PolicyRef` (`tinker://run/sampler_weights/<name>`, the next version; the
        Tinker API reports no digest, so it is empty). `resume_from` takes it back."""
        version = self._version + 1
        name = f"plies-v{version:06d}"
        training = self._client()
        metadata = {STEP_KEY: str(self._step), VERSION_KEY: str(version)}
        state = training.save_state(name, user_metadata=metadata)
        sampler = training.save_weights_for_sampler(name)
        saved = await self._await_result(None, "save_state", state, lambda out: out.path)
        expected = f"tinker://{self.model_id}/weights/{name}"

        def finish(output: Any) -> PolicyRef:
            policy = PolicyRef(uri=output.path, version=version)
            if saved != expected or tinker_checkpoint(policy) != saved:
                raise ValueError(
                    f"the service saved {saved} and {output.path}, not one name under "
                    f"tinker://{self.model_id}/"
                )
            self._version = version
            self._policy = policy
            return policy

        policy = await self._await_result(op_id, "save_weights_for_sampler", sampler, finish)
        self._saved.append(saved)
        return policy

    async def delete_policy(self, policy: PolicyRef) -> None:
        """Delete `policy`'s sampler weights from the service (of this run or an earlier one
        it resumed), for a caller that knows nothing samples from them any more. Their
        training checkpoint is `keep_checkpoints`' business, not this call's.

        Raises:
            ConfigError: `policy` is not sampler weights a `save_policy` returned.
            TrainingError: the service did not delete them (they stay); the message names
                the path and why.
        """
        tinker_checkpoint(policy)  # the shape check
        try:
            await self._delete(policy.uri)
        except Exception as exc:
            raise TrainingError(
                f"could not delete the sampler weights {policy.uri}: {type(exc).__name__}: {exc}"
            ) from exc

    async def _after_save(self) -> None:
        """Delete training checkpoints beyond `keep_checkpoints`; a failure is logged with
        the path (the checkpoint is then left on the service), never raised."""
        while self.keep_checkpoints is not None and len(self._saved) > self.keep_checkpoints:
            old = self._saved.pop(0)
            try:
                await self._delete(old)
            except Exception as exc:
                log.warning("could not delete the checkpoint %s (it stays): %r", old, exc)

    async def _delete(self, path: str) -> None:
        import tinker

        def delete() -> None:
            rest = tinker.RestClient(base_url=self.base_url, api_key=self._api_key)
            rest.delete_checkpoint_from_tinker_path(path).result()

        await blocking(delete, timeout=self.connect_timeout, what="delete")

    async def reconcile(self) -> Any:
        """Wait again for the op that quarantined the client; lift the quarantine once known.

        Returns the op's result, as its call would have (the SDK kept polling it by its
        request id).

        Raises:
            UsageError: the client is not quarantined.
            TrainingGradientsLost: the service failed the op; the quarantine is lifted.
            TrainingQuarantined: still no answer, or none can come (resume from the last
                saved policy with a new client then).
        """
        quarantine = self._ops.quarantine
        if quarantine is None:
            raise UsageError("the client is not quarantined")
        q, why = quarantine.held, quarantine.why
        if q.waiter is None:
            raise TrainingQuarantined(
                f"{why}; there is no request left to wait on: open a new client with "
                "resume_from=<the last saved policy>"
            )
        if not await q.waiter.wait(self.result_timeout):
            raise TrainingQuarantined(f"{why}; still no answer after {self.result_timeout:g}s")
        self._ops.lift_quarantine()
        return self._outcome(q)

    # -- internals ------------------------------------------------------------------------

    def _client(self) -> tinker.TrainingClient:
        self._check_open("train")
        assert self._training is not None  # set on open, cleared on close
        return self._training

    async def _await_result(
        self, op_id: str | None, kind: str, submitted: Any, finish: Callable[[Any], R]
    ) -> R:
        """Wait for an SDK future until `result_timeout`; its result through `finish`."""
        q = _InFlight(kind, op_id or kind, SdkFuture(submitted), finish)
        assert q.waiter is not None
        waited = False
        try:
            known = await q.waiter.wait(self.result_timeout)
            waited = True
        finally:
            if not waited:  # cancelled while the op was in flight: it may still apply
                self._ops.enter_quarantine(
                    q.op_id, f"{kind} {q.op_id} was in flight when its caller was cancelled", q
                )
        if not known:
            raise self._ops.enter_quarantine(
                q.op_id,
                f"{kind} {q.op_id} is still pending on {self.base_url} after "
                f"{self.result_timeout:g}s; it may yet be applied",
                q,
            )
        return self._outcome(q)

    def _outcome(self, q: _InFlight) -> Any:
        """The result of an op whose outcome is known, or the plies error its failure means."""
        import tinker

        assert q.waiter is not None
        exc = q.waiter.exception()
        if exc is None:
            try:
                return q.finish(q.waiter.result())
            except (ValueError, TypeError, KeyError, AttributeError) as bad:
                exc = bad
        elif isinstance(exc, tinker.RequestFailedError) and q.kind.startswith("save"):
            raise TrainingError(f"the service failed {q.kind} {q.op_id}: {exc}") from exc
        elif isinstance(exc, tinker.RequestFailedError):
            self._ops.take_pending()
            raise TrainingGradientsLost(
                f"the service failed {q.kind} {q.op_id} after accepting it ({exc}); the "
                "step's gradients are discarded: redo its forward_backward calls",
                op_ids=[q.op_id],
            ) from exc
        elif isinstance(exc, tinker.APIStatusError) and exc.status_code in _REFUSED:
            raise ConfigError(f"the service refused {q.kind} {q.op_id}: {exc}") from exc
        q.waiter = None
        why = f"the outcome of {q.kind} {q.op_id} is unknown: {type(exc).__name__}: {exc}"
        raise self._ops.enter_quarantine(q.op_id, why, q) from exc
