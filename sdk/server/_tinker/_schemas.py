"""The JSON request bodies of the Tinker routes, as `tinker==0.38.0` sends them.

The SDK leaves out every field that is None and may add fields in later releases, so unknown
fields are ignored; only what this server acts on is declared. `forward_backward` is
protobuf and is read in `_proto.py`.
"""

from __future__ import annotations

import math
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from .._adam import AdamSettings, check_adam

__all__ = [
    "AdamParams",
    "AsampleRequest",
    "CreateModelRequest",
    "CreateSamplingSessionRequest",
    "EncodedText",
    "GetInfoRequest",
    "LoadWeightsRequest",
    "LoraConfig",
    "OptimStepRequest",
    "SamplingParams",
    "SaveForSamplerRequest",
    "SaveWeightsRequest",
    "UnloadModelRequest",
    "WeightsInfoRequest",
]


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class LoraConfig(_Body):
    rank: int = Field(default=32, ge=1, le=1024)
    seed: int | None = None
    train_unembed: bool = True
    train_mlp: bool = True
    train_attn: bool = True


class CreateModelRequest(_Body):
    session_id: str = Field(min_length=1, max_length=200)
    model_seq_id: int = Field(ge=0)
    base_model: str
    lora_config: LoraConfig | None = None


class GetInfoRequest(_Body):
    model_id: str


class AdamParams(_Body):
    learning_rate: float = Field(default=1e-4, ge=0)
    beta1: float = Field(default=0.9, ge=0, lt=1)
    beta2: float = Field(default=0.95, ge=0, lt=1)
    eps: float = Field(default=1e-12, gt=0)
    weight_decay: float = Field(default=0.0, ge=0)
    grad_clip_norm: float = Field(default=0.0, ge=0, description="0 means no clipping.")

    @field_validator("*")
    @classmethod
    def _finite(cls, v: float) -> float:
        if not math.isfinite(v):
            raise ValueError("must be finite")
        return v

    @model_validator(mode="after")
    def _bounded(self) -> AdamParams:
        """Settings float32 weights can take (`_adam.check_adam`)."""
        check_adam(self.settings)
        return self

    @property
    def settings(self) -> AdamSettings:
        """These settings as the step shared with the native trainer takes them."""
        clip = self.grad_clip_norm if self.grad_clip_norm > 0 else None
        return AdamSettings(
            self.learning_rate, self.beta1, self.beta2, self.eps, self.weight_decay, clip
        )


class OptimStepRequest(_Body):
    model_id: str
    seq_id: int = Field(ge=0)
    adam_params: AdamParams | None = None


class SaveForSamplerRequest(_Body):
    model_id: str
    seq_id: int = Field(ge=0)
    path: str | None = Field(default=None, min_length=1, max_length=200, pattern=r"^[^/]+$")
    sampling_session_seq_id: int | None = Field(default=None, ge=0)


class SaveWeightsRequest(_Body):
    model_id: str
    seq_id: int = Field(ge=0)
    path: str | None = Field(default=None, description="The checkpoint's name.")
    overwrite: bool = False
    user_metadata: dict[str, str] | None = None


class LoadWeightsRequest(_Body):
    """Either `model_id` + `seq_id` (load into a live model, the deprecated `load_state`) or
    `session_id` + `model_seq_id` (create the model from the checkpoint)."""

    path: str
    optimizer: bool = False
    model_id: str | None = None
    seq_id: int | None = Field(default=None, ge=0)
    session_id: str | None = None
    model_seq_id: int | None = Field(default=None, ge=0)
    base_model: str | None = None
    optimizer_config: dict | None = None
    user_metadata: dict[str, str] | None = None


class WeightsInfoRequest(_Body):
    tinker_path: str


class UnloadModelRequest(_Body):
    model_id: str


class CreateSamplingSessionRequest(_Body):
    session_id: str
    sampling_session_seq_id: int = Field(ge=0)
    model_path: str | None = None
    base_model: str | None = None


class EncodedText(_Body):
    type: Literal["encoded_text"] = "encoded_text"
    tokens: list[int]


class _Prompt(_Body):
    chunks: list[EncodedText] = Field(min_length=1)


class SamplingParams(_Body):
    max_tokens: int | None = Field(default=None, ge=1)
    seed: int | None = None
    stop: str | list[str] | list[int] | None = None
    temperature: float = Field(default=1.0, ge=0, le=100)
    top_k: int = -1
    top_p: float = Field(default=1.0, gt=0, le=1)


class AsampleRequest(_Body):
    sampling_session_id: str | None = None
    num_samples: int = Field(default=1, ge=1)
    prompt: _Prompt
    sampling_params: SamplingParams
    prompt_logprobs: bool = False
    topk_prompt_logprobs: int = 0
    topk_sample_logprobs: int = 0
    prompt_alt_tokens_k: int = 0
    prompt_logprobs_last_n: int | None = None
    target_prompt_logprobs: dict | None = None

    @property
    def prompt_tokens(self) -> list[int]:
        return [t for chunk in self.prompt.chunks for t in chunk.tokens]

    def unsupported(self) -> list[str]:
        """The options this server refuses (the SDK checks its answer for each of them)."""
        asked = {
            "topk_sample_logprobs": self.topk_sample_logprobs > 0,
            "prompt_alt_tokens_k": self.prompt_alt_tokens_k > 0,
            "target_prompt_logprobs": self.target_prompt_logprobs is not None,
        }
        return [name for name, on in asked.items() if on]

    def prompt_scoring(self, max_topk: int) -> tuple[int, int] | None:
        """`(first, k)`: score prompt positions from `first` on, with the top `k` tokens at
        each (0: none); None when the request asks for no prompt logprobs.

        Raises:
            ValueError: a bound is out of range (the message says which).
        """
        if not self.prompt_logprobs and self.topk_prompt_logprobs <= 0:
            if self.prompt_logprobs_last_n is not None:
                raise ValueError("prompt_logprobs_last_n needs include_prompt_logprobs")
            return None
        if not 0 <= self.topk_prompt_logprobs <= max_topk:
            raise ValueError(
                f"topk_prompt_logprobs {self.topk_prompt_logprobs} is outside [0, {max_topk}]"
            )
        n = len(self.prompt_tokens)
        last = self.prompt_logprobs_last_n
        if last is None:
            return 1, self.topk_prompt_logprobs
        if not 1 <= last <= n - 1:
            raise ValueError(f"prompt_logprobs_last_n {last} is outside [1, {n - 1}]")
        return n - last, self.topk_prompt_logprobs
