"""The sampling wire: the subset of vLLM's (and SGLang's) HTTP API the reference server speaks.

Requests forbid fields the server does not implement, so a client never believes a
parameter (a penalty, `min_tokens`) was honoured when it was not. The served-name rule lives
here too, because the server that names a policy and the clients that ask for it must agree.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, field_validator

from ..trajectory import PolicyRef

__all__ = [
    "CompletionRequest",
    "GenerateRequest",
    "LoadPolicyRequest",
    "ModelCard",
    "SGLangSampling",
    "UnloadPolicyRequest",
    "served_name",
]


SEED_RANGE = (-(1 << 63), (1 << 64) - 1)
"""Seeds a torch generator takes (inclusive); others are refused, not wrapped."""
MIN_TEMPERATURE = 1e-3
"""Below it (and above 0, which is greedy) the processed logits overflow float32."""
MAX_TEMPERATURE = 1e3

TokenIds = list[StrictInt]
"""Token ids exactly as sent: `true` or `"5"` is refused, not read as 1 or 5."""
Seed = Field(default=None, ge=SEED_RANGE[0], le=SEED_RANGE[1])


def _temperature(v: float) -> float:
    if 0 < v < MIN_TEMPERATURE:
        raise ValueError(f"temperature must be 0 (greedy) or at least {MIN_TEMPERATURE}")
    return v


def served_name(version: int) -> str:
    """The name a published policy version is served under: `policy-<version>`.

    The reference server serves store version k under this name, and publishing to a sampler
    loads a policy under it, so every side derives the name the same way.
    """
    return f"policy-{version}"


class CompletionRequest(BaseModel):
    """`POST /v1/completions`: a token-id prompt, one choice, logprobs of sampled tokens."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    model: str = Field(description="Served name of the policy to sample from.")
    prompt: TokenIds = Field(description="Prompt token ids (text prompts are not accepted).")
    max_tokens: int = Field(default=16, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=MAX_TEMPERATURE)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1, description="-1, 0 or None: disabled.")
    seed: int | None = Seed
    stop_token_ids: TokenIds | None = None
    ignore_eos: bool = False
    logprobs: int | None = Field(default=None, description="0: logprob of each sampled token.")
    return_token_ids: bool = False
    return_tokens_as_token_ids: bool = False
    skip_special_tokens: bool = True
    stream: bool = Field(default=False, description="Server-sent events as tokens are sampled.")
    n: Literal[1] = 1
    stop: list[str] | None = Field(default=None, description="Only empty: stop by token id.")
    user: str | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _token_ids(cls, v: Any) -> Any:
        if isinstance(v, str):
            raise ValueError("the reference server takes token ids only, not a text prompt")
        if isinstance(v, list) and v and isinstance(v[0], list):
            if len(v) != 1:
                raise ValueError("one prompt per request")
            return v[0]
        return v

    _temperature = field_validator("temperature")(_temperature)

    @field_validator("logprobs")
    @classmethod
    def _logprobs(cls, v: int | None) -> int | None:
        if v not in (None, 0):
            raise ValueError("only logprobs=0 (the sampled token's logprob) is supported")
        return v

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: list[str] | None) -> list[str] | None:
        if v:
            raise ValueError("stop strings are not supported; use stop_token_ids")
        return v


class SGLangSampling(BaseModel):
    """The `sampling_params` of SGLang's `/generate` that the reference server honours."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    max_new_tokens: int = Field(default=128, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=MAX_TEMPERATURE)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=-1, ge=-1)
    stop_token_ids: TokenIds | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    sampling_seed: int | None = Seed

    _temperature = field_validator("temperature")(_temperature)


class GenerateRequest(BaseModel):
    """`POST /generate` (SGLang's native shape).

    SGLang names a loaded adapter with `lora_path`; here it is the served name of a policy
    (as `model` is on `/v1/completions`). Without one, the newest loaded policy answers, as an
    SGLang engine serves the weights it loaded last.
    """

    model_config = ConfigDict(extra="forbid")

    input_ids: TokenIds
    lora_path: str | None = Field(
        default=None, min_length=1, description="Served name of the policy to sample from."
    )
    sampling_params: SGLangSampling = Field(default_factory=SGLangSampling)
    return_logprob: bool = False
    logprob_start_len: int = Field(default=-1, description="Only -1: output tokens only.")
    stream: Literal[False] = False

    @field_validator("logprob_start_len")
    @classmethod
    def _output_only(cls, v: int) -> int:
        if v != -1:
            raise ValueError("only logprob_start_len=-1 (output tokens) is supported")
        return v


class LoadPolicyRequest(BaseModel):
    """`POST /v1/load_lora_adapter`, vLLM's shape; `lora_path` is a published policy dir."""

    model_config = ConfigDict(extra="forbid")

    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)
    load_inplace: bool = Field(default=False, description="Replace a policy of the same name.")


class UnloadPolicyRequest(BaseModel):
    """`POST /v1/unload_lora_adapter`."""

    model_config = ConfigDict(extra="forbid")

    lora_name: str = Field(min_length=1)
    lora_int_id: int | None = None


class ModelCard(BaseModel):
    """One entry of `GET /v1/models`, with the `PolicyRef` served under its name."""

    id: str
    object: Literal["model"] = "model"
    owned_by: str = "plies"
    root: str
    plies_policy: PolicyRef
