"""Sampling sessions: which published weights a `sampling_session_id` samples from.

A session points at a published policy directory (a tenant's snapshot, or version 0 of the
server's store for the base model). The engine loads it on first use under a name of its
own, and keeps at most `max_loaded` of them loaded, least recently used first out; an
evicted one is loaded again from disk when it is next sampled from. Sampling runs on the
server's batched engine, so Tinker samples share forward passes with `/v1/completions`.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import anyio

from .._engine import Engine, GenerateParams, GenerateResult, UnknownPolicy
from .._journal import Journal
from ._errors import TinkerRequestError
from ._proto import encode_samples
from ._schemas import AsampleRequest

__all__ = ["Sampler", "Samplers"]

log = logging.getLogger("plies.server.tinker")


@dataclass(frozen=True)
class Sampler:
    sampler_id: str
    base_model: str
    model_path: str | None  # the tinker:// path it was created from, if any
    policy_dir: Path


class Samplers:
    """Sampling sessions by id, named sampler weights by `tinker://` path, loaded policies.

    Sessions and paths are registered in `registry` (one fsynced line each) and read back
    when the server restarts, so a sampler id or path handed out before a crash still works.
    """

    def __init__(self, engine: Engine, tokenizer: Any, max_loaded: int, registry: Path):
        self._engine = engine
        self._tokenizer = tokenizer
        self._max_loaded = max_loaded
        self._loaded: OrderedDict[Path, str] = OrderedDict()
        self._lock = anyio.Lock()
        self._count = 0
        self.sessions: dict[str, Sampler] = {}
        self.paths: dict[str, Path] = {}
        registry.parent.mkdir(parents=True, exist_ok=True)
        self._registry = Journal(registry)
        for record in self._registry.read():
            if "session" in record:
                fields = {**record["session"], "policy_dir": Path(record["session"]["policy_dir"])}
                self.sessions[fields["sampler_id"]] = Sampler(**fields)
            elif "path" in record:
                self.paths[record["path"]] = Path(record["policy_dir"])
            else:
                self.paths.pop(record["forget"], None)

    def add_session(self, sampler: Sampler) -> None:
        self._registry.append(
            {"session": {**asdict(sampler), "policy_dir": str(sampler.policy_dir)}}
        )
        self.sessions[sampler.sampler_id] = sampler

    def add_path(self, uri: str, policy_dir: Path) -> None:
        self._registry.append({"path": uri, "policy_dir": str(policy_dir)})
        self.paths[uri] = policy_dir

    def forget_path(self, uri: str) -> bool:
        """Forget named sampler weights; whether they were known."""
        if uri not in self.paths:
            return False
        self._registry.append({"forget": uri})
        del self.paths[uri]
        return True

    def get(self, sampler_id: str) -> Sampler:
        """Raises: TinkerRequestError: no such sampling session (404)."""
        sampler = self.sessions.get(sampler_id)
        if sampler is None:
            raise TinkerRequestError(f"unknown sampling session {sampler_id!r}", status=404)
        return sampler

    async def _name(self, policy_dir: Path) -> str:
        """The engine name `policy_dir` is served under, loading it (and evicting) if need be."""
        async with self._lock:
            if policy_dir in self._loaded:
                self._loaded.move_to_end(policy_dir)
                return self._loaded[policy_dir]
            for name, ref in self._engine.served().items():
                if Path(ref.uri.removeprefix("file://")) == policy_dir.resolve():
                    return name  # already served by the native routes: never evicted here
            self._count += 1
            name = f"tinker-{self._count}"
            await self._engine.load(name, policy_dir, replace=True)
            self._loaded[policy_dir] = name
            while len(self._loaded) > self._max_loaded:
                _, old = self._loaded.popitem(last=False)
                self._engine.unload(old)
            return name

    def params(
        self, req: AsampleRequest, max_model_len: int
    ) -> tuple[list[GenerateParams], list[str]]:
        """The engine parameters of each sample, and the stop strings to cut at afterwards."""
        sp = req.sampling_params
        prompt = req.prompt_tokens
        max_tokens = sp.max_tokens or max_model_len - len(prompt)
        if max_tokens < 1 or len(prompt) + max_tokens > max_model_len:
            raise TinkerRequestError(
                f"prompt ({len(prompt)} tokens) + max_tokens ({max_tokens}) exceeds "
                f"max_model_len {max_model_len}"
            )
        stop = sp.stop
        strings: list[str] = []
        ids: set[int] = set()
        if isinstance(stop, str):
            strings = [stop]
        elif stop and isinstance(stop[0], str):
            strings = list(stop)  # type: ignore[arg-type]
        elif stop:
            ids = {int(t) for t in stop}  # type: ignore[union-attr]
        for s in strings:
            encoded = self._tokenizer.encode(s, add_special_tokens=False)
            if len(encoded) == 1:
                ids.add(encoded[0])  # stop early; longer strings are cut afterwards
        out = []
        for i in range(req.num_samples):
            out.append(
                GenerateParams(
                    max_tokens=max_tokens,
                    temperature=sp.temperature,
                    top_p=sp.top_p,
                    top_k=sp.top_k if sp.top_k > 0 else -1,
                    seed=None if sp.seed is None else sp.seed + i,
                    stop_token_ids=frozenset(ids),
                    ignore_eos=stop is not None,
                )
            )
        return out, strings

    async def sample(self, sampler: Sampler, req: AsampleRequest, max_model_len: int) -> bytes:
        """Draw `req.num_samples` completions together; the encoded `SampleResponse`."""
        params, strings = self.params(req, max_model_len)
        prompt = req.prompt_tokens
        results: list[GenerateResult | None] = [None] * len(params)

        async def one(i: int) -> None:
            for attempt in range(2):  # evicted between lookup and admission: load it again
                name = await self._name(sampler.policy_dir)
                try:
                    results[i] = await self._engine.generate(name, prompt, params[i])
                    return
                except UnknownPolicy:
                    if attempt:
                        raise

        async with anyio.create_task_group() as tg:
            for i in range(len(params)):
                tg.start_soon(one, i)
        samples = []
        for r in results:
            assert r is not None
            if r.finish_reason == "abort":
                raise TinkerRequestError("sampling was aborted")
            tokens, logprobs = r.ids, r.logprobs
            stopped = r.finish_reason == "stop"
            cut = self._cut(tokens, strings)
            if cut is not None:
                tokens, logprobs, stopped = tokens[:cut], logprobs[:cut], True
            samples.append((tokens, logprobs, stopped))
        return encode_samples(samples)

    def _cut(self, tokens: list[int], strings: list[str]) -> int | None:
        """How many tokens to keep so the completion ends at its first stop string."""
        if not strings:
            return None
        for n in range(1, len(tokens) + 1):
            text = self._tokenizer.decode(tokens[:n])
            if any(s in text for s in strings):
                return n
        return None
