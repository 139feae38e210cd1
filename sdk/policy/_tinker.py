"""`TinkerPolicyClient`: sampling through any Tinker-API service, with the `tinker` SDK.

Each published policy is a Tinker sampler: `load_policy(policy)` opens a sampling client on
the policy's `tinker://run/sampler_weights/<name>` path (what `TinkerTrainingClient`'s
`save_policy` returns), and a request for that `PolicyRef` samples from it. An episode
samples from the policy it was admitted under, so publishing a new policy makes new
episodes use the new sampler while episodes admitted earlier keep theirs, as with the
native publication. Every completion is tagged with the `PolicyRef` whose sampler drew it.

Failures follow `plies.policy`'s rule on what may be repeated:

- the service was never reached: opening the client fails at once (`PolicyUnavailable`);
  a request whose connection is refused is resent by the SDK with the same `seq_id` (it
  never ran) until the deadline;
- the request may have run: no answer within `Timeout.read`, a future the service lost, a
  connection dropped mid-request: `PolicyOutcomeUnknown`. The SDK's own retry of a sample
  as a *new* request (its `RetryHandler`) is switched off, so nothing is repeated silently;
- the service refused the request or answered something unusable: `PolicyResponseError`.

Tinker's `stop` list replaces the end-of-sequence token where vLLM's `stop_token_ids` add to
it, so `stop_token_ids` are sent together with the model's `eos_token_ids`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Self
from urllib.parse import quote

import anyio

from .._exceptions import (
    ConfigError,
    PolicyOutcomeUnknown,
    PolicyResponseError,
    PolicyUnavailable,
)
from .._lifecycle import AsyncCloseable
from .._tinker_sdk import blocking, close_service, outcome, service_url, unreachable
from ..trajectory import PolicyRef
from ._config import DEFAULT_TIMEOUT, Timeout
from ._types import Completion, PolicyChoice, PolicyClientBase, SamplingParams

if TYPE_CHECKING:
    import tinker

__all__ = ["TinkerPolicyClient"]

BASE_SCHEME = "tinker-base:"
"""URI prefix of a base model's `PolicyRef` (version 0): not a path the service stores."""


class TinkerPolicyClient(AsyncCloseable, PolicyClientBase):
    """A `PolicyClient` and `PolicyLoader` on a Tinker-API service. Use as `async with`.

    Args:
        base_url: the service; default `TINKER_BASE_URL`, then hosted Tinker.
        base_model: the model the service samples, as it names it (`policy=None` and
            `base` sample from it).
        api_key: default `TINKER_API_KEY` (`plies serve` accepts any `tml-...` key).
        eos_token_ids: the model's end-of-sequence ids, sent with `stop_token_ids`.
        timeout: `read` bounds one sample, answer included; `connect` bounds opening.

    Example:
        async with TinkerPolicyClient(url, base_model="Qwen/Qwen3-8B") as sampler:
            await publish(await trainer.save_policy(), [sampler])
            c = await sampler.sample(prompt_ids, SamplingParams(max_tokens=64), policy=ref)
    """

    def __init__(
        self,
        base_url: str | None = None,
        *,
        base_model: str,
        api_key: str | None = None,
        eos_token_ids: Sequence[int] = (),
        timeout: Timeout = DEFAULT_TIMEOUT,
    ):
        self.base_url = service_url(base_url, "TinkerPolicyClient")
        if not base_model:
            raise ConfigError("TinkerPolicyClient needs the base model's name")
        self.base_model = base_model
        self.eos_token_ids = tuple(eos_token_ids)
        self.timeout = timeout
        self._api_key = api_key
        self._service: tinker.ServiceClient | None = None
        self._samplers: dict[str, tinker.SamplingClient] = {}  # policy URI -> its sampler
        self._opening = anyio.Lock()  # opens one sampler at a time, each once

    @property
    def base(self) -> PolicyRef:
        """The base model as a policy: version 0, sampled when no policy is named."""
        return PolicyRef(uri=BASE_SCHEME + quote(self.base_model, safe="/"), version=0)

    # -- lifetime -------------------------------------------------------------------------

    async def __aenter__(self) -> Self:
        self._open()
        limit = self.timeout.connect or 60.0
        down = await unreachable(self.base_url, limit)
        if down is not None:
            self._close()
            raise PolicyUnavailable(
                f"no Tinker service answers at {self.base_url}: {down}", url=self.base_url
            )
        try:
            self._service = await blocking(self._connect, timeout=4 * limit, what="sampler")
            await self._sampler(self.base)
        except Exception as exc:
            await self.aclose()
            raise PolicyUnavailable(
                f"could not open sampling on {self.base_url}: {type(exc).__name__}: {exc}",
                url=self.base_url,
            ) from exc
        return self

    async def aclose(self) -> None:
        """Finish the session (samplers of saved weights stay on the service). Idempotent."""
        self._close()
        service, self._service = self._service, None
        self._samplers.clear()
        if service is not None:
            await close_service(service)

    def _connect(self) -> tinker.ServiceClient:
        """Blocking: the session, opened now rather than on the first sample."""
        import tinker

        service = tinker.ServiceClient(base_url=self.base_url, api_key=self._api_key)
        service.holder.get_session_id()
        return service

    # -- publication ----------------------------------------------------------------------

    async def load_policy(self, policy: PolicyRef) -> None:
        """Open the sampler of `policy`'s weights; harmless when it is open already.

        Raises:
            ConfigError: `policy` is not Tinker sampler weights (`tinker://...`).
            PolicyError: the service could not open a sampler on it.
        """
        self._check_open("load a policy")
        await self._sampler(policy)

    async def unload_policy(self, policy: PolicyRef) -> None:
        """Close this client's sampler of `policy` (episodes that still ask for it reopen it);
        the service keeps the weights."""
        self._samplers.pop(policy.uri, None)

    async def _sampler(self, policy: PolicyRef) -> tinker.SamplingClient:
        """The sampler of `policy`, opened once even when many episodes ask at once."""
        known = self._samplers.get(policy.uri)
        if known is not None:
            return known
        async with self._opening:
            known = self._samplers.get(policy.uri)
            if known is None:
                known = self._samplers[policy.uri] = await self._create(policy)
        return known

    async def _create(self, policy: PolicyRef) -> tinker.SamplingClient:
        from tinker.lib.retry_handler import RetryConfig

        service = self._service
        assert service is not None
        retry = RetryConfig(enable_retry_logic=False)  # a retried sample is a new sample
        if policy.uri.startswith(BASE_SCHEME):
            opening = service.create_sampling_client(base_model=self.base_model, retry_config=retry)
        elif policy.uri.startswith("tinker://"):
            opening = service.create_sampling_client(
                model_path=policy.uri, base_model=self.base_model, retry_config=retry
            )
        else:
            raise ConfigError(
                f"policy {policy.uri} is not Tinker sampler weights (tinker://...): publish "
                "the policies a TinkerTrainingClient saves"
            )
        try:
            return await outcome(opening, self.timeout.read or None)
        except Exception as exc:
            raise _translate(exc, f"opening a sampler on {policy.uri}", self.base_url) from exc

    # -- sampling -------------------------------------------------------------------------

    async def _draw(
        self, prompt: list[int], params: SamplingParams, policy: PolicyChoice, session: str | None
    ) -> Completion:
        """`session` is not used: one service URL, which routes requests itself."""
        from tinker import types

        self._check_open("sample")
        if isinstance(policy, str):
            raise ConfigError(
                f"a Tinker sampler is named by its PolicyRef, not a served name ({policy!r})"
            )
        ref = policy or self.base
        sampler = await self._sampler(ref)
        stop: list[int] | None = None
        if params.stop_token_ids:
            if not self.eos_token_ids:
                raise ConfigError(
                    "stop_token_ids replace the end-of-sequence token on a Tinker service: "
                    "give TinkerPolicyClient(eos_token_ids=...) so that EOS still stops"
                )
            stop = [*params.stop_token_ids, *self.eos_token_ids]
        sampling = types.SamplingParams(
            max_tokens=params.max_tokens,
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k if params.top_k > 0 else -1,
            seed=params.seed,
            stop=stop,
        )
        future = sampler.sample(types.ModelInput.from_ints(prompt), 1, sampling)
        try:
            answer = await outcome(future, self.timeout.read or None)
        except Exception as exc:
            raise _translate(exc, f"sampling from {ref.uri}", self.base_url) from exc
        return _completion(answer, ref, self.base_url)


def _translate(exc: Exception, what: str, url: str) -> Exception:
    """The plies error an SDK failure means; by whether the request may have run."""
    import tinker
    from tinker.lib.retryable_exception import RetryableException

    if isinstance(exc, ConfigError):
        return exc
    if isinstance(exc, TimeoutError):
        return PolicyOutcomeUnknown(
            f"{what}: no answer from {url} in time; the request may have run", url=url
        )
    if isinstance(exc, tinker.APIConnectionError | RetryableException):
        return PolicyOutcomeUnknown(
            f"{what}: the answer was lost ({type(exc).__name__}: {exc}); the request may have run",
            url=url,
        )
    if isinstance(exc, tinker.APIStatusError | tinker.RequestFailedError | ValueError):
        return PolicyResponseError(f"{what}: {type(exc).__name__}: {exc}", url=url)
    return PolicyOutcomeUnknown(f"{what}: {type(exc).__name__}: {exc}", url=url)


def _completion(answer: Any, policy: PolicyRef, url: str) -> Completion:
    try:
        (sequence,) = answer.sequences
        ids = [int(t) for t in sequence.tokens]
        logprobs = sequence.logprobs
        reason = {"stop": "stop", "length": "length"}[sequence.stop_reason]
    except (AttributeError, KeyError, TypeError, ValueError) as exc:
        raise PolicyResponseError(
            f"{url} answered a sample without one sequence, its tokens or stop reason: {exc!r}",
            url=url,
        ) from exc
    if logprobs is None or len(logprobs) != len(ids):
        raise PolicyResponseError(
            f"{url} answered {len(ids)} tokens without a logprob each", url=url
        )
    return Completion(
        ids=ids, logprobs=[float(x) for x in logprobs], finish_reason=reason, policy=policy
    )
