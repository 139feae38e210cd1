"""What a policy client takes and returns, the protocol every backend implements (and the
base that writes its `sample` once for plies' own), and the protocol of samplers that load
published policies."""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Sequence
from typing import Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict, Field, model_validator

from .._exceptions import PolicyResponseError
from ..trajectory import FinishReason, PolicyRef

__all__ = [
    "Completion",
    "PolicyChoice",
    "PolicyClient",
    "PolicyClientBase",
    "PolicyLoader",
    "SamplingParams",
    "StreamingPolicyClient",
    "TokenSink",
]


class SamplingParams(BaseModel):
    """How to sample one completion.

    Logprobs always follow one convention: the logprob of each sampled token under the
    distribution it was drawn from, after temperature, top-k and top-p (vLLM's
    `processed_logprobs`). At temperature 0 the token is the argmax and its logprob is taken
    from the raw logits.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_tokens: int = Field(ge=1, description="Most tokens to sample.")
    temperature: float = Field(default=1.0, ge=0.0, description="0 means greedy.")
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, description="1.0 disables it.")
    top_k: int = Field(default=-1, ge=-1, description="-1 or 0 disables it.")
    seed: int | None = Field(default=None, description="Per-request seed, for reproducibility.")
    stop_token_ids: tuple[int, ...] = Field(
        default=(), description="Sampling stops after any of these (kept in the completion)."
    )


class Completion(BaseModel):
    """One sampled completion, exactly as the engine produced it."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    ids: list[int] = Field(description="Sampled token ids, stop token included.")
    logprobs: list[float] = Field(description="One sampler logprob per id.")
    finish_reason: FinishReason
    policy: PolicyRef = Field(description="The published policy whose weights sampled it.")

    @model_validator(mode="after")
    def _aligned(self) -> Completion:
        if len(self.ids) != len(self.logprobs):
            raise PolicyResponseError(
                f"{len(self.ids)} token ids but {len(self.logprobs)} logprobs"
            )
        bad = next((i for i, lp in enumerate(self.logprobs) if not math.isfinite(lp)), None)
        if bad is not None:  # a NaN would be written as null, and the record would not read back
            raise PolicyResponseError(f"logprob {bad} is {self.logprobs[bad]}, not a finite number")
        return self


PolicyChoice = PolicyRef | str | None
"""The policy a caller asks `sample` for: a `PolicyRef`, a served name, or the default."""


@runtime_checkable
class PolicyClient(Protocol):
    """Samples completions of token-id prompts; tokens in, tokens and logprobs out."""

    async def sample(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        *,
        policy: PolicyRef | str | None = None,
        session: str | None = None,
    ) -> Completion:
        """Sample one completion of `prompt_ids`.

        Args:
            prompt_ids: the exact prompt tokens.
            params: sampling parameters.
            policy: which policy samples: a `PolicyRef` or a served name; None is the
                client's default.
            session: a key (e.g. the episode id) that keeps requests on one engine, so its
                prefix cache holds the history.

        Raises:
            PolicyUnavailable: no engine could be reached, after bounded retries.
            PolicyOutcomeUnknown: the request may have run; it was not repeated.
            PolicyResponseError: the engine refused the request or answered unusably.
        """
        ...

    async def aclose(self) -> None: ...


class PolicyClientBase(ABC):
    """The `sample` of plies' own clients, written once: each takes the prompt as a list in
    `_draw`, where what tells the backends apart lives."""

    async def sample(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        *,
        policy: PolicyChoice = None,
        session: str | None = None,
    ) -> Completion:
        """Sample one completion; see `PolicyClient.sample`."""
        return await self._draw(list(prompt_ids), params, policy, session)

    @abstractmethod
    async def _draw(
        self, prompt: list[int], params: SamplingParams, policy: PolicyChoice, session: str | None
    ) -> Completion:
        """`sample`, its arguments checked by the backend; `policy` is what the caller asked."""


TokenSink = Callable[[Sequence[int]], Awaitable[None]]
"""Told each run of newly sampled ids, in order, while a completion is being sampled."""


@runtime_checkable
class StreamingPolicyClient(PolicyClient, Protocol):
    """A policy client whose engine sends tokens as it samples them.

    What the gateway uses to stream a reply to an agent while it is sampled; the record is
    still the returned `Completion`, whole and exact. Clients without it are sampled whole.
    """

    async def sample_streaming(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        on_tokens: TokenSink,
        *,
        policy: PolicyRef | str | None = None,
        session: str | None = None,
    ) -> Completion:
        """Sample as `sample` does, telling `on_tokens` each run of ids as the engine sends
        them; the runs told add up to the returned completion's ids.

        A failure after the first run was told is never retried: the request ran.

        Raises:
            As `PolicyClient.sample`.
        """
        ...


@runtime_checkable
class PolicyLoader(Protocol):
    """A sampler that can start serving a published policy; what `publish` drives.

    Loading a policy the sampler already serves must be harmless, so a failed publication
    can simply be repeated. `VLLMClient` loads each policy under `served_name(version)`
    next to older ones; `ReloadInPlace` swaps the weights behind one name instead.

    Example:
        class MyEngines:
            async def load_policy(self, policy: PolicyRef) -> None:
                await my_fleet.load(policy_path(policy), tag=policy.version)
    """

    async def load_policy(self, policy: PolicyRef) -> None:
        """Serve `policy` from now on.

        Raises:
            PolicyError: the sampler could not load it, or reports other weights.
        """
        ...
