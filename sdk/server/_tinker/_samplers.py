"""Sampling sessions: which published weights a `sampling_session_id` samples from.

A session points at a published policy directory (a tenant's snapshot, or version 0 of the
server's store for the base model). The engine loads it on first use under a name of its
own, and keeps at most `max_loaded` of them loaded, least recently used first out; an
evicted one is loaded again from disk when it is next sampled from. Sampling runs on the
server's batched engine, so Tinker samples share forward passes with `/v1/completions`.

Every snapshot is a whole copy of the weights, so a run that saves one per step would grow
the state dir by a model per step. Retention: of a run's snapshots that no name points at
(`save_weights_and_get_sampling_client`, or named weights whose name was deleted), the
`KEEP_UNNAMED` newest stay; older ones are deleted, and their sessions answer a 400 that
says so. Named sampler weights stay until their name is deleted; the base model stays.
"""

from __future__ import annotations

import functools
import logging
import re
import shutil
from collections import OrderedDict
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import torch

from .._engine import Engine, GenerateParams, GenerateResult, UnknownPolicy
from .._journal import Journal
from .._quote import quoted
from ._errors import TinkerRequestError
from ._proto import MASK_LOGPROB, PromptScores, encode_samples
from ._schemas import AsampleRequest

__all__ = [
    "KEEP_UNNAMED",
    "MAX_STOP_CHARS",
    "MAX_STOP_STRINGS",
    "MAX_TOPK",
    "Sampler",
    "Samplers",
    "StopStrings",
    "score_prompt",
]

KEEP_UNNAMED = 4
"""Unnamed sampler snapshots kept per run (an RL loop samples from the newest, or from a
few steps back when it runs off-policy)."""

MAX_TOPK = 64
"""The widest `topk_prompt_logprobs` answered (the cost is the prompt length times k)."""

MAX_STOP_STRINGS = 32
"""The most stop strings one asample takes (each is searched for in every sample)."""
MAX_STOP_CHARS = 256
"""The longest stop string: the text window kept while matching is this long."""

_HEAD_ROWS = 256
"""Prompt positions whose head rows are evaluated together (about 150 MB of logits)."""

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
        self.pruned: set[Path] = set()
        self._snapshots: dict[Path, list[Path]] = {}  # a run's policies dir -> oldest first
        registry.parent.mkdir(parents=True, exist_ok=True)
        # Records: session (with "snapshot" if it made one), path, forget, pruned.
        self._registry = Journal(registry, required=())
        for record in self._registry.read():
            if "session" in record:
                fields = {**record["session"], "policy_dir": Path(record["session"]["policy_dir"])}
                self.sessions[fields["sampler_id"]] = Sampler(**fields)
                if record.get("snapshot"):
                    self._track(fields["policy_dir"])
            elif "path" in record:
                self.paths[record["path"]] = Path(record["policy_dir"])
                self._track(Path(record["policy_dir"]))
            elif "forget" in record:
                self.paths.pop(record["forget"], None)
            else:
                self._untrack(Path(record["pruned"]))
                self.pruned.add(Path(record["pruned"]))

    def add_session(self, sampler: Sampler, *, snapshot: bool = False) -> None:
        """Register a sampling session; `snapshot`: its weights are a snapshot made for it
        (`save_weights_and_get_sampling_client`), which the retention rule may prune."""
        record: dict[str, Any] = {
            "session": {**asdict(sampler), "policy_dir": str(sampler.policy_dir)}
        }
        if snapshot:
            record["snapshot"] = True
        self._registry.append(record)
        self.sessions[sampler.sampler_id] = sampler
        if snapshot:
            self._track(sampler.policy_dir)
            self._prune(sampler.policy_dir.parent)

    def add_path(self, uri: str, policy_dir: Path) -> None:
        self._registry.append({"path": uri, "policy_dir": str(policy_dir)})
        self.paths[uri] = policy_dir
        self._track(policy_dir)

    def forget_path(self, uri: str) -> bool:
        """Forget named sampler weights; whether they were known. Their snapshot is then
        unnamed, and pruned like one."""
        if uri not in self.paths:
            return False
        self._registry.append({"forget": uri})
        policy_dir = self.paths.pop(uri)
        self._prune(policy_dir.parent)
        return True

    def get(self, sampler_id: str) -> Sampler:
        """Raises: TinkerRequestError: no such sampling session (404), or its snapshot was
        pruned (400)."""
        sampler = self.sessions.get(sampler_id)
        if sampler is None:
            raise TinkerRequestError(f"unknown sampling session {quoted(sampler_id)}", status=404)
        if sampler.policy_dir in self.pruned:
            raise TinkerRequestError(
                f"sampling session {quoted(sampler_id)} sampled from an unnamed sampler snapshot "
                f"that was deleted: plies serve keeps the {KEEP_UNNAMED} newest unnamed "
                "snapshots of a run; save_weights_for_sampler(name) keeps one until its name "
                "is deleted"
            )
        return sampler

    def _track(self, policy_dir: Path) -> None:
        runs = self._snapshots.setdefault(policy_dir.parent, [])
        if policy_dir not in runs:
            runs.append(policy_dir)

    def _untrack(self, policy_dir: Path) -> None:
        runs = self._snapshots.get(policy_dir.parent, [])
        if policy_dir in runs:
            runs.remove(policy_dir)

    def _prune(self, run_policies: Path) -> None:
        """Delete the run's unnamed snapshots but the `KEEP_UNNAMED` newest. A loaded one
        stays in memory until evicted (its sessions are refused from now on); the newest
        snapshot is never deleted, so a version number is never published twice."""
        named = set(self.paths.values())
        unnamed = [d for d in self._snapshots.get(run_policies, []) if d not in named]
        for old in unnamed[: max(len(unnamed) - KEEP_UNNAMED, 0)]:
            self._registry.append({"pruned": str(old)})
            self.pruned.add(old)
            self._untrack(old)
            shutil.rmtree(old, ignore_errors=True)
            log.info("pruned the sampler snapshot %s", old)

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

    async def _with_policy(self, sampler: Sampler, fn):
        """`await fn(name)` on the engine name of `sampler`'s weights, loading them again
        if they were evicted between the lookup and the use."""
        for attempt in range(2):
            name = await self._name(sampler.policy_dir)
            try:
                return await fn(name)
            except UnknownPolicy:
                if attempt:
                    raise
        raise AssertionError("unreachable")

    @staticmethod
    def check(req: AsampleRequest, max_model_len: int) -> tuple[int, list[str], set[int]]:
        """The completion length and the stop strings and ids `req` asks for, checked.

        Cheap (no tokenizer): the route calls it before answering with a future.

        Raises:
            TinkerRequestError: too long a completion, or too many, empty or too long stop
                strings.
        """
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
        if len(strings) > MAX_STOP_STRINGS:
            raise TinkerRequestError(
                f"{len(strings)} stop strings; at most {MAX_STOP_STRINGS} are taken"
            )
        for s in strings:
            if not 1 <= len(s) <= MAX_STOP_CHARS:
                raise TinkerRequestError(
                    f"stop string {quoted(s)} has {len(s)} characters; "
                    f"1 to {MAX_STOP_CHARS} are taken"
                )
        return max_tokens, strings, ids

    def params(
        self, req: AsampleRequest, max_model_len: int
    ) -> tuple[list[GenerateParams], StopStrings]:
        """The engine parameters of each sample, and the stop strings to cut at afterwards.
        Blocking (it encodes the stop strings): call it off the event loop."""
        max_tokens, strings, ids = self.check(req, max_model_len)
        sp = req.sampling_params
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
                    ignore_eos=sp.stop is not None,
                )
            )
        return out, StopStrings(tuple(strings))

    async def sample(self, sampler: Sampler, req: AsampleRequest, max_model_len: int) -> bytes:
        """Draw `req.num_samples` completions together; the encoded `SampleResponse`."""
        params, stops = await anyio.to_thread.run_sync(self.params, req, max_model_len)
        prompt = req.prompt_tokens
        scoring = self.scoring(req)
        results: list[GenerateResult | None] = [None] * len(params)
        scores: list[PromptScores] = []

        async def one(i: int) -> None:
            async def generate(name: str) -> GenerateResult:
                return await self._engine.generate(name, prompt, params[i])

            results[i] = await self._with_policy(sampler, generate)

        async def score() -> None:
            assert scoring is not None
            first, k = scoring

            async def run(name: str) -> PromptScores:
                model = self._engine.model(name)
                return await anyio.to_thread.run_sync(score_prompt, model, prompt, first, k)

            got = await self._with_policy(sampler, run)
            got.include_logprobs = req.prompt_logprobs
            scores.append(got)

        async with anyio.create_task_group() as tg:
            for i in range(len(params)):
                tg.start_soon(one, i)
            if scoring is not None:
                tg.start_soon(score)
        done: list[GenerateResult] = []
        for r in results:
            assert r is not None
            if r.finish_reason == "abort":
                raise TinkerRequestError("sampling was aborted")
            done.append(r)

        def encode() -> bytes:
            samples = []
            for r in done:
                tokens, logprobs = r.ids, r.logprobs
                stopped = r.finish_reason == "stop"
                cut = stops.cut(self._tokenizer, tokens)
                if cut is not None:
                    tokens, logprobs, stopped = tokens[:cut], logprobs[:cut], True
                samples.append((tokens, logprobs, stopped))
            return encode_samples(samples, scores[0] if scores else None)

        return await anyio.to_thread.run_sync(encode)

    @staticmethod
    def scoring(req: AsampleRequest) -> tuple[int, int] | None:
        """What prompt scoring `req` asks for (see `AsampleRequest.prompt_scoring`).

        Raises:
            TinkerRequestError: a bound is out of range.
        """
        try:
            return req.prompt_scoring(MAX_TOPK)
        except ValueError as exc:
            raise TinkerRequestError(str(exc)) from None


_HELD_TOKENS = 8
"""Held-back tokens decoded again while a character is incomplete: one character is at most
four byte-level tokens; a longer run of bytes that never form one is not text to match."""


@dataclass(frozen=True)
class StopStrings:
    """Where a completion ends at its first stop string.

    A completion is cut after the first token whose text completes a stop string. The text
    is decoded one token at a time (`tokenizers`' `DecodeStream`) and searched in a window of
    the last `MAX_STOP_CHARS` characters plus the new piece, with one regular expression for
    all strings: linear in the completion's length, whatever the number of strings, where
    decoding every prefix again was quadratic (2.6 s for one 4,000-token sample).
    """

    strings: tuple[str, ...]

    @functools.cached_property
    def _pattern(self) -> re.Pattern[str]:
        return re.compile("|".join(re.escape(s) for s in self.strings))

    def cut(self, tokenizer: Any, tokens: list[int]) -> int | None:
        """How many tokens to keep so the completion ends at its first stop string; None
        when none occurs. Blocking: call it off the event loop."""
        if not self.strings:
            return None
        from tokenizers.decoders import DecodeStream

        backend = tokenizer.backend_tokenizer
        stream = DecodeStream(skip_special_tokens=False)
        keep = max(len(s) for s in self.strings) - 1
        tail = ""
        held: list[int] = []  # tokens the stream holds back: they end inside a character
        for n, token in enumerate(tokens, 1):
            piece = stream.step(backend, token)
            if not piece:
                # The stream waits for the character's last bytes, but the characters this
                # token completed before them count now, as in the prefix's own decoding.
                held.append(token)
                partial = backend.decode(held[-_HELD_TOKENS:], skip_special_tokens=False)
                if self._pattern.search(tail + partial.rstrip("\ufffd")):
                    return n
                continue
            held.clear()
            text = tail + piece
            if self._pattern.search(text):
                return n
            tail = text[max(len(text) - keep, 0) :]
        return None


def score_prompt(model: torch.nn.Module, prompt: list[int], first: int, k: int) -> PromptScores:
    """The logprob of each prompt token from position `first` on given the tokens before it
    (temperature 1, the trainer's convention), and the top `k` tokens there.

    One forward pass of the decoder; the head runs in chunks of `_HEAD_ROWS` positions, so a
    long prompt never holds its full [n, vocab] logits.
    """
    n = len(prompt)
    lps = np.full(n, np.nan, dtype=np.float32)
    ids = np.zeros((n, k), dtype=np.int32) if k else None
    tops = np.full((n, k), MASK_LOGPROB, dtype=np.float32) if k else None
    device = next(model.parameters()).device
    tokens = torch.tensor([prompt], dtype=torch.long, device=device)
    with torch.inference_mode():
        hidden = model.get_decoder()(input_ids=tokens).last_hidden_state[0]
        head = model.get_output_embeddings()
        # Row r of the head predicts prompt[r + 1].
        for s in range(max(first, 1) - 1, n - 1, _HEAD_ROWS):
            e = min(s + _HEAD_ROWS, n - 1)
            logp = torch.log_softmax(head(hidden[s:e]).float(), dim=-1)
            target = tokens[0, s + 1 : e + 1]
            lps[s + 1 : e + 1] = logp.gather(1, target[:, None])[:, 0].cpu().numpy()
            if ids is not None and tops is not None:
                values, index = logp.topk(k, dim=-1)
                ids[s + 1 : e + 1] = index.cpu().numpy()
                tops[s + 1 : e + 1] = values.cpu().numpy()
    return PromptScores(lps, ids, tops)
