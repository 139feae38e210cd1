"""Stop strings: bounded, compiled off the event loop, matched incrementally on a tail window.

Engines stop by token id, so a stop string that is one token is handed to the engine, which
then stops as soon as it samples that token. Every stop string, that one too, is also matched
by the gateway on the sampled text, as OpenAI and Anthropic define stop strings (`"\n"`
stops inside a token `".\n\n"`, which the engine's id check misses): a `StopMatcher` is fed ids
one at a time (the way a streamed completion arrives) and decodes only a tail window of the
last few ids, and only when the newest id's text holds the last character of some stop
string, so matching costs O(window) per candidate id and never O(completion). The completion
is cut after the id that completed the match; its logprobs with it.

Bounds come first: a request may name at most `MAX_STOP_STRINGS` strings of at most
`MAX_STOP_CHARS` characters each, checked before anything is encoded (a million one-token
strings once froze every session for 13.7 s while the gateway encoded them on the loop).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .._exceptions import GatewayRequestError

__all__ = ["MAX_STOP_CHARS", "MAX_STOP_STRINGS", "StopMatcher", "StopStrings", "check_stops"]

MAX_STOP_STRINGS = 16
"""Stop strings per request (OpenAI allows 4; agents send a handful at most)."""
MAX_STOP_CHARS = 128
"""Characters per stop string; also bounds the tail window, hence the cost per sampled id."""


def check_stops(stops: Sequence[Any], param: str) -> list[str]:
    """The stop strings, or a 400 naming the first that breaks a bound.

    Raises:
        GatewayRequestError: too many strings, an empty or overlong one, or not a string.
    """
    if len(stops) > MAX_STOP_STRINGS:
        raise GatewayRequestError(
            f"{len(stops)} stop strings; the gateway takes at most {MAX_STOP_STRINGS}",
            param=param,
        )
    for i, text in enumerate(stops):
        if not isinstance(text, str) or not text:
            raise GatewayRequestError(f"stop string {i} is empty or not a string", param=param)
        if len(text) > MAX_STOP_CHARS:
            raise GatewayRequestError(
                f"stop string {i} has {len(text)} characters; at most {MAX_STOP_CHARS}",
                param=param,
            )
    return list(stops)


@dataclass(frozen=True)
class StopStrings:
    """A request's stop strings, split by how they are enforced.

    Attributes:
        by_id: stop strings that are exactly one token, by that token's id: the engine stops
            on them.
        matched: every stop string, matched by a `StopMatcher` on the sampled text.
    """

    by_id: dict[int, str]
    matched: tuple[str, ...]

    @classmethod
    def compile(cls, tokenizer: Any, stops: Sequence[str]) -> StopStrings:
        """Encode each (bounded) string once. Blocking: call it in a worker thread."""
        by_id: dict[int, str] = {}
        for text in stops:
            ids = tokenizer.encode(text, add_special_tokens=False)
            if len(ids) == 1:
                by_id[ids[0]] = text
        return cls(by_id, tuple(stops))

    def matcher(self, tokenizer: Any) -> StopMatcher | None:
        return StopMatcher(tokenizer, self.matched) if self.matched else None


class StopMatcher:
    """Finds where the first matched stop string completes, feeding ids one at a time.

    The window holds as many ids as the longest stop string has UTF-8 bytes, plus 2: a
    byte-level id covers at least one byte (a rare character is up to four ids, so counting
    characters would be too few), and the slack covers a character split across the window's
    first ids. A stop string that completes at the newest id lies inside the window's text.
    """

    def __init__(self, tokenizer: Any, stops: Sequence[str]):
        self._tokenizer = tokenizer
        self._stops = tuple(stops)
        self._last_chars = frozenset(s[-1] for s in stops)
        self._window = max(len(s.encode()) for s in stops) + 2
        self._tail: list[int] = []
        self.fed = 0

    def feed(self, token_id: int) -> str | None:
        """Add one sampled id; the stop string it completes, if any."""
        self.fed += 1
        self._tail.append(token_id)
        if len(self._tail) > self._window:
            del self._tail[0]
        piece = self._tokenizer.decode([token_id], skip_special_tokens=False)
        if not self._last_chars.intersection(piece) and "\ufffd" not in piece:
            return None
        text = self._tokenizer.decode(self._tail, skip_special_tokens=False)
        for stop in self._stops:
            if stop in text:
                return stop
        return None

    def first_match(self, ids: Sequence[int]) -> tuple[int, str] | None:
        """(ids to keep, the stop string) for a whole completion. Blocking: run in a thread."""
        for token_id in ids:
            found = self.feed(token_id)
            if found is not None:
                return self.fed, found
        return None
