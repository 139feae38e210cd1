"""Futures and the per-model work queue.

Every submit answers `{"request_id"}` at once; `retrieve_future` long-polls the result.
Work for one model runs strictly in `seq_id` order: the SDK posts the chunks 2..n of a
forward_backward before chunk 1, so a request that arrives early is queued, never blocked
on. One worker drains all queues, taking the models with a runnable op in turn
(round-robin), so a busy tenant cannot starve another's futures. A request refused at
submit still consumes its `seq_id` (the SDK moves on to the next one). A `seq_id` that has
not arrived after `gap_seconds` while later ones wait fails those later ones.

Futures live in memory, the newest `KEEP_FUTURES` of them holding at most `KEEP_BYTES` of
protobuf results (each is at most `_proto.MAX_RESULT_BYTES`); the tenants' op logs
(`_oplog.py`) bring back those of ordered ops after a restart, with their request ids.
"""

from __future__ import annotations

import hashlib
import logging
import time
import uuid
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import anyio

from .._quote import quoted
from ._errors import TinkerRequestError, error_body

__all__ = [
    "KEEP_BYTES",
    "KEEP_FUTURES",
    "MAX_AHEAD",
    "Futures",
    "WorkQueue",
    "body_digest",
    "failure_message",
]

log = logging.getLogger("plies.server.tinker")

KEEP_FUTURES = 10_000
"""Settled futures kept for retrieval; the oldest are forgotten first."""
KEEP_BYTES = 256 << 20
"""Protobuf result bytes kept for retrieval; past it the oldest settled are forgotten."""
MAX_AHEAD = 1024
"""How far past the highest `seq_id` a model has seen (or the next one to run) a new one may
be. The SDK numbers its ops one by one, so a legitimate op is never far ahead; a stray one
far ahead would hold the queue, and once its gap timed out, move it past every real op."""

Result = bytes | dict[str, Any]
"""Protobuf bytes (forward_backward, sample) or a JSON object (everything else)."""


@dataclass(eq=False)
class _Future:
    done: anyio.Event = field(default_factory=anyio.Event)
    value: Result | None = None


class Futures:
    """Request id -> result, settled once."""

    def __init__(self, keep: int = KEEP_FUTURES, keep_bytes: int = KEEP_BYTES):
        self._keep = keep
        self._keep_bytes = keep_bytes
        self._bytes = 0
        self._futures: OrderedDict[str, _Future] = OrderedDict()

    def create(self, rid: str | None = None, prefix: str = "req") -> str:
        """A pending future; `rid` names one brought back from an op log (kept if it exists)."""
        rid = rid or f"{prefix}-{uuid.uuid4().hex}"
        self._futures.setdefault(rid, _Future())
        return rid

    def settle(self, rid: str, value: Result) -> None:
        fut = self._futures.get(rid)
        if fut is None or fut.done.is_set():
            return
        fut.value = value
        fut.done.set()
        self._bytes += _size(value)
        while len(self._futures) > self._keep or self._bytes > self._keep_bytes:
            oldest, old = next(iter(self._futures.items()))
            if not old.done.is_set():
                break
            del self._futures[oldest]
            self._bytes -= _size(old.value)

    def fail(self, rid: str, message: str) -> None:
        self.settle(rid, error_body(message))

    async def wait(self, rid: str, timeout: float) -> Result | None:
        """The result, or None while still pending after `timeout` seconds.

        Raises:
            TinkerRequestError: no such request id (404).
        """
        fut = self._futures.get(rid)
        if fut is None:
            raise TinkerRequestError(f"unknown request_id {quoted(rid)}", status=404)
        with anyio.move_on_after(timeout):
            await fut.done.wait()
        return fut.value


def _size(value: Result | None) -> int:
    return len(value) if isinstance(value, bytes) else 0


@dataclass(eq=False)
class _Op:
    rid: str
    digest: str
    fn: Callable[[], Result] | None  # None: refused at submit, only its seq_id is consumed


@dataclass(eq=False)
class _Queue:
    next_seq: int
    ops: dict[int, _Op] = field(default_factory=dict)
    seen: OrderedDict[int, tuple[str, str]] = field(default_factory=OrderedDict)
    top: int = -1  # the highest seq_id submitted
    gap_since: float | None = None


def failure_message(exc: Exception) -> str:
    """What a failed op's future says: a refusal's own message, else the exception."""
    return str(exc) if isinstance(exc, TinkerRequestError) else f"{type(exc).__name__}: {exc}"


def body_digest(body: bytes) -> str:
    return hashlib.sha256(body).hexdigest()


class WorkQueue:
    """Per-model queues in `seq_id` order, drained by `run` one op at a time."""

    def __init__(self, futures: Futures, gap_seconds: float):
        self._futures = futures
        self._gap = gap_seconds
        self._queues: dict[str, _Queue] = {}
        self._turns: deque[str] = deque()
        self._wake = anyio.Event()

    def open(self, model_id: str, first_seq: int = 0) -> None:
        self._queues[model_id] = _Queue(first_seq)
        self._turns.append(model_id)

    def close(self, model_id: str) -> None:
        """Forget a model's queue; ops still waiting in it fail."""
        queue = self._queues.pop(model_id, None)
        if queue is None:
            return
        self._turns.remove(model_id)
        for op in queue.ops.values():
            self._futures.fail(op.rid, f"model {model_id} was closed before this ran")

    def __contains__(self, model_id: str) -> bool:
        return model_id in self._queues

    def known(self, model_id: str, seq_id: int) -> bool:
        """Whether `seq_id` of `model_id` was submitted already (a repeat is not new work)."""
        queue = self._queues.get(model_id)
        return queue is not None and seq_id in queue.seen

    def remember(self, model_id: str, seq_id: int, digest: str, rid: str) -> None:
        """Record an op applied before a restart, so a repeat of it gets its request id."""
        queue = self._queues[model_id]
        queue.seen[seq_id] = (digest, rid)
        queue.top = max(queue.top, seq_id)

    def submit(
        self,
        model_id: str,
        seq_id: int,
        digest: str,
        fn: Callable[[], Result] | None,
        rid: str | None = None,
    ) -> str:
        """Queue `fn` as the op `seq_id` of `model_id`; its request id (`rid`, if given).

        A repeat of a request already submitted (same `seq_id`, same body) gets the original
        request id. `fn=None` consumes the `seq_id` without work (a request refused at submit).

        Raises:
            TinkerRequestError: the model has no queue (404), `seq_id` was already used for
                another request, is behind the next one, or is more than `MAX_AHEAD` past both
                the next one and the highest submitted (400).
        """
        queue = self._queues.get(model_id)
        if queue is None:
            raise TinkerRequestError(f"unknown model_id {quoted(model_id)}", status=404)
        seen = queue.seen.get(seq_id)
        if seen is not None:
            if seen[0] == digest:
                return seen[1]
            raise TinkerRequestError(
                f"seq_id {seq_id} of model {model_id} was already used for another request"
            )
        if seq_id < queue.next_seq:
            raise TinkerRequestError(
                f"seq_id {seq_id} of model {model_id} is behind the next one ({queue.next_seq})"
            )
        horizon = max(queue.next_seq - 1, queue.top)
        if seq_id > horizon + MAX_AHEAD:
            raise TinkerRequestError(
                f"seq_id {seq_id} of model {model_id} is more than {MAX_AHEAD} past the "
                f"highest one seen ({horizon}); op ids are numbered one by one"
            )
        queue.top = max(queue.top, seq_id)
        rid = self._futures.create(rid)
        queue.ops[seq_id] = _Op(rid, digest, fn)
        queue.seen[seq_id] = (digest, rid)
        while len(queue.seen) > 4096:
            queue.seen.popitem(last=False)
        if fn is None:
            self._futures.fail(rid, "refused at submit")
        self._wake.set()
        return rid

    async def run(self, *, task_status=anyio.TASK_STATUS_IGNORED) -> None:
        """The worker: run each model's next op in a thread, models taking turns."""
        task_status.started()
        while True:
            self._check_gaps()
            picked = self._pick()
            if picked is None:
                self._wake = anyio.Event()
                with anyio.move_on_after(min(self._gap, 1.0)):
                    await self._wake.wait()
                continue
            model_id, op = picked
            if op.fn is None:
                continue
            try:
                value = await anyio.to_thread.run_sync(op.fn)
            except Exception as exc:
                if not isinstance(exc, TinkerRequestError):
                    log.exception("%s: op failed", model_id)
                self._futures.fail(op.rid, failure_message(exc))
            else:
                self._futures.settle(op.rid, value)

    def _pick(self) -> tuple[str, _Op] | None:
        for _ in range(len(self._turns)):
            model_id = self._turns[0]
            self._turns.rotate(-1)
            queue = self._queues[model_id]
            op = queue.ops.pop(queue.next_seq, None)
            if op is not None:
                queue.next_seq += 1
                queue.gap_since = None
                return model_id, op
        return None

    def _check_gaps(self) -> None:
        now = time.monotonic()
        for model_id, queue in self._queues.items():
            if not queue.ops or queue.next_seq in queue.ops:  # no gap, only waiting its turn
                queue.gap_since = None
                continue
            if queue.gap_since is None:
                queue.gap_since = now
            elif now - queue.gap_since > self._gap:
                missing = queue.next_seq
                log.warning("%s: seq_id %d never arrived; failing later ops", model_id, missing)
                for seq in sorted(queue.ops):
                    self._futures.fail(
                        queue.ops.pop(seq).rid,
                        f"seq_id {missing} of model {model_id} never arrived within "
                        f"{self._gap:g} s, so seq_id {seq} cannot run in order",
                    )
                    queue.next_seq = seq + 1
                queue.gap_since = None
