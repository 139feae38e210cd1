"""The SGLang backend: `/generate` with token ids, logprobs and the engine's weight version.

SGLang reports which weights answered (`meta_info.weight_version`, a string set with
`--weight-version` at launch or by `/update_weights_from_disk`); the client maps each version
string to the `PolicyRef` published under it (`register`). An engine that serves several
adapters picks one by name (SGLang's `lora_path`, the client's `model`); without a name it
answers with the weights it loaded last.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Unpack

from .._exceptions import PolicyResponseError
from ..trajectory import PolicyRef
from ._http import HTTPOptions, HTTPPolicyClient
from ._types import Completion, PolicyChoice, SamplingParams

__all__ = ["SGLangClient"]


class SGLangClient(HTTPPolicyClient):
    """Samples through SGLang's native `/generate` endpoint with `input_ids`.

    Args:
        base_urls: one engine URL or several (load-balanced, sticky per session).
        model: the served name (adapter) to sample from, sent as `lora_path`; None: the
            engine's current weights.
        policy: the policy the engines serve at start, registered under `weight_version`.
        weight_version: the version string the engines report for `policy` (SGLang's
            default is "default").
        timeout, retry, headers, session_header, transport: as for every HTTP backend; by default
            `sample(session=...)` also sends the session as `X-Session-ID`, for a router.

    Example:
        async with SGLangClient(["http://10.0.0.1:30000"], policy=ref0) as client:
            c = await client.sample(prompt_ids, SamplingParams(max_tokens=64))
    """

    def __init__(
        self,
        base_urls: str | Sequence[str],
        *,
        model: str | None = None,
        policy: PolicyRef | None = None,
        weight_version: str = "default",
        **options: Unpack[HTTPOptions],
    ):
        super().__init__(base_urls, **options)
        self.model = model
        self._versions: dict[str, PolicyRef] = {}
        if policy is not None:
            self._versions[weight_version] = policy

    def register(self, weight_version: str, policy: PolicyRef) -> None:
        """Record that engines reporting `weight_version` serve `policy`."""
        self._versions[weight_version] = policy

    async def _sample(
        self, prompt: list[int], params: SamplingParams, policy: PolicyChoice, session: str | None
    ) -> Completion:
        """`policy` is checked, not routed: SGLang serves one set of weights per engine, so an
        answer from other weights than the requested ones raises `PolicyResponseError`."""
        sampling: dict[str, Any] = {
            "max_new_tokens": params.max_tokens,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "top_k": params.top_k if params.top_k > 0 else -1,
            "stop_token_ids": list(params.stop_token_ids),
            "skip_special_tokens": False,
            "no_stop_trim": True,
        }
        if params.seed is not None:
            sampling["sampling_seed"] = params.seed
        payload = {
            "input_ids": prompt,
            "sampling_params": sampling,
            "return_logprob": True,
            "logprob_start_len": -1,
        }
        if self.model is not None:
            payload["lora_path"] = self.model
        data = await self._post("/generate", payload, session)
        completion = self._completion(data)
        wanted = policy.version if isinstance(policy, PolicyRef) else None
        if isinstance(policy, str):
            wanted = self._versions[policy].version if policy in self._versions else None
        if wanted is not None and completion.policy.version != wanted:
            raise PolicyResponseError(
                f"asked for policy version {wanted}, the engine answered with version "
                f"{completion.policy.version}"
            )
        return completion

    def _completion(self, data: Any) -> Completion:
        try:
            meta = data["meta_info"]
            triples = meta["output_token_logprobs"]
            ids = [int(t[1]) for t in triples]
            logprobs = [float(t[0]) for t in triples]
            finish = meta["finish_reason"]
            kind = finish["type"] if isinstance(finish, dict) else str(finish)
            version = str(meta.get("weight_version", "default"))
        except (KeyError, IndexError, TypeError, ValueError) as e:
            raise PolicyResponseError(
                f"generate response lacks meta_info token logprobs or finish reason: {e!r}"
            ) from e
        reason = {"stop": "stop", "length": "length", "abort": "abort"}.get(kind)
        if reason is None:
            raise PolicyResponseError(f"unknown finish reason {finish!r}")
        output_ids = data.get("output_ids")
        if output_ids is not None and list(output_ids) != ids:
            raise PolicyResponseError("output_ids disagree with output_token_logprobs")
        policy = self._versions.get(version)
        if policy is None:
            raise PolicyResponseError(
                f"the engine answered with weight_version {version!r}, which no policy is "
                f"registered under; known: {sorted(self._versions)}"
            )
        return Completion(ids=ids, logprobs=logprobs, finish_reason=reason, policy=policy)
