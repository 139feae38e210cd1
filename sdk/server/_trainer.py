"""The reference trainer: AdamW steps, published snapshots, and exactly-once ops.

Exactly-once rests on four durable things under `STATE_DIR/trainer/` (`_journal.py`): the
op journal, each forward_backward's batch written before its journal line, checkpoints
written every `checkpoint_seconds` at an `optim_step`, and a generation bumped each time the
trainer opens. A reopened trainer loads the last checkpoint and redoes the steps journaled
after it from their batches, so every step it answered is in its weights.

Gradients live only in memory, so a forward_backward journaled in an earlier generation and
not consumed by an optim_step is `lost`, and an optim_step steps only when the gradients it
holds are exactly the ops the client names. A step is never taken on partial gradients, and a
lost one is never reported as applied. Nor is a step taken on numbers that are not finite:
each forward_backward's loss and gradients are checked on their own before they join the
pending ones, an optim_step whose gradient norm is not finite leaves the weights as they
were, and so does one whose AdamW settings are out of range or whose step would leave a
weight or moment that is not finite (`_adam.py`). The losses themselves are in `_losses.py`.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel

from .._durable import write_atomic
from .._exceptions import ConfigError, TrainingError, TrainingGradientsLost
from ..trajectory import PolicyRef
from ..wire import training as wire
from ._adam import AdamSettings, StepRefused, adam_step, check_adam
from ._config import TrainerConfig
from ._faults import FaultPoint, Faults
from ._journal import Batches, Checkpoints, Journal, bump_generation
from ._losses import batch_loss
from ._policies import PolicyStore

__all__ = ["NonFiniteLoss", "OpConflict", "Trainer", "TrainerBroken"]

log = logging.getLogger(__name__)


class OpConflict(ConfigError):
    """An op id was sent again with a different request; ids must name one request."""


class NonFiniteLoss(ConfigError):
    """A forward_backward's loss or gradients are not finite: it was refused, and the pending
    gradients of the other ops are kept as they were."""


class TrainerBroken(TrainingError):
    """The trainer could not persist its state; only a restart from the state dir is safe."""


def _base_version(path: Path, store: PolicyStore) -> int:
    """The policy version a trainer with no checkpoint yet starts from: the store's latest
    when it first opened, kept in `path`, so that a reopen redoes its steps on the same
    weights even after it published a newer version."""
    if not path.exists():
        write_atomic(path, f"{store.latest().version}\n".encode())
    try:
        return int(path.read_text())
    except ValueError:
        raise TrainingError(f"{path} does not hold a policy version; it is damaged") from None


def _digest(request: BaseModel) -> str:
    """What an op id stands for. An optim_step's op list is the sender's bookkeeping, not its
    meaning, so a resumed script that lost that list still gets its step's original answer."""
    body = request.model_dump_json(exclude={"op_id", "forward_backward_ops"})
    return "sha256:" + hashlib.sha256(body.encode()).hexdigest()


def _adam_settings(p: wire.AdamParams) -> AdamSettings:
    """`p` as the step shared with the Tinker tenants takes it (`_adam`): bounded before any
    gradient is touched, then applied."""
    return AdamSettings(p.lr, p.beta1, p.beta2, p.eps, p.weight_decay, p.grad_clip)


class Trainer:
    """Training state of one server process. Methods are blocking; call them one at a time.

    Use `Trainer.open(state_dir, store)`: it loads the last checkpoint (or the policy it
    started from), reads the journal, redoes the steps journaled since, and starts a new
    generation.

    Example:
        trainer = Trainer.open(state_dir, store)
        trainer.forward_backward(wire.ForwardBackwardRequest(op_id="s1-fb", batch=batch))
        trainer.optim_step(wire.OptimStepRequest(op_id="s1-opt", adam=wire.AdamParams(lr=1e-4),
                                                 forward_backward_ops=["s1-fb"]))
        ref = trainer.save_policy(wire.SavePolicyRequest(op_id="s1-save")).policy
    """

    def __init__(
        self,
        root: Path,
        store: PolicyStore,
        config: TrainerConfig,
        faults: Faults | None = None,
    ):
        self.root = root
        self.store = store
        self.config = config
        self.journal = Journal(root / "journal.jsonl")
        self.checkpoints = Checkpoints(root / "checkpoints")
        self.batches = Batches(root / "batches")
        self._faults = faults
        self.generation = 0
        self.step = 0
        self.model: Any = None
        self.tokenizer: Any = None
        self.optimizer: torch.optim.AdamW | None = None
        self.policy: PolicyRef | None = None
        self.in_flight: str | None = None
        self._records: dict[str, dict[str, Any]] = {}
        self._consumed: set[str] = set()
        self._pending: list[str] = []
        self._pending_tokens = 0
        self._broken: str | None = None
        self._checkpointed_at = time.monotonic()
        self._lock = threading.Lock()

    @classmethod
    def open(
        cls,
        state_dir: Path,
        store: PolicyStore,
        config: TrainerConfig | None = None,
        tokenizer: Any = None,
        *,
        faults: Faults | None = None,
    ) -> Trainer:
        """Open (or create) the trainer state under `state_dir/trainer/`.

        `tokenizer` is saved with each published policy; by default the one of version 0.
        `faults` holds ops at fault points; only an app built for tests passes one.
        """
        from transformers import AutoModelForCausalLM, AutoTokenizer

        root = Path(state_dir) / "trainer"
        root.mkdir(parents=True, exist_ok=True)
        self = cls(root, store, config or TrainerConfig(), faults)
        self.generation = bump_generation(root / "generation")

        ckpt = self.checkpoints.current()
        source = ckpt if ckpt is not None else store.path(_base_version(root / "base", store))
        self.model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
        self.model.eval()  # no dropout: the sampler's distribution, gradients still flow
        if getattr(self.model.config, "final_logit_softcapping", None):
            raise ConfigError("models with logit soft-capping are not supported by the trainer")
        self.tokenizer = tokenizer or AutoTokenizer.from_pretrained(store.path(0))
        meta: dict[str, Any] = {}
        if ckpt is not None:
            meta = json.loads((ckpt / "meta.json").read_text())
            self.step = meta["step"]
            opt_file = ckpt / "optimizer.pt"
            if opt_file.exists():
                self.optimizer = torch.optim.AdamW(self.model.parameters())
                self.optimizer.load_state_dict(torch.load(opt_file, weights_only=True))
        records = self.journal.read()
        for record in records:
            self._index(record)
        last = meta.get("record")
        if last is not None and last["op_id"] not in self._records:
            log.warning("journal lacked optim_step %s found in its checkpoint; restored", last)
            self._append(last)
        self._redo(records)
        log.info(
            "trainer open: generation %d, step %d, %d ops journaled",
            self.generation,
            self.step,
            len(self._records),
        )
        return self

    # -- public operations -------------------------------------------------------------

    def forward_backward(self, req: wire.ForwardBackwardRequest) -> wire.ForwardBackwardResult:
        """Accumulate the gradients of one batch; a repeated op id gets the original result.

        Raises:
            TrainingGradientsLost: this op was applied earlier but its gradients are gone.
            OpConflict: the op id was used for a different request.
            ConfigError: a token id is outside the model's vocabulary.
        """
        with self._begin(req.op_id):
            done = self._replay(req, wire.OpKind.FORWARD_BACKWARD)
            if done is not None:
                if self._status(done) is wire.OpStatus.LOST:
                    raise TrainingGradientsLost(
                        f"forward_backward {req.op_id} was applied in generation "
                        f"{done['generation']} but its gradients were discarded "
                        f"(trainer is at generation {self.generation}, step {self.step}); "
                        "redo this step's forward_backward calls with new op ids",
                        op_ids=[req.op_id],
                    )
                return wire.ForwardBackwardResult.model_validate(done["result"])
            vocab = self.model.get_output_embeddings().weight.shape[0]
            for k, d in enumerate(req.batch.data):
                bad = [t for t in d.tokens if t >= vocab]
                if bad:
                    raise ConfigError(f"datum {k}: token id {bad[0]} >= vocabulary size {vocab}")
            self._reach("before_apply")
            try:
                metrics = self._accumulate(req)
                result = wire.ForwardBackwardResult(
                    op_id=req.op_id, generation=self.generation, step=self.step, metrics=metrics
                )
                digest = _digest(req)
                self.batches.write(digest, req.model_dump_json().encode())
                self._pending.append(req.op_id)
                self._pending_tokens += req.batch.loss_tokens
                self._append(
                    {
                        "op_id": req.op_id,
                        "kind": wire.OpKind.FORWARD_BACKWARD.value,
                        "digest": digest,
                        "generation": self.generation,
                        "step": self.step,
                        "result": result.model_dump(mode="json"),
                    }
                )
            except NonFiniteLoss:
                raise
            except Exception as exc:
                # Gradients may be partly added: the whole window is no longer trustworthy.
                lost = self._discard_gradients()
                raise TrainingGradientsLost(
                    f"forward_backward {req.op_id} failed ({exc!r}); the accumulated gradients "
                    f"of {lost or 'no other op'} were discarded; redo this step",
                    op_ids=[*lost, req.op_id],
                ) from exc
            self._reach("before_answer")
            return result

    def optim_step(self, req: wire.OptimStepRequest) -> wire.OptimStepResult:
        """One AdamW step on exactly the gradients of `req.forward_backward_ops`.

        Raises:
            TrainingGradientsLost: the held gradients are not exactly those ops, their norm
                is not finite, or the step would leave a weight or moment that is not finite
                (all discarded, the weights untouched).
            ConfigError: no gradients are accumulated and none are named, or the AdamW
                settings are out of range (`_adam.check_adam`; nothing discarded).
        """
        with self._begin(req.op_id):
            done = self._replay(req, wire.OpKind.OPTIM_STEP)
            if done is not None:
                return wire.OptimStepResult.model_validate(done["result"])
            try:
                check_adam(_adam_settings(req.adam))
            except ValueError as exc:
                raise ConfigError(f"optim_step {req.op_id}: {exc}") from None
            if sorted(req.forward_backward_ops) != sorted(self._pending):
                held = list(self._pending)
                self._discard_gradients()
                missing = [o for o in req.forward_backward_ops if o not in held]
                raise TrainingGradientsLost(
                    f"optim_step {req.op_id} names forward_backward ops {req.forward_backward_ops} "
                    f"but the trainer (generation {self.generation}) holds gradients of {held}; "
                    f"missing {missing}. Nothing was stepped and all accumulated gradients were "
                    "discarded; redo this step's forward_backward calls with new op ids",
                    op_ids=sorted(set(req.forward_backward_ops) | set(held)),
                )
            if not self._pending:
                raise ConfigError(
                    "optim_step with no accumulated gradients: call forward_backward first"
                )
            metrics = self._apply_adam(req)
            result = wire.OptimStepResult(op_id=req.op_id, step=self.step, metrics=metrics)
            record = {
                "op_id": req.op_id,
                "kind": wire.OpKind.OPTIM_STEP.value,
                "digest": _digest(req),
                "generation": self.generation,
                "step": self.step,
                "consumed": list(self._pending),
                "adam": req.adam.model_dump(mode="json"),
                "result": result.model_dump(mode="json"),
            }
            self._pending, self._pending_tokens = [], 0
            self._persist(record)
            return result

    def save_policy(self, req: wire.SavePolicyRequest) -> wire.SavePolicyResult:
        """Publish the current weights as the store's next immutable version."""
        with self._begin(req.op_id):
            done = self._replay(req, wire.OpKind.SAVE_POLICY)
            if done is not None:
                return wire.SavePolicyResult.model_validate(done["result"])
            ref = self.store.publish(self.model, self.tokenizer)
            result = wire.SavePolicyResult(op_id=req.op_id, step=self.step, policy=ref)
            self._append(
                {
                    "op_id": req.op_id,
                    "kind": wire.OpKind.SAVE_POLICY.value,
                    "digest": _digest(req),
                    "generation": self.generation,
                    "step": self.step,
                    "result": result.model_dump(mode="json"),
                }
            )
            return result

    def op(self, op_id: str) -> wire.OpRecord | None:
        """What became of an op, or None when it was never applied (safe to send again)."""
        rec = self._records.get(op_id)
        if rec is None:
            return None
        return wire.OpRecord(
            op_id=op_id,
            kind=wire.OpKind(rec["kind"]),
            status=self._status(rec),
            result=rec["result"],
        )

    def state(self) -> wire.TrainerState:
        return wire.TrainerState(
            generation=self.generation,
            step=self.step,
            pending=list(self._pending),
            pending_tokens=self._pending_tokens,
            in_flight=self.in_flight,
            policy=self.policy,
        )

    # -- internals ---------------------------------------------------------------------

    @contextlib.contextmanager
    def _begin(self, op_id: str) -> Iterator[None]:
        if self._broken:
            raise TrainerBroken(self._broken)
        with self._lock:
            self.in_flight = op_id
            try:
                yield
            finally:
                self.in_flight = None

    def _reach(self, point: FaultPoint) -> None:
        if self._faults is not None:
            self._faults.reached(point)

    def _replay(self, req: BaseModel, kind: wire.OpKind) -> dict[str, Any] | None:
        rec = self._records.get(req.op_id)
        if rec is None:
            return None
        if rec["kind"] != kind.value or rec["digest"] != _digest(req):
            raise OpConflict(
                f"op id {req.op_id} was already used for a different {rec['kind']} request; "
                "use a new op id for a new request"
            )
        return rec

    def _status(self, rec: dict[str, Any]) -> wire.OpStatus:
        if rec["kind"] != wire.OpKind.FORWARD_BACKWARD.value:
            return wire.OpStatus.APPLIED
        if rec["op_id"] in self._consumed:
            return wire.OpStatus.APPLIED
        if rec["op_id"] in self._pending:
            return wire.OpStatus.PENDING
        return wire.OpStatus.LOST

    def _accumulate(self, req: wire.ForwardBackwardRequest) -> dict[str, float]:
        """Add the gradients of `req`'s batch to the pending ones, checked on their own first.

        Raises:
            NonFiniteLoss: its loss or gradients are not finite; the pending ones are kept.
        """
        held = self._set_aside_gradients()
        metrics = batch_loss(
            self.model,
            req.batch,
            req.loss,
            clip_low=req.clip_low,
            clip_high=req.clip_high,
            max_head_rows=self.config.max_head_rows,
            max_micro_tokens=self.config.max_micro_tokens,
        )
        if not (math.isfinite(metrics["loss"]) and self._gradients_finite()):
            self._restore_gradients(held)
            raise NonFiniteLoss(
                f"forward_backward {req.op_id}: the loss ({metrics['loss']}) or its "
                "gradients are not finite; nothing was accumulated and the pending "
                "gradients are kept. Check the batch's logprobs, advantages and "
                "sampling parameters"
            )
        self._add_gradients(held)
        return metrics

    def _redo(self, records: list[dict[str, Any]]) -> None:
        """Take again, from their batches, the steps journaled after the loaded checkpoint.

        Each is the same computation on the same weights in the same order, so on the same
        machine it lands on the same weights; a gradient norm that differs from the one
        answered is logged (the step is still applied exactly once).

        Raises:
            TrainingError: a step cannot be redone (its batch or its record is damaged).
        """
        optim = wire.OpKind.OPTIM_STEP.value
        steps = [r for r in records if r["kind"] == optim and r["step"] > self.step]
        if not steps:
            return
        digests = {
            r["op_id"]: r["digest"]
            for r in records
            if r["kind"] == wire.OpKind.FORWARD_BACKWARD.value
        }
        started = time.monotonic()
        for record in steps:
            if "adam" not in record or record["step"] != self.step + 1:
                raise TrainingError(
                    f"journaled optim_step {record['op_id']} (step {record['step']}) cannot be "
                    f"redone on the checkpoint of step {self.step}; the trainer state is damaged"
                )
            for op_id in record["consumed"]:
                if op_id not in digests:
                    raise TrainingError(
                        f"journaled optim_step {record['op_id']} consumed forward_backward "
                        f"{op_id}, which the journal lacks; the trainer state is damaged"
                    )
                body = self.batches.read(digests[op_id])
                fb = wire.ForwardBackwardRequest.model_validate_json(body)
                self._accumulate(fb)
                self._pending.append(op_id)
                self._pending_tokens += fb.batch.loss_tokens
            req = wire.OptimStepRequest(
                op_id=record["op_id"],
                adam=wire.AdamParams.model_validate(record["adam"]),
                forward_backward_ops=record["consumed"],
            )
            norm = self._apply_adam(req)["grad_norm"]
            self._pending, self._pending_tokens = [], 0
            if norm != record["result"]["metrics"]["grad_norm"]:
                log.warning(
                    "redone step %d: gradient norm %r, answered %r (another machine or thread "
                    "count?); the step is applied once either way",
                    self.step,
                    norm,
                    record["result"]["metrics"]["grad_norm"],
                )
        log.info(
            "redid steps %d-%d from their journaled batches in %.1f s",
            steps[0]["step"],
            self.step,
            time.monotonic() - started,
        )
        self._checkpoint(steps[-1])

    def _set_aside_gradients(self) -> list[torch.Tensor | None]:
        """Take the pending gradients off the parameters, so one op's can be checked alone."""
        held = []
        for q in self.model.parameters():
            held.append(q.grad)
            q.grad = None
        return held

    def _gradients_finite(self) -> bool:
        grads = [q.grad for q in self.model.parameters() if q.grad is not None]
        flags = [torch.isfinite(g).all() for g in grads]
        return bool(torch.stack(flags).all()) if flags else True

    def _restore_gradients(self, held: list[torch.Tensor | None]) -> None:
        for q, g in zip(self.model.parameters(), held, strict=True):
            q.grad = g

    def _add_gradients(self, held: list[torch.Tensor | None]) -> None:
        """Put the set-aside gradients back, summed with the ones on the parameters now."""
        for q, g in zip(self.model.parameters(), held, strict=True):
            if g is None:
                continue
            if q.grad is None:
                q.grad = g
            else:
                q.grad.add_(g)

    def _discard_gradients(self) -> list[str]:
        lost = list(self._pending)
        self.model.zero_grad(set_to_none=True)
        self._pending, self._pending_tokens = [], 0
        if lost:
            log.warning("discarded the gradients of %s", lost)
        return lost

    def _apply_adam(self, req: wire.OptimStepRequest) -> dict[str, float]:
        p = req.adam
        params = [q for q in self.model.parameters() if q.requires_grad]
        try:
            self.optimizer, norm = adam_step(self.optimizer, params, _adam_settings(p))
        except StepRefused as exc:
            held = self._discard_gradients()
            if not math.isfinite(exc.norm):
                raise TrainingGradientsLost(
                    f"optim_step {req.op_id}: the gradient norm of {held} is {exc.norm}; "
                    "nothing was stepped, the weights are unchanged and these gradients were "
                    "discarded",
                    op_ids=held,
                ) from None
            raise TrainingGradientsLost(
                f"optim_step {req.op_id}: {exc.reason} (lr {p.lr:g}, eps {p.eps:g}, "
                f"weight_decay {p.weight_decay:g}, gradient norm {exc.norm:g}); it was undone, "
                f"the weights are unchanged and the gradients of {held} were discarded",
                op_ids=held,
            ) from None
        self.model.zero_grad(set_to_none=True)
        self.step += 1
        return {
            "grad_norm": norm,
            "lr": p.lr,
            "tokens": float(self._pending_tokens),
            "forward_backward_calls": float(len(self._pending)),
        }

    def _persist(self, record: dict[str, Any]) -> None:
        """Journal the optim_step `record`, checkpointing first (with `record` inside) when
        `checkpoint_seconds` have passed since the last checkpoint."""
        try:
            due = time.monotonic() - self._checkpointed_at >= self.config.checkpoint_seconds
            if due:
                self._checkpoint(record)
            self._append(record)
        except Exception as exc:
            self._broken = (
                f"could not persist step {self.step} ({exc!r}); restart the server from its "
                "state dir (it resumes from the last durable step)"
            )
            raise TrainerBroken(self._broken) from exc

    def _checkpoint(self, record: dict[str, Any]) -> None:
        """Write model + optimizer as of `record`'s step; older checkpoints and the batches
        it covers are no longer needed."""
        model, optimizer, meta = self.model, self.optimizer, {"step": self.step, "record": record}

        def fill(directory: Path) -> None:
            model.save_pretrained(directory)
            torch.save(optimizer.state_dict(), directory / "optimizer.pt")
            (directory / "meta.json").write_text(json.dumps(meta))

        self.checkpoints.write(self.step, fill)
        self._checkpointed_at = time.monotonic()
        self.checkpoints.prune(self.step, self.config.keep_checkpoints)
        self.batches.keep_only({self._records[op]["digest"] for op in self._pending})

    def _append(self, record: dict[str, Any]) -> None:
        self.journal.append(record)
        self._index(record)

    def _index(self, record: dict[str, Any]) -> None:
        self._records[record["op_id"]] = record
        self._consumed.update(record.get("consumed", []))
        if record["kind"] == wire.OpKind.SAVE_POLICY.value:
            self.policy = PolicyRef.model_validate(record["result"]["policy"])
