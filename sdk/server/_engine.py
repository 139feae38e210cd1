"""The batching engine: concurrent requests decoded together in shared forward passes.

How a step works (one scheduler iteration, run in a worker thread so the event loop and
the HTTP server stay responsive):

1. Requests that arrived since the last step are admitted, grouped by loaded policy, up to
   `max_batch_size` rows per policy. Newcomers of one policy are prefilled together (left
   padding, attention mask, position ids from the mask) and their first token is sampled.
2. They are merged into that policy's running batch: the shorter key/value cache is padded on
   the left, so old and new rows share every later forward pass. This is continuous
   batching: nobody waits for a running batch to drain.
3. Every running batch takes one decode step: one new token per row, through the KV cache,
   so the work per token does not grow with the history beyond attention itself.
4. Rows that sampled a stop id, hit `max_tokens` or were cancelled leave the batch; the cache
   keeps only the remaining rows, and left columns that only padding uses are dropped.

A batch is tied to one loaded model object, not a name: reloading a name in place starts a
new batch while the old one finishes on the weights it started with.

Batch-invariant mode (`ServerConfig.batch_invariant`, `plies serve --batch-invariant`): every
request is a batch of its own, prefilled and decoded alone, without padding. The logits a
request gets then do not depend on which other requests were in flight: a float32 matmul
rounds a row differently with the number of rows it multiplies (with MKL, a row multiplied
alone never has the bits it gets in a product of 2 to 11 rows) and attention sums over left
padding in another order, so in a shared batch the same prompt and seed give the same
tokens but logprobs that differ in the last bits. Alone, a seeded request is reproduced bit
for bit (`plies replay`). The cost is the batching itself: `bench/sampler_bench.py` prints
both modes side by side (a half to a quarter of the tokens/s at concurrency 8 to 32 on the
tiny model, where batching pays most).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import anyio
import torch

from .._exceptions import ConfigError, PliesError
from ..trajectory import FinishReason, PolicyRef
from ._config import ServerConfig
from ._policies import PolicyStore
from ._quote import quoted
from ._sampling import RowParams, sample_rows

__all__ = ["Engine", "EngineOverloaded", "EngineStats", "GenerateParams", "GenerateResult"]

log = logging.getLogger("plies.server")


class EngineOverloaded(PliesError):
    """The queue is full; the request was not admitted (HTTP 503)."""


class UnknownPolicy(ConfigError):
    """The request named a policy that is not loaded (HTTP 404)."""


@dataclass(frozen=True)
class GenerateParams:
    """One request's sampling parameters, validated by the HTTP layer."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False


@dataclass(frozen=True)
class GenerateResult:
    ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    stop_reason: int | None
    policy: PolicyRef


@dataclass(frozen=True)
class EngineStats:
    """Counters since start; `decode_rows / decode_passes` is the mean batch size."""

    prefill_passes: int
    decode_passes: int
    decode_rows: int
    max_rows: int
    requests_finished: int
    tokens_generated: int
    waiting: int
    running: int


@dataclass(eq=False)
class _Policy:
    name: str
    ref: PolicyRef
    model: torch.nn.Module
    eos_ids: frozenset[int]


@dataclass(eq=False)
class _Request:
    policy: _Policy
    prompt: list[int]
    params: GenerateParams
    row: RowParams
    stops: frozenset[int]
    done: anyio.Event = field(default_factory=anyio.Event)
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish: FinishReason | None = None
    stop_reason: int | None = None
    error: Exception | None = None
    cancelled: bool = False
    progress: anyio.Event | None = None
    """Set after each step that may have sampled for it; only a streamed request has one."""

    def take(self, tok: int, lp: float) -> None:
        self.ids.append(tok)
        self.logprobs.append(lp)
        if tok in self.stops:
            self.finish = "stop"
            self.stop_reason = tok if tok in self.params.stop_token_ids else None
        elif len(self.ids) >= self.params.max_tokens:
            self.finish = "length"


@dataclass(eq=False)
class _Batch:
    policy: _Policy
    requests: list[_Request]
    cache: object  # transformers DynamicCache
    mask: torch.Tensor  # (B, T) 1 on real tokens
    next_pos: torch.Tensor  # (B,) position of the next input token
    last: torch.Tensor  # (B,) last sampled token, the next input


def _eos_ids(model: torch.nn.Module) -> frozenset[int]:
    ids: set[int] = set()
    for cfg in (model.config, getattr(model, "generation_config", None)):
        eos = getattr(cfg, "eos_token_id", None)
        if isinstance(eos, int):
            ids.add(eos)
        elif eos:
            ids.update(int(e) for e in eos)
    return frozenset(ids)


class Engine:
    """Loaded policies and the scheduler that batches their requests.

    Run `run()` in a task group for the server's lifetime; `generate()` from request handlers.
    """

    def __init__(self, config: ServerConfig, store: PolicyStore):
        self.config = config
        self.store = store
        want = config.device
        if want == "auto":
            want = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(want)
        self._policies: dict[str, _Policy] = {}
        self._waiting: deque[_Request] = deque()
        self._batches: dict[int, _Batch] = {}
        self._wake = anyio.Event()
        self._inflight = 0
        self._generator = torch.Generator(device="cpu")
        self._generator.seed()
        self._counts = dict.fromkeys(
            (
                "prefill_passes",
                "decode_passes",
                "decode_rows",
                "max_rows",
                "requests_finished",
                "tokens_generated",
            ),
            0,
        )

    # -- policies -------------------------------------------------------------------------

    async def load(self, name: str, path: Path, *, replace: bool = False) -> PolicyRef:
        """Load a published policy directory and serve it as `name`.

        Raises:
            ConfigError: `path` is not a published policy, or `name` is taken and not `replace`.
        """
        ref = PolicyStore.read_ref(path)
        if name in self._policies and not replace:
            raise ConfigError(f"policy {quoted(name)} is already loaded; unload it first")
        model = await anyio.to_thread.run_sync(self._load_model, Path(path))
        if name in self._policies and not replace:
            raise ConfigError(f"policy {quoted(name)} was loaded concurrently")
        self._policies[name] = _Policy(name, ref, model, _eos_ids(model))
        log.info("serving %s as %r", ref.uri, name)
        return ref

    def _load_model(self, path: Path) -> torch.nn.Module:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        return model.to(self.device).eval()

    def unload(self, name: str) -> PolicyRef:
        """Stop serving `name`; requests already running on it finish on its weights.

        Raises:
            UnknownPolicy: nothing is served under `name`.
        """
        try:
            pol = self._policies.pop(name)
        except KeyError:
            raise UnknownPolicy(f"no policy named {quoted(name)} is loaded") from None
        log.info("unloaded %r", name)
        return pol.ref

    def model(self, name: str) -> torch.nn.Module:
        """The module served as `name`, for read-only scoring outside the scheduler (the
        Tinker API's prompt logprobs); it runs in inference mode, so it shares no state.

        Raises:
            UnknownPolicy: nothing is served under `name`.
        """
        pol = self._policies.get(name)
        if pol is None:
            raise UnknownPolicy(f"no policy named {quoted(name)} is loaded")
        return pol.model

    def served(self) -> dict[str, PolicyRef]:
        """Served name -> PolicyRef, in load order."""
        return {name: p.ref for name, p in self._policies.items()}

    def statistics(self) -> EngineStats:
        running = sum(len(b.requests) for b in self._batches.values())
        return EngineStats(**self._counts, waiting=len(self._waiting), running=running)

    # -- requests -------------------------------------------------------------------------

    def check(self, name: str, prompt: list[int], params: GenerateParams) -> _Policy:
        """What `generate` refuses, refused now (a stream checks before it opens); the
        policy served as `name`.

        Raises:
            As `generate`.
        """
        pol = self._policies.get(name)
        if pol is None:
            raise UnknownPolicy(
                f"no policy named {quoted(name)} is loaded; loaded: {sorted(self._policies)}"
            )
        vocab = pol.model.config.vocab_size
        if not prompt:
            raise ConfigError("prompt is empty")
        bad = next((t for t in prompt if not 0 <= t < vocab), None)
        if bad is not None:
            raise ConfigError(f"prompt token id {bad} is outside the vocabulary [0, {vocab})")
        bad = next((t for t in params.stop_token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ConfigError(f"stop token id {bad} is outside the vocabulary [0, {vocab})")
        total = len(prompt) + params.max_tokens
        if total > self.config.max_model_len:
            raise ConfigError(
                f"prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) = {total} "
                f"exceeds max_model_len {self.config.max_model_len}"
            )
        if self._inflight >= self.config.max_queued:
            raise EngineOverloaded(f"{self._inflight} requests in flight (max_queued)")
        return pol

    async def generate(
        self,
        name: str,
        prompt: list[int],
        params: GenerateParams,
        *,
        on_tokens: Callable[[list[int], list[float]], Awaitable[None]] | None = None,
    ) -> GenerateResult:
        """Sample a completion of `prompt` from the policy served as `name`.

        `on_tokens`, when given, is told each run of new ids and their logprobs once a step
        has sampled them; a slow listener does not hold the batch back, it is told more at
        once next time.

        Raises:
            UnknownPolicy: `name` is not loaded.
            ConfigError: the prompt is empty or too long, or it or a stop id is outside the
                vocabulary.
            EngineOverloaded: `max_queued` requests are already in flight.
        """
        pol = self.check(name, prompt, params)
        gen = None
        if params.seed is not None:
            gen = torch.Generator(device="cpu")
            gen.manual_seed(params.seed)
        stops = params.stop_token_ids | (frozenset() if params.ignore_eos else pol.eos_ids)
        req = _Request(
            pol,
            list(prompt),
            params,
            RowParams(params.temperature, params.top_k, params.top_p, gen),
            stops,
        )
        self._inflight += 1
        self._waiting.append(req)
        self._wake.set()
        try:
            if on_tokens is None:
                await req.done.wait()
            else:
                await _follow(req, on_tokens)
        finally:
            if not req.done.is_set():
                req.cancelled = True  # the scheduler drops the row at its next step
        if req.error is not None:
            raise req.error
        assert req.finish is not None
        return GenerateResult(req.ids, req.logprobs, req.finish, req.stop_reason, pol.ref)

    # -- scheduler ------------------------------------------------------------------------

    async def run(self, *, task_status=anyio.TASK_STATUS_IGNORED) -> None:
        """The scheduler loop: admit, step in a worker thread, wake finished requests."""
        task_status.started()
        while True:
            if not self._waiting and not self._batches:
                self._wake = anyio.Event()
                await self._wake.wait()
                continue
            admitted = self._admit()
            finished = await anyio.to_thread.run_sync(self._step, admitted)
            for req in finished:
                self._inflight -= 1
                req.done.set()
                if req.progress is not None:
                    req.progress.set()
            for batch in self._batches.values():
                for req in batch.requests:
                    if req.progress is not None:
                        req.progress.set()

    def _admit(self) -> list[_Request]:
        rows: dict[int, int] = {}  # running rows per loaded policy
        for b in self._batches.values():
            rows[id(b.policy)] = rows.get(id(b.policy), 0) + len(b.requests)
        admitted: list[_Request] = []
        keep: deque[_Request] = deque()
        for req in self._waiting:
            key = id(req.policy)
            if req.cancelled or rows.get(key, 0) < self.config.max_batch_size:
                rows[key] = rows.get(key, 0) + (not req.cancelled)
                admitted.append(req)
            else:
                keep.append(req)
        self._waiting = keep
        return admitted

    def _step(self, admitted: list[_Request]) -> list[_Request]:
        finished: list[_Request] = []
        with torch.inference_mode():
            groups: dict[int, list[_Request]] = {}
            for req in admitted:
                if req.cancelled:
                    req.finish = "abort"
                    finished.append(req)
                else:  # batch-invariant: every request is a batch of its own, never merged
                    key = id(req) if self.config.batch_invariant else id(req.policy)
                    groups.setdefault(key, []).append(req)
            for key, reqs in groups.items():
                try:
                    batch = self._prefill(reqs)
                    finished += self._retire(batch)
                    if batch.requests:
                        old = self._batches.get(key)
                        self._batches[key] = _merge(old, batch) if old else batch
                except Exception as e:  # one policy's failure must not stall the others
                    log.exception("prefill failed")
                    finished += _fail(reqs, e)
            for key, batch in list(self._batches.items()):
                try:
                    self._decode(batch)
                    finished += self._retire(batch)
                except Exception as e:
                    log.exception("decode failed")
                    finished += _fail(batch.requests, e)
                    batch.requests = []
                if not batch.requests:
                    del self._batches[key]
        self._counts["requests_finished"] += len(finished)
        return finished

    def _forward(self, model, **kw) -> torch.Tensor:
        out = model(use_cache=True, logits_to_keep=1, **kw)
        return out.logits[:, -1, :]

    def _sample(self, batch_requests: list[_Request], logits: torch.Tensor) -> list[int]:
        ids, lps = sample_rows(logits, [r.row for r in batch_requests], self._generator)
        for req, tok, lp in zip(batch_requests, ids, lps, strict=True):
            req.take(tok, lp)
        self._counts["tokens_generated"] += len(ids)
        return ids

    def _prefill(self, reqs: list[_Request]) -> _Batch:
        from transformers import DynamicCache

        pol = reqs[0].policy
        width = max(len(r.prompt) for r in reqs)
        ids = torch.zeros((len(reqs), width), dtype=torch.long)
        mask = torch.zeros((len(reqs), width), dtype=torch.long)
        for i, r in enumerate(reqs):
            ids[i, width - len(r.prompt) :] = torch.tensor(r.prompt)
            mask[i, width - len(r.prompt) :] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache()
        logits = self._forward(
            pol.model, input_ids=ids, attention_mask=mask, position_ids=positions,
            past_key_values=cache,
        )  # fmt: skip
        self._counts["prefill_passes"] += 1
        toks = self._sample(reqs, logits)
        return _Batch(
            pol,
            list(reqs),
            cache,
            mask,
            mask.sum(-1),
            torch.tensor(toks, dtype=torch.long, device=self.device),
        )

    def _decode(self, batch: _Batch) -> None:
        batch.mask = torch.cat([batch.mask, batch.mask.new_ones((batch.mask.shape[0], 1))], 1)
        logits = self._forward(
            batch.policy.model,
            input_ids=batch.last[:, None],
            attention_mask=batch.mask,
            position_ids=batch.next_pos[:, None],
            past_key_values=batch.cache,
        )
        rows = len(batch.requests)
        self._counts["decode_passes"] += 1
        self._counts["decode_rows"] += rows
        self._counts["max_rows"] = max(self._counts["max_rows"], rows)
        toks = self._sample(batch.requests, logits)
        batch.next_pos = batch.next_pos + 1
        batch.last = torch.tensor(toks, dtype=torch.long, device=self.device)

    def _retire(self, batch: _Batch) -> list[_Request]:
        """Remove finished and cancelled rows from `batch`; return them."""
        done: list[_Request] = []
        keep: list[int] = []
        for i, req in enumerate(batch.requests):
            if req.cancelled and req.finish is None:
                req.finish = "abort"
            if req.finish is None:
                keep.append(i)
            else:
                done.append(req)
        if not done:
            return done
        batch.requests = [batch.requests[i] for i in keep]
        if not keep:
            return done
        index = torch.tensor(keep, dtype=torch.long, device=self.device)
        batch.mask = batch.mask[index]
        batch.next_pos = batch.next_pos[index]
        batch.last = batch.last[index]
        first = int(batch.mask.any(0).nonzero()[0])  # columns before it are padding for all
        batch.mask = batch.mask[:, first:]
        for layer in batch.cache.layers:
            layer.keys = layer.keys[index, :, first:]
            layer.values = layer.values[index, :, first:]
        return done


async def _follow(
    req: _Request, on_tokens: Callable[[list[int], list[float]], Awaitable[None]]
) -> None:
    """Tell `on_tokens` what `req` samples, step by step, until it is done."""
    told = 0
    while True:
        req.progress = anyio.Event()
        done = req.done.is_set()
        # The worker appends an id, then its logprob: count only the pairs that are whole.
        n = min(len(req.ids), len(req.logprobs))
        if n > told:
            await on_tokens(req.ids[told:n], req.logprobs[told:n])
            told = n
        elif done:
            return
        else:
            await req.progress.wait()


def _merge(a: _Batch, b: _Batch) -> _Batch:
    """One batch holding the rows of both, the shorter cache left-padded to the longer."""
    from transformers import DynamicCache

    width = max(a.mask.shape[1], b.mask.shape[1])

    def pad(x: torch.Tensor, dim: int) -> torch.Tensor:
        missing = width - x.shape[dim]
        if not missing:
            return x
        shape = list(x.shape)
        shape[dim] = missing
        return torch.cat([x.new_zeros(shape), x], dim)

    layers = [
        (
            torch.cat([pad(la.keys, 2), pad(lb.keys, 2)], 0),
            torch.cat([pad(la.values, 2), pad(lb.values, 2)], 0),
        )
        for la, lb in zip(a.cache.layers, b.cache.layers, strict=True)
    ]
    return _Batch(
        a.policy,
        a.requests + b.requests,
        DynamicCache(ddp_cache_data=layers),
        torch.cat([pad(a.mask, 1), pad(b.mask, 1)], 0),
        torch.cat([a.next_pos, b.next_pos]),
        torch.cat([a.last, b.last]),
    )


def _fail(reqs: list[_Request], error: Exception) -> list[_Request]:
    for req in reqs:
        req.error = PliesError(f"engine failed: {type(error).__name__}: {error}")
        req.finish = "abort"
    return reqs
