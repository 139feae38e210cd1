"""Bounded memos for the per-turn token work that is a pure function of its inputs.

Why: an episode's incremental step renders a template over a bounded synthetic context plus
the newest assistant turn and messages, and the parser decodes and parses the sampled ids. Both
depend on nothing else, and in RL the same inputs come back constantly: a group plays one task
many times, a policy converges on a few replies, an env has a few observations. Rendering
(jinja) and parsing were most of a turn's CPU (bench/rollout_bench.py), so the renderer and the
parser remember recent results, keyed by exactly what the work reads.

`functools.lru_cache` does not fit: the work needs objects (a template, its probe profile)
that are not part of the key and not hashable. A key is built only from plain data
(`plain_key`): values of the exact builtin types whose `repr` states them completely.
Anything else is not memoized, never guessed at.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

__all__ = ["Memo", "MemoStatistics", "copy_plain", "is_plain", "plain_key"]

V = TypeVar("V")

_SCALARS = (str, int, float, bool, type(None))


@dataclass(frozen=True)
class MemoStatistics:
    """How a memo has served so far."""

    hits: int
    misses: int
    size: int
    """Entries held now (at most the memo's bound)."""


class Memo(Generic[V]):
    """A thread-safe mapping that keeps its `maxsize` most recently used entries."""

    def __init__(self, maxsize: int):
        if maxsize < 1:
            raise ValueError(f"a memo keeps at least one entry, not {maxsize}")
        self._maxsize = maxsize
        self._entries: OrderedDict[Hashable, V] = OrderedDict()
        self._lock = threading.Lock()
        self._hits = 0
        self._misses = 0

    def get(self, key: Hashable) -> V | None:
        with self._lock:
            value = self._entries.get(key)
            if value is None:
                self._misses += 1
                return None
            self._entries.move_to_end(key)
            self._hits += 1
            return value

    def put(self, key: Hashable, value: V) -> None:
        with self._lock:
            self._entries[key] = value
            self._entries.move_to_end(key)
            if len(self._entries) > self._maxsize:
                self._entries.popitem(last=False)

    def statistics(self) -> MemoStatistics:
        with self._lock:
            return MemoStatistics(self._hits, self._misses, len(self._entries))


def plain_key(value: Any) -> str | None:
    """A key that equals another's only when both values are equal plain data, else None.

    Plain: str, int, float, bool, None, and lists, tuples and str-keyed dicts of plain values,
    of exactly those types (a subclass may render differently while looking the same). `repr`
    then tells 1 from 1.0 from True and a list from a tuple, and keeps dict order, all of which
    a template can see.
    """
    return repr(value) if is_plain(value) else None


def is_plain(value: Any) -> bool:
    """Whether `value` is plain data, as `plain_key` defines it."""
    kind = type(value)
    if kind in _SCALARS:
        return True
    if kind is list or kind is tuple:
        return all(is_plain(v) for v in value)
    if kind is dict:
        return all(type(k) is str and is_plain(v) for k, v in value.items())
    return False


def copy_plain(value: Any) -> Any:
    """A deep copy of plain data (`plain_key`'s kind), so that a memoized value handed out
    twice never shares a mutable part between callers."""
    kind = type(value)
    if kind is dict:
        return {k: copy_plain(v) for k, v in value.items()}
    if kind is list:
        return [copy_plain(v) for v in value]
    if kind is tuple:
        return tuple(copy_plain(v) for v in value)
    return value
