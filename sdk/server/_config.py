"""Configuration of the reference server: what a production `plies serve` may set.

Test-only behaviour (holding the trainer at a fault point) is not configuration: it is
switched on by `create_app(..., test_faults=True)` alone, see `_faults.py`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr

__all__ = ["ServerConfig", "TinkerConfig", "TrainerConfig"]


class TrainerConfig(BaseModel):
    """Knobs of the trainer behind the training routes."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_head_rows: int = Field(
        default=512, ge=1, description="Most loss positions per micro-batch (head rows)."
    )
    max_micro_tokens: int = Field(
        default=16384, ge=1, description="Most padded tokens per micro-batch forward."
    )
    keep_checkpoints: int = Field(default=1, ge=1, description="Checkpoints kept on disk.")
    checkpoint_seconds: float = Field(
        default=30.0,
        ge=0.0,
        allow_inf_nan=False,
        description=(
            "Least time between checkpoints of model and optimizer (0: at every optim_step). "
            "Steps in between are journaled with their batches and redone on reopen, so this "
            "bounds the redo, not what survives a crash."
        ),
    )


class TinkerConfig(BaseModel):
    """Limits of the Tinker API routes (`/api/v1/`, see `_tinker/`)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_models: int = Field(
        default=8, ge=1, description="Training tenants (create_model) held at once."
    )
    max_loaded_samplers: int = Field(
        default=4,
        ge=1,
        description="Sampler snapshots kept loaded in the engine; older ones reload on use.",
    )
    max_datums: int = Field(
        default=1024, ge=1, description="Datums per forward_backward request (the SDK's chunk)."
    )
    max_samples: int = Field(default=128, ge=1, description="num_samples per asample request.")
    poll_seconds: float = Field(
        default=25.0, gt=0, description="How long retrieve_future holds a pending future."
    )
    gap_seconds: float = Field(
        default=60.0,
        gt=0,
        description="How long a later seq_id waits for a missing one before failing.",
    )


class ServerConfig(BaseModel):
    """Everything `create_app` needs; `plies serve` fills it from its options."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model_dir: Path = Field(description="Hugging Face model directory; becomes policy version 0.")
    state_dir: Path = Field(description="Where published policies live (STATE_DIR/policies/).")
    host: str = Field(default="127.0.0.1", description="Bind address; loopback by default.")
    port: int = Field(default=0, ge=0, le=65535, description="0 picks a free port.")
    max_batch_size: int = Field(
        default=32, ge=1, description="Most sequences decoded together in one forward pass."
    )
    max_queued: int = Field(
        default=1024,
        ge=1,
        description="Requests waiting or running past which new ones get 503 (overload).",
    )
    max_model_len: int = Field(
        default=4096, ge=2, description="Prompt plus completion tokens allowed per request."
    )
    batch_invariant: bool = Field(
        default=False,
        description="Decode every request alone, so its logprobs do not depend on what else is "
        "in flight and a seeded request is reproduced bit for bit (`plies replay`); costs the "
        "throughput of batching (bench/sampler_bench.py).",
    )
    device: Literal["auto", "cpu", "cuda"] = Field(
        default="auto", description="auto: cuda when available, else cpu."
    )
    trainer: TrainerConfig = Field(
        default_factory=TrainerConfig, description="Knobs of the training routes."
    )
    model_name: str | None = Field(
        default=None,
        description="The base model's name on the Tinker API (a hub name such as "
        "`Qwen/Qwen3-8B`); by default the model directory's name.",
    )
    tinker: TinkerConfig = Field(
        default_factory=TinkerConfig, description="Limits of the Tinker API routes."
    )
    token: SecretStr | None = Field(
        default=None,
        min_length=16,
        description="The secret every request but /health must carry (Authorization: Bearer, "
        "or X-API-Key); required to bind beyond loopback. See docs/operations.md.",
    )
    max_body_bytes: int = Field(
        default=1 << 20, ge=1024, description="Largest request body, training batches aside."
    )
    max_training_body_bytes: int = Field(
        default=64 << 20, ge=1024, description="Largest forward_backward body."
    )
    allow_paths: tuple[Path, ...] = Field(
        default=(),
        description="Directories besides STATE_DIR whose published policies clients may "
        "load by path (/v1/load_lora_adapter).",
    )

    @property
    def served_model_name(self) -> str:
        """The name the Tinker API serves the base model under."""
        return self.model_name or self.model_dir.name
