"""The reference trainer: losses, AdamW steps, published snapshots, and an op journal.

Exactly-once rests on three durable things under `STATE_DIR/trainer/`:

- `journal.jsonl`: one fsynced line per applied op (id, kind, request digest, result),
  written before the answer is sent. An op without a line was never applied.
- `checkpoints/<step>/` + `CURRENT`: model and optimizer state, written (and fsynced) at
  every `optim_step` before its journal line, with that line inside, so a crash between the
  two is repaired on reopen.
- `generation`: bumped each time the trainer opens. Gradients live only in memory, so a
  forward_backward journaled in an earlier generation and not consumed by an optim_step is
  `lost`, and an optim_step steps only when the gradients it holds are exactly the ops the
  client names. A step is never taken on partial gradients, and a lost one is never reported
  as applied.

The head (the 151,936-wide output layer) and log-softmax run only at the positions the loss
uses: hidden states are gathered at masked positions first.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

from .._exceptions import ConfigError, TrainingError, TrainingGradientsLost
from ..training._wire import (
    Datum,
    ForwardBackwardRequest,
    ForwardBackwardResult,
    OpKind,
    OpRecord,
    OpStatus,
    OptimStepRequest,
    OptimStepResult,
    SavePolicyRequest,
    SavePolicyResult,
    TrainerState,
    TrainingBatch,
)
from ..trajectory import PolicyRef
from ._policies import PolicyStore
from ._sampling import processed_logprobs

__all__ = ["OpConflict", "Trainer", "TrainerBroken", "TrainerConfig", "batch_loss"]

log = logging.getLogger(__name__)


class OpConflict(ConfigError):
    """An op id was sent again with a different request; ids must name one request."""


class TrainerBroken(TrainingError):
    """The trainer could not persist its state; only a restart from the state dir is safe."""


class TrainerConfig(BaseModel):
    """Knobs of the trainer. The `test_*` fields exist only so tests can crash it on cue."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_head_rows: int = Field(
        default=512, ge=1, description="Most loss positions per micro-batch (head rows)."
    )
    max_micro_tokens: int = Field(
        default=16384, ge=1, description="Most padded tokens per micro-batch forward."
    )
    keep_checkpoints: int = Field(default=1, ge=1, description="Checkpoints kept on disk.")
    test_delay_s: float = Field(default=0.0, ge=0.0, description="Test only: sleep in f/b.")
    test_delay_at: Literal["before_apply", "before_answer"] = Field(
        default="before_apply",
        description="Test only: sleep before the gradients are applied, or after the op is "
        "journaled but before it is answered.",
    )


@dataclass
class _Loss:
    """Per-call loss settings, resolved once from the request."""

    name: str
    clip_low: float
    clip_high: float
    normalizer: float


def _micro_batches(data: list[Datum], max_rows: int, max_tokens: int) -> list[list[Datum]]:
    """Split data into consecutive micro-batches bounded by head rows and padded tokens."""
    out: list[list[Datum]] = []
    cur: list[Datum] = []
    rows = longest = 0
    for d in data:
        n_rows, n_tok = d.loss_tokens, len(d.tokens)
        new_longest = max(longest, n_tok)
        if cur and (rows + n_rows > max_rows or new_longest * (len(cur) + 1) > max_tokens):
            out.append(cur)
            cur, rows, new_longest = [], 0, n_tok
        cur.append(d)
        rows += n_rows
        longest = new_longest
    if cur:
        out.append(cur)
    return out


def batch_loss(
    model: torch.nn.Module,
    batch: TrainingBatch,
    loss: Literal["importance_sampling", "ppo", "cross_entropy"] = "importance_sampling",
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    max_head_rows: int = 512,
    max_micro_tokens: int = 16384,
) -> dict[str, float]:
    """Run forward and backward over `batch`, adding its gradients to `model`'s `.grad`.

    The loss is the sum of per-token losses over masked tokens divided by their count, so a
    batch split into micro-batches gives the same gradient as one pass. Per token, with
    `r = exp(logprob - sampler_logprob)` and advantage `A`:

    - importance_sampling: `-r * A`
    - ppo: `-min(r * A, clip(r, 1 - clip_low, 1 + clip_high) * A)`
    - cross_entropy: `-logprob` (advantages and sampler logprobs are ignored)

    Returns:
        Metrics: `loss`, `tokens`, `sequences`, and for the policy-gradient losses the ratio
        mean / min / max, `kl` (the k3 estimate of KL(sampler || trainer)),
        `logprob_diff_max`, and `clip_fraction` (ppo); `entropy` always.
    """
    normalizer = float(batch.loss_tokens)
    spec = _Loss(loss, clip_low, clip_high, normalizer)
    decoder = model.get_decoder()
    head = model.get_output_embeddings()
    device = next(model.parameters()).device
    total = 0.0
    lp_all: list[torch.Tensor] = []
    q_all: list[torch.Tensor] = []
    adv_all: list[torch.Tensor] = []
    ent_all: list[torch.Tensor] = []
    for mb in _micro_batches(batch.data, max_head_rows, max_micro_tokens):
        length = max(len(d.tokens) for d in mb)
        ids = torch.zeros((len(mb), length), dtype=torch.long)
        att = torch.zeros((len(mb), length), dtype=torch.long)
        rows: list[int] = []
        cols: list[int] = []
        q: list[float] = []
        adv: list[float] = []
        for b, d in enumerate(mb):
            ids[b, : len(d.tokens)] = torch.tensor(d.tokens)
            att[b, : len(d.tokens)] = 1
            for i, m in enumerate(d.mask):
                if m:
                    rows.append(b)
                    cols.append(i)
                    q.append(d.logprobs[i])
                    adv.append(d.advantages[i])
        ids, att = ids.to(device), att.to(device)
        rows_t = torch.tensor(rows, device=device)
        cols_t = torch.tensor(cols, device=device)
        hidden = decoder(input_ids=ids, attention_mask=att).last_hidden_state
        # The logit predicting token i sits at position i - 1; only those rows hit the head.
        logits = head(hidden[rows_t, cols_t - 1])
        logp = processed_logprobs(logits, batch.temperature, batch.top_k, batch.top_p)
        lp = logp.gather(1, ids[rows_t, cols_t].unsqueeze(1)).squeeze(1)
        q_t = torch.tensor(q, device=device, dtype=lp.dtype)
        a_t = torch.tensor(adv, device=device, dtype=lp.dtype)
        per_token = _per_token_loss(spec, lp, q_t, a_t)
        mb_loss = per_token.sum() / spec.normalizer
        mb_loss.backward()
        total += float(mb_loss.detach())
        with torch.no_grad():
            ent_all.append(torch.special.entr(logp.exp()).sum(-1))
        lp_all.append(lp.detach())
        q_all.append(q_t)
        adv_all.append(a_t)
    lp_c, q_c, a_c = torch.cat(lp_all), torch.cat(q_all), torch.cat(adv_all)
    metrics = {
        "loss": total,
        "tokens": normalizer,
        "sequences": float(len(batch.data)),
        "entropy": float(torch.cat(ent_all).mean()),
    }
    if loss != "cross_entropy":
        metrics.update(_ratio_metrics(spec, lp_c, q_c, a_c))
    return metrics


def _per_token_loss(spec: _Loss, lp: torch.Tensor, q: torch.Tensor, a: torch.Tensor):
    if spec.name == "cross_entropy":
        return -lp
    ratio = torch.exp(lp - q)
    if spec.name == "importance_sampling":
        return -ratio * a
    if spec.name == "ppo":
        clipped = torch.clamp(ratio, 1.0 - spec.clip_low, 1.0 + spec.clip_high)
        return -torch.minimum(ratio * a, clipped * a)
    raise ConfigError(f"unknown loss {spec.name!r}")


def _ratio_metrics(spec: _Loss, lp: torch.Tensor, q: torch.Tensor, a: torch.Tensor):
    diff = lp - q
    ratio = diff.exp()
    finite = torch.isfinite(diff)
    k3 = (ratio - 1.0 - diff)[finite]
    out = {
        "ratio_mean": float(ratio.mean()),
        "ratio_min": float(ratio.min()),
        "ratio_max": float(ratio.max()),
        "kl": float(k3.mean()) if k3.numel() else float("nan"),
        "logprob_diff_max": float(diff[finite].abs().max()) if finite.any() else float("nan"),
    }
    if spec.name == "ppo":
        clipped = torch.clamp(ratio, 1.0 - spec.clip_low, 1.0 + spec.clip_high)
        out["clip_fraction"] = float((clipped * a < ratio * a).float().mean())
    return out


def _digest(request: BaseModel) -> str:
    """What an op id stands for. An optim_step's op list is the sender's bookkeeping, not its
    meaning, so a resumed script that lost that list still gets its step's original answer."""
    body = request.model_dump_json(exclude={"op_id", "forward_backward_ops"})
    return "sha256:" + hashlib.sha256(body.encode()).hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_durably(path: Path, text: str) -> None:
    """Replace `path` with `text` atomically: temp file, fsync, rename, fsync the directory."""
    tmp = path.with_name(f".{path.name}.tmp")
    with tmp.open("w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


class Trainer:
    """Training state of one server process. Methods are blocking; call them one at a time.

    Use `Trainer.open(state_dir, store)`: it loads the last checkpoint (or the store's latest
    policy), reads the journal, and starts a new generation.

    Example:
        trainer = Trainer.open(state_dir, store)
        trainer.forward_backward(ForwardBackwardRequest(op_id="s1-fb", batch=batch))
        trainer.optim_step(OptimStepRequest(op_id="s1-opt", adam=AdamParams(lr=1e-4),
                                            forward_backward_ops=["s1-fb"]))
        ref = trainer.save_policy(SavePolicyRequest(op_id="s1-save")).policy
    """

    def __init__(self, root: Path, store: PolicyStore, config: TrainerConfig):
        self.root = root
        self.store = store
        self.config = config
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
        self._lock = threading.Lock()

    @classmethod
    def open(
        cls,
        state_dir: Path,
        store: PolicyStore,
        config: TrainerConfig | None = None,
        tokenizer: Any = None,
    ) -> Trainer:
        """Open (or create) the trainer state under `state_dir/trainer/`.

        `tokenizer` is saved with each published policy; by default the one of version 0.
        """
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self = cls(Path(state_dir) / "trainer", store, config or TrainerConfig())
        self.root.mkdir(parents=True, exist_ok=True)
        (self.root / "checkpoints").mkdir(exist_ok=True)
        for stale in (self.root / "checkpoints").glob(".tmp-*"):  # a crash mid-checkpoint
            shutil.rmtree(stale, ignore_errors=True)
        gen_file = self.root / "generation"
        previous = int(gen_file.read_text()) if gen_file.exists() else 0
        self.generation = previous + 1
        _write_durably(gen_file, f"{self.generation}\n")

        ckpt = self._current_checkpoint()
        source = ckpt if ckpt is not None else store.path(store.latest().version)
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
        self._read_journal()
        last = meta.get("record")
        if last is not None and last["op_id"] not in self._records:
            log.warning("journal lacked optim_step %s found in its checkpoint; restored", last)
            self._append(last)
        log.info(
            "trainer open: generation %d, step %d, %d ops journaled",
            self.generation,
            self.step,
            len(self._records),
        )
        return self

    # -- public operations -------------------------------------------------------------

    def forward_backward(self, req: ForwardBackwardRequest) -> ForwardBackwardResult:
        """Accumulate the gradients of one batch; a repeated op id gets the original result.

        Raises:
            TrainingGradientsLost: this op was applied earlier but its gradients are gone.
            OpConflict: the op id was used for a different request.
            ConfigError: a token id is outside the model's vocabulary.
        """
        with self._begin(req.op_id):
            done = self._replay(req, OpKind.FORWARD_BACKWARD)
            if done is not None:
                if self._status(done) is OpStatus.LOST:
                    raise TrainingGradientsLost(
                        f"forward_backward {req.op_id} was applied in generation "
                        f"{done['generation']} but its gradients were discarded "
                        f"(trainer is at generation {self.generation}, step {self.step}); "
                        "redo this step's forward_backward calls with new op ids",
                        op_ids=[req.op_id],
                    )
                return ForwardBackwardResult.model_validate(done["result"])
            vocab = self.model.get_output_embeddings().weight.shape[0]
            for k, d in enumerate(req.batch.data):
                bad = [t for t in d.tokens if t >= vocab]
                if bad:
                    raise ConfigError(f"datum {k}: token id {bad[0]} >= vocabulary size {vocab}")
            if self.config.test_delay_at == "before_apply":
                time.sleep(self.config.test_delay_s)
            try:
                metrics = batch_loss(
                    self.model,
                    req.batch,
                    req.loss,
                    clip_low=req.clip_low,
                    clip_high=req.clip_high,
                    max_head_rows=self.config.max_head_rows,
                    max_micro_tokens=self.config.max_micro_tokens,
                )
                result = ForwardBackwardResult(
                    op_id=req.op_id, generation=self.generation, step=self.step, metrics=metrics
                )
                self._pending.append(req.op_id)
                self._pending_tokens += req.batch.loss_tokens
                self._append(
                    {
                        "op_id": req.op_id,
                        "kind": OpKind.FORWARD_BACKWARD.value,
                        "digest": _digest(req),
                        "generation": self.generation,
                        "step": self.step,
                        "result": result.model_dump(mode="json"),
                    }
                )
            except Exception as exc:
                # Gradients may be partly added: the whole window is no longer trustworthy.
                lost = self._discard_gradients()
                raise TrainingGradientsLost(
                    f"forward_backward {req.op_id} failed ({exc!r}); the accumulated gradients "
                    f"of {lost or 'no other op'} were discarded; redo this step",
                    op_ids=[*lost, req.op_id],
                ) from exc
            if self.config.test_delay_at == "before_answer":
                time.sleep(self.config.test_delay_s)
            return result

    def optim_step(self, req: OptimStepRequest) -> OptimStepResult:
        """One AdamW step on exactly the gradients of `req.forward_backward_ops`.

        Raises:
            TrainingGradientsLost: the held gradients are not exactly those ops (all discarded).
            ConfigError: no gradients are accumulated and none are named.
        """
        with self._begin(req.op_id):
            done = self._replay(req, OpKind.OPTIM_STEP)
            if done is not None:
                return OptimStepResult.model_validate(done["result"])
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
            result = OptimStepResult(op_id=req.op_id, step=self.step, metrics=metrics)
            record = {
                "op_id": req.op_id,
                "kind": OpKind.OPTIM_STEP.value,
                "digest": _digest(req),
                "generation": self.generation,
                "step": self.step,
                "consumed": list(self._pending),
                "result": result.model_dump(mode="json"),
            }
            self._persist(record)
            self._pending, self._pending_tokens = [], 0
            return result

    def save_policy(self, req: SavePolicyRequest) -> SavePolicyResult:
        """Publish the current weights as the store's next immutable version."""
        with self._begin(req.op_id):
            done = self._replay(req, OpKind.SAVE_POLICY)
            if done is not None:
                return SavePolicyResult.model_validate(done["result"])
            ref = self.store.publish(self.model, self.tokenizer)
            result = SavePolicyResult(op_id=req.op_id, step=self.step, policy=ref)
            self._append(
                {
                    "op_id": req.op_id,
                    "kind": OpKind.SAVE_POLICY.value,
                    "digest": _digest(req),
                    "generation": self.generation,
                    "step": self.step,
                    "result": result.model_dump(mode="json"),
                }
            )
            return result

    def op(self, op_id: str) -> OpRecord | None:
        """What became of an op, or None when it was never applied (safe to send again)."""
        rec = self._records.get(op_id)
        if rec is None:
            return None
        return OpRecord(
            op_id=op_id, kind=OpKind(rec["kind"]), status=self._status(rec), result=rec["result"]
        )

    def state(self) -> TrainerState:
        return TrainerState(
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

    def _replay(self, req: BaseModel, kind: OpKind) -> dict[str, Any] | None:
        rec = self._records.get(req.op_id)
        if rec is None:
            return None
        if rec["kind"] != kind.value or rec["digest"] != _digest(req):
            raise OpConflict(
                f"op id {req.op_id} was already used for a different {rec['kind']} request; "
                "use a new op id for a new request"
            )
        return rec

    def _status(self, rec: dict[str, Any]) -> OpStatus:
        if rec["kind"] != OpKind.FORWARD_BACKWARD.value:
            return OpStatus.APPLIED
        if rec["op_id"] in self._consumed:
            return OpStatus.APPLIED
        if rec["op_id"] in self._pending:
            return OpStatus.PENDING
        return OpStatus.LOST

    def _discard_gradients(self) -> list[str]:
        lost = list(self._pending)
        self.model.zero_grad(set_to_none=True)
        self._pending, self._pending_tokens = [], 0
        if lost:
            log.warning("discarded the gradients of %s", lost)
        return lost

    def _apply_adam(self, req: OptimStepRequest) -> dict[str, float]:
        p = req.adam
        params = [q for q in self.model.parameters() if q.requires_grad]
        if self.optimizer is None:
            self.optimizer = torch.optim.AdamW(params, lr=p.lr)
        for group in self.optimizer.param_groups:
            group.update(lr=p.lr, betas=(p.beta1, p.beta2), eps=p.eps, weight_decay=p.weight_decay)
        norms = [torch.linalg.vector_norm(q.grad) for q in params if q.grad is not None]
        norm = float(torch.linalg.vector_norm(torch.stack(norms)))
        if p.grad_clip is not None:
            torch.nn.utils.clip_grad_norm_(params, p.grad_clip)
        self.optimizer.step()
        self.model.zero_grad(set_to_none=True)
        self.step += 1
        return {
            "grad_norm": norm,
            "lr": p.lr,
            "tokens": float(self._pending_tokens),
            "forward_backward_calls": float(len(self._pending)),
        }

    def _persist(self, record: dict[str, Any]) -> None:
        """Checkpoint model + optimizer with `record` inside, then journal the record."""
        try:
            ckpts = self.root / "checkpoints"
            tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=ckpts))
            self.model.save_pretrained(tmp)
            torch.save(self.optimizer.state_dict(), tmp / "optimizer.pt")
            (tmp / "meta.json").write_text(json.dumps({"step": self.step, "record": record}))
            for f in tmp.iterdir():
                with f.open("rb") as fh:
                    os.fsync(fh.fileno())
            _fsync_dir(tmp)
            final = ckpts / str(self.step)
            if final.exists():
                shutil.rmtree(final)
            os.rename(tmp, final)
            _fsync_dir(ckpts)
            _write_durably(ckpts / "CURRENT", f"{self.step}\n")
            self._append(record)
        except Exception as exc:
            self._broken = (
                f"could not persist step {self.step} ({exc!r}); restart the server from its "
                "state dir (it resumes from the last durable step)"
            )
            raise TrainerBroken(self._broken) from exc
        keep = {str(s) for s in range(self.step - self.config.keep_checkpoints + 1, self.step + 1)}
        for old in ckpts.iterdir():
            if old.name.isdigit() and old.name not in keep:
                shutil.rmtree(old, ignore_errors=True)

    def _current_checkpoint(self) -> Path | None:
        current = self.root / "checkpoints" / "CURRENT"
        if not current.exists():
            return None
        path = self.root / "checkpoints" / current.read_text().strip()
        if not (path / "meta.json").exists():
            raise TrainingError(f"{current} names {path}, which is not a complete checkpoint")
        return path

    def _read_journal(self) -> None:
        journal = self.root / "journal.jsonl"
        if not journal.exists():
            return
        raw = journal.read_bytes()
        good = 0
        for line in raw.splitlines(keepends=True):
            if not line.endswith(b"\n"):
                break
            self._index(json.loads(line))
            good += len(line)
        if good < len(raw):
            # A torn last line is an op that crashed before it was answered: never applied.
            log.warning(
                "dropping a torn journal line of %d bytes (never answered)", len(raw) - good
            )
            with journal.open("r+b") as f:
                f.truncate(good)
                os.fsync(f.fileno())

    def _append(self, record: dict[str, Any]) -> None:
        with (self.root / "journal.jsonl").open("a") as f:
            f.write(json.dumps(record, separators=(",", ":")) + "\n")
            f.flush()
            os.fsync(f.fileno())
        self._index(record)

    def _index(self, record: dict[str, Any]) -> None:
        self._records[record["op_id"]] = record
        self._consumed.update(record.get("consumed", []))
        if record["kind"] == OpKind.SAVE_POLICY.value:
            self.policy = PolicyRef.model_validate(record["result"]["policy"])
