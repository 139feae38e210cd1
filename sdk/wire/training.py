"""The training wire format: what `TrainingClient` sends and a trainer answers.

Plain pydantic models with no torch import, in a module that both sides import: the client
stays light, and the reference server (a separate process) validates exactly what the client
built without depending on the client's internals. Every request that changes the trainer
carries an `op_id`; the server journals each applied op with its result, which is what makes
retries safe (see docs/training.md).
"""

from __future__ import annotations

import math
import re
from enum import StrEnum
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from .._exceptions import ConfigError
from ..trajectory import PolicyRef, Segment

__all__ = [
    "MAX_ABS_ADVANTAGE",
    "MIN_LOGPROB",
    "OP_ID_PATTERN",
    "AdamParams",
    "Datum",
    "ErrorCode",
    "ForwardBackwardRequest",
    "ForwardBackwardResult",
    "LossName",
    "OpKind",
    "OpRecord",
    "OpStatus",
    "OptimStepRequest",
    "OptimStepResult",
    "SavePolicyRequest",
    "SavePolicyResult",
    "TrainerState",
    "TrainingBatch",
    "check_op_id",
]

LossName = Literal["importance_sampling", "ppo", "cross_entropy"]
"""`importance_sampling`: -ratio * advantage per token; `ppo`: the clipped surrogate;
`cross_entropy`: -logprob per masked token (supervised warm starts; advantages ignored)."""

OP_ID_PATTERN = r"^[A-Za-z0-9._:\-]{1,128}$"
"""Op ids are file- and URL-safe, so the journal and `GET /ops/{op_id}` need no escaping."""

MIN_LOGPROB = -100.0
"""The lowest sampler logprob a datum may carry. float32 sampling cannot pick a token less
likely than about e^-103, so anything lower is a placeholder or a bug, and its ratio would
overflow float32."""
MAX_ABS_ADVANTAGE = 1e6
"""The largest advantage magnitude: far beyond any normalised or reward-scale advantage, and
small enough that ratio * advantage summed over a batch stays finite in float32."""


class Datum(BaseModel):
    """One training sequence: a segment plus the advantage of each token.

    `mask[i] == 1` means token i was sampled and the loss uses it; the logit that predicts it
    sits at position i - 1, so the first token can never be masked.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    tokens: list[int] = Field(min_length=2)
    mask: list[int]
    logprobs: list[float] = Field(description="Sampler logprobs on masked positions, 0 elsewhere.")
    advantages: list[float] = Field(description="Per-token advantage; only masked ones are used.")

    @classmethod
    def from_segment(cls, segment: Segment, advantage: float) -> Datum:
        """A datum that puts one scalar advantage on every sampled token of `segment`."""
        return cls(
            tokens=segment.tokens,
            mask=segment.mask,
            logprobs=segment.logprobs,
            advantages=[advantage if m else 0.0 for m in segment.mask],
        )

    @property
    def loss_tokens(self) -> int:
        return sum(self.mask)

    @model_validator(mode="after")
    def _aligned(self) -> Datum:
        n = len(self.tokens)
        for name in ("mask", "logprobs", "advantages"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"{name} has {len(getattr(self, name))} entries for {n} tokens")
        if any(t < 0 for t in self.tokens):
            raise ValueError("token ids must be non-negative")
        if any(m not in (0, 1) for m in self.mask):
            raise ValueError("mask values must be 0 or 1")
        if self.mask[0]:
            raise ValueError("the first token cannot be masked: no position predicts it")
        if not any(self.mask):
            raise ValueError("the datum has no masked token, so it carries no loss")
        for i, (lp, adv) in enumerate(zip(self.logprobs, self.advantages, strict=True)):
            if not (math.isfinite(lp) and math.isfinite(adv)):
                raise ValueError(f"non-finite logprob {lp} or advantage {adv} at position {i}")
            if self.mask[i] and lp < MIN_LOGPROB:
                raise ValueError(f"sampler logprob {lp} at position {i} is below {MIN_LOGPROB}")
            if abs(adv) > MAX_ABS_ADVANTAGE:
                raise ValueError(
                    f"advantage {adv} at position {i} exceeds {MAX_ABS_ADVANTAGE:g} in magnitude"
                )
        return self


class TrainingBatch(BaseModel):
    """The data of one `forward_backward` call and the temperature it was sampled at.

    The trainer computes each logprob under the distribution the token was sampled from
    (logits / temperature, then top-k and top-p masks, then log-softmax), the sampler's own
    convention, so ratios start at exactly 1 for on-policy data.
    """

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    data: list[Datum] = Field(min_length=1)
    temperature: float = Field(
        default=1.0,
        ge=1e-3,
        le=1e3,
        description="As sampled; below 1e-3 the processed logits overflow float32.",
    )
    top_k: int = Field(default=-1, description="As sampled; -1 or 0 disables it.")
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, description="As sampled; 1 disables it.")

    @property
    def loss_tokens(self) -> int:
        return sum(d.loss_tokens for d in self.data)


class AdamParams(BaseModel):
    """AdamW settings for one `optim_step`; they may change from step to step."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    lr: float = Field(gt=0.0)
    beta1: float = Field(default=0.9, ge=0.0, lt=1.0)
    beta2: float = Field(default=0.999, ge=0.0, lt=1.0)
    eps: float = Field(default=1e-8, gt=0.0)
    weight_decay: float = Field(default=0.0, ge=0.0)
    grad_clip: float | None = Field(default=None, gt=0.0, description="Max global grad norm.")


class _Op(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    op_id: str = Field(pattern=OP_ID_PATTERN)


class ForwardBackwardRequest(_Op):
    """Compute the loss over a batch and add its gradients to the accumulated ones."""

    batch: TrainingBatch
    loss: LossName = "importance_sampling"
    clip_low: float = Field(default=0.2, ge=0.0, lt=1.0, description="PPO: ratio >= 1 - low.")
    clip_high: float = Field(default=0.2, ge=0.0, le=1e3, description="PPO: ratio <= 1 + high.")


def _finite_metrics(metrics: dict[str, float]) -> dict[str, float]:
    """Leave out metrics that are not numbers: JSON has no NaN, and a `null` would make the
    client lose track of an op the trainer applied."""
    return {k: v for k, v in metrics.items() if math.isfinite(v)}


class ForwardBackwardResult(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    op_id: str
    generation: int = Field(description="The trainer process lifetime that holds the gradients.")
    step: int = Field(description="Optimizer steps applied before this call.")
    metrics: dict[str, float] = Field(description="Finite metrics; undefined ones are left out.")

    _finite = field_validator("metrics")(_finite_metrics)


class OptimStepRequest(_Op):
    """Apply the accumulated gradients; `forward_backward_ops` names what the client expects.

    The server steps only if it holds the gradients of exactly these ops; otherwise (a restart
    lost some) it discards them all and answers `gradients_lost`, so a step is never taken on
    partial gradients.
    """

    adam: AdamParams
    forward_backward_ops: list[str]


class OptimStepResult(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    op_id: str
    step: int = Field(description="Optimizer steps applied, this one included.")
    metrics: dict[str, float] = Field(description="Finite metrics; undefined ones are left out.")

    _finite = field_validator("metrics")(_finite_metrics)


class SavePolicyRequest(_Op):
    """Publish the current weights as a new immutable policy."""


class SavePolicyResult(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    op_id: str
    step: int
    policy: PolicyRef


class OpKind(StrEnum):
    FORWARD_BACKWARD = "forward_backward"
    OPTIM_STEP = "optim_step"
    SAVE_POLICY = "save_policy"


class OpStatus(StrEnum):
    """What became of an applied op; an op the server never applied has no record at all."""

    PENDING = "pending"
    """forward_backward: its gradients are accumulated and wait for an optim_step."""
    APPLIED = "applied"
    """Done: a step or a save, or a forward_backward whose gradients an optim_step consumed."""
    LOST = "lost"
    """forward_backward: applied, but its gradients were discarded (a restart, or an
    optim_step that found the accumulated gradients incomplete). Redo the step's calls."""


class OpRecord(BaseModel):
    """The server's answer to `GET /v1/training/ops/{op_id}`."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    op_id: str
    kind: OpKind
    status: OpStatus
    result: dict[str, Any]


class TrainerState(BaseModel):
    """`GET /v1/training/state`: where the trainer stands, for resuming scripts and tests."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    generation: int
    step: int
    pending: list[str] = Field(description="forward_backward ops whose gradients wait.")
    pending_tokens: int
    in_flight: str | None = Field(default=None, description="The op being applied now.")
    policy: PolicyRef | None = Field(default=None, description="The last policy saved.")


class ErrorCode(StrEnum):
    """Wire error codes in `{"error": {"code", "message", "op_ids"}}` bodies."""

    GRADIENTS_LOST = "gradients_lost"
    """409: accumulated gradients are gone; maps to `TrainingGradientsLost`."""
    OP_CONFLICT = "op_conflict"
    """409: an op id was reused for a different request; maps to `ConfigError`."""
    INVALID_REQUEST = "invalid_request"
    """400/422: the request cannot be applied as sent; maps to `ConfigError`."""
    UNKNOWN_OP = "unknown_op"
    """404 on `GET ops/{op_id}`: the op was never applied, so sending it again is safe."""
    TRAINER_BROKEN = "trainer_broken"
    """503: the trainer could not persist its state; restart it from its state dir."""


def check_op_id(op_id: str) -> str:
    """Raise `ConfigError` naming the op id when it does not match `OP_ID_PATTERN`."""
    if not re.fullmatch(OP_ID_PATTERN, op_id):
        raise ConfigError(f"op id {op_id!r} must match {OP_ID_PATTERN}")
    return op_id
