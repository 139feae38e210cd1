"""The vLLM backend, also the client of the plies reference server (same wire subset).

Which policy produced a completion: the reference server says so in `plies_policy`; vLLM
does not, so the client tags each answer with the `PolicyRef` it knows is loaded under the
requested name (`register`, or the publishing helpers in `plies.policy`, keep that map).
While a helper swaps the weights behind a name, `switching` holds new requests back and
waits for this client's requests to that name to finish, so no answer can straddle a swap.

The client is also a `PolicyLoader`: `load_policy` serves a saved policy under
`served_name(version)`, so `publish(policy, [client])` is the whole publish cycle, and
`unload_policy` frees it. `load_lora_adapter` and `unload_lora_adapter` are those steps under
any name; they live here, beside the client whose name -> policy map they keep.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, Unpack

import anyio

from .._exceptions import ConfigError, PolicyError, PolicyResponseError
from ..trajectory import PolicyRef
from ..wire.sampling import served_name
from ._http import HTTPOptions, HTTPPolicyClient
from ._paths import policy_path
from ._types import Completion, PolicyChoice, SamplingParams, TokenSink

__all__ = ["VLLMClient", "load_lora_adapter", "unload_lora_adapter"]

_FINISH = {"stop": "stop", "length": "length", "abort": "abort"}


class VLLMClient(HTTPPolicyClient):
    """Samples through vLLM's `/v1/completions` with token-id prompts.

    Args:
        base_urls: one engine URL or several (load-balanced, sticky per session).
        model: the served name used when `sample` gets no `policy`.
        policy: the `PolicyRef` loaded under `model`, for engines that do not report it.
        timeout, retry, headers, session_header, transport: as for every HTTP backend; by default
            `sample(session=...)` also sends the session as `X-Session-ID`, for a router.

    Example:
        async with VLLMClient("http://127.0.0.1:8000", "policy-0") as client:
            c = await client.sample(prompt_ids, SamplingParams(max_tokens=64))
    """

    def __init__(
        self,
        base_urls: str | Sequence[str],
        model: str,
        *,
        policy: PolicyRef | None = None,
        **options: Unpack[HTTPOptions],
    ):
        super().__init__(base_urls, **options)
        if not model:
            raise ConfigError("VLLMClient needs the served model name")
        self.model = model
        self._refs: dict[str, PolicyRef | None] = {}
        if policy is not None:
            self._refs[model] = policy
        self._busy: dict[str, int] = {}
        self._gates: dict[str, anyio.Event] = {}
        self._idle: dict[str, anyio.Event] = {}

    # -- which policy is where ------------------------------------------------------------

    def register(self, name: str, policy: PolicyRef) -> None:
        """Record that `policy` is served under `name` on every engine of this client."""
        self._refs[name] = policy

    def forget(self, name: str) -> None:
        """Drop what is known about `name` (after unloading it)."""
        self._refs.pop(name, None)

    def served(self) -> dict[str, PolicyRef]:
        """Served name -> PolicyRef, as far as this client knows."""
        return {n: r for n, r in self._refs.items() if r is not None}

    async def refresh(self) -> dict[str, PolicyRef]:
        """Learn served names from `/v1/models` where the engine reports `plies_policy`."""
        data = await self._get_json("/v1/models")
        for card in data.get("data", []):
            ref = card.get("plies_policy")
            if ref is not None:
                self._refs[card["id"]] = PolicyRef.model_validate(ref)
        return self.served()

    async def load_policy(self, policy: PolicyRef) -> None:
        """Serve `policy` as `served_name(policy.version)` on every engine, next to older ones.

        vLLM loads the policy's directory as a LoRA adapter; the reference server loads its
        full weights and reports their digest, which must be the policy's. A policy that is
        already served under its name (known here, or listed by `/v1/models`) is not loaded
        again, so publishing twice is harmless.

        Raises:
            PolicyError: an engine refused the load or reports other weights.
        """
        name = served_name(policy.version)
        if self.served().get(name) != policy:
            await self.refresh()  # it may already serve it (an earlier publish)
        if self.served().get(name) != policy:
            await load_lora_adapter(self, name, policy, replace=name in self.served())

    async def unload_policy(self, policy: PolicyRef) -> None:
        """Stop serving `policy` under `served_name(policy.version)` on every engine (frees
        its memory); nothing happens when this client does not serve it there."""
        name = served_name(policy.version)
        if self.served().get(name) == policy:
            await unload_lora_adapter(self, name)

    async def _get_json(self, path: str) -> Any:
        return await self._send(await self._choose(None), path, None, method="GET")

    async def _name_of(self, policy: PolicyChoice) -> str:
        if policy is None:
            return self.model
        if isinstance(policy, str):
            return policy
        for _ in range(2):
            for name, ref in self._refs.items():
                if ref == policy:
                    return name
            await self.refresh()
        raise ConfigError(
            f"policy version {policy.version} ({policy.uri}) is not served under any name "
            f"this client knows; known: {sorted(self.served())}"
        )

    @asynccontextmanager
    async def switching(self, name: str) -> AsyncIterator[None]:
        """Hold new requests to `name` and wait for this client's in-flight ones to finish.

        Use around swapping the weights behind `name`, then `register` the new policy inside
        the block. If the block fails, the weights behind `name` are unknown: requests to it
        raise `PolicyError` until a policy is registered again.
        """
        if name in self._gates:
            raise ConfigError(f"a switch of {name!r} is already in progress")
        gate = self._gates[name] = anyio.Event()
        done = False
        try:
            while self._busy.get(name, 0):
                idle = self._idle.setdefault(name, anyio.Event())
                await idle.wait()
            yield
            done = True
        finally:
            if not done:
                self._refs[name] = None
            del self._gates[name]
            gate.set()

    # -- sampling -------------------------------------------------------------------------

    async def _sample(
        self, prompt: list[int], params: SamplingParams, policy: PolicyChoice, session: str | None
    ) -> Completion:
        async with self._request(prompt, params, policy) as (name, known, payload):
            data = await self._post("/v1/completions", payload, session)
        return self._completion(data, name, known)

    async def sample_streaming(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        on_tokens: TokenSink,
        *,
        policy: PolicyChoice = None,
        session: str | None = None,
    ) -> Completion:
        """Sample one completion with the engine streaming it (`stream: true`); see
        `StreamingPolicyClient.sample_streaming`. Each streamed chunk's token ids and
        logprobs are checked as the whole answer's are."""
        self._check_session(session)
        async with self._request(list(prompt_ids), params, policy) as (name, known, payload):
            payload = {**payload, "stream": True}
            ids: list[int] = []
            logprobs: list[float] = []
            finish: str | None = None
            reported: Any = None
            async with self._post_streaming("/v1/completions", payload, session) as chunks:
                async for chunk in chunks:
                    if not isinstance(chunk, dict) or "error" in chunk:
                        raise PolicyResponseError(
                            f"the engine failed mid-stream: {str(chunk)[:500]}"
                        )
                    try:
                        choice = chunk["choices"][0]
                    except (KeyError, IndexError, TypeError):
                        continue  # a usage record: no choice
                    new_ids, new_logprobs = _tokens(choice)
                    reported = chunk.get("plies_policy") or reported
                    finish = choice.get("finish_reason") or finish
                    ids += new_ids
                    logprobs += new_logprobs
                    if new_ids:
                        await on_tokens(new_ids)
        whole = {
            "choices": [
                {
                    "token_ids": ids,
                    "logprobs": {"token_logprobs": logprobs},
                    "finish_reason": finish,
                }
            ],
            "plies_policy": reported,
        }
        return self._completion(whole, name, known)

    @asynccontextmanager
    async def _request(
        self, prompt: list[int], params: SamplingParams, policy: PolicyChoice
    ) -> AsyncIterator[tuple[str, PolicyRef | None, dict[str, Any]]]:
        """The served name, its known policy and the request body, counted in flight (so
        `switching` can wait for it) while the caller sends it."""
        name = await self._name_of(policy)
        while name in self._gates:
            await self._gates[name].wait()
        known = self._refs.get(name, ...)
        if known is None:
            raise PolicyError(
                f"the weights behind {name!r} are unknown after a failed switch; "
                "register the policy that is loaded"
            )
        payload = {
            "model": name,
            "prompt": prompt,
            "max_tokens": params.max_tokens,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "top_k": params.top_k,
            "stop_token_ids": list(params.stop_token_ids),
            "logprobs": 0,
            "return_token_ids": True,
            "return_tokens_as_token_ids": True,
            "skip_special_tokens": False,
        }
        if params.seed is not None:
            payload["seed"] = params.seed
        self._busy[name] = self._busy.get(name, 0) + 1
        try:
            yield name, known if isinstance(known, PolicyRef) else None, payload
        finally:
            self._busy[name] -= 1
            if not self._busy[name] and name in self._idle:
                self._idle.pop(name).set()

    def _completion(self, data: Any, name: str, known: PolicyRef | None) -> Completion:
        try:
            choice = data["choices"][0]
            reason = _FINISH[choice["finish_reason"]]
        except (KeyError, IndexError, TypeError) as e:
            raise PolicyResponseError(
                f"completion response lacks token ids, logprobs or finish reason: {e!r}"
            ) from e
        ids, logprobs = _tokens(choice)
        reported = data.get("plies_policy")
        if reported is not None:
            policy = PolicyRef.model_validate(reported)
        elif known is not None:
            policy = known
        else:
            raise PolicyResponseError(
                f"the engine does not report which policy answered and none is registered "
                f"for {name!r}; call register({name!r}, policy_ref)"
            )
        return Completion(ids=ids, logprobs=logprobs, finish_reason=reason, policy=policy)


def _tokens(choice: Any) -> tuple[list[int], list[float]]:
    """A choice's (or a streamed chunk's) token ids and their logprobs, checked to align."""
    try:
        ids = [int(t) for t in choice["token_ids"]]
        lp_block = choice["logprobs"]
        if lp_block is None and not ids:  # a stream's last chunk may carry only its finish
            return [], []
        logprobs = [float(x) for x in lp_block["token_logprobs"]]
    except (KeyError, IndexError, TypeError, ValueError) as e:
        raise PolicyResponseError(
            f"completion response lacks token ids, logprobs or finish reason: {e!r}"
        ) from e
    if len(ids) != len(logprobs):
        raise PolicyResponseError(
            f"completion has {len(ids)} token ids but {len(logprobs)} logprobs"
        )
    tokens = lp_block.get("tokens")
    if tokens is not None and [f"token_id:{t}" for t in ids] != list(tokens):
        raise PolicyResponseError("logprob tokens do not match the returned token ids")
    return ids, logprobs


async def load_lora_adapter(
    client: VLLMClient,
    name: str,
    policy: PolicyRef,
    *,
    path: str | Path | None = None,
    replace: bool = False,
) -> None:
    """Serve `policy` as `name` on every engine of `client`, and register it there.

    Args:
        name: the served name to create (or replace with `replace=True`).
        policy: what is being loaded; every completion from `name` is tagged with it.
        path: the directory engines read; defaults to the policy's file URI.
        replace: swap an existing `name` in place (`load_inplace`); requests to `name` are
            held while it happens.
    """
    target = str(path or policy_path(policy))
    body = {"lora_name": name, "lora_path": target, "load_inplace": replace}

    async def load_everywhere() -> None:
        for url in client.base_urls:
            answer = await client._send(url, "/v1/load_lora_adapter", body, want_json=False)
            _check_loaded(url, name, policy, answer)
        client.register(name, policy)

    if replace:
        async with client.switching(name):
            await load_everywhere()
    else:
        await load_everywhere()


def _check_loaded(url: str, name: str, policy: PolicyRef, answer: str) -> None:
    """Where the engine reports the `PolicyRef` it loaded (the reference server does), its
    digest must be the policy's: other weights behind the name would mislabel every sample."""
    try:
        body = json.loads(answer)
    except ValueError:
        return  # vLLM: a plain-text confirmation
    reported = body.get("plies_policy") if isinstance(body, dict) else None
    if not isinstance(reported, dict) or not policy.digest:
        return
    if reported.get("digest") != policy.digest:
        raise PolicyResponseError(
            f"{url} loaded {name} with digest {reported.get('digest')}, expected {policy.digest}",
            url=url,
        )


async def unload_lora_adapter(client: VLLMClient, name: str) -> None:
    """Stop serving `name` on every engine of `client` (frees its memory)."""
    for url in client.base_urls:
        await client._send(url, "/v1/unload_lora_adapter", {"lora_name": name}, want_json=False)
    client.forget(name)
