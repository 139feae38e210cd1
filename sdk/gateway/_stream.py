"""`ReplyStream`: a turn's visible text, sent to the agent while the turn is being sampled.

A turn is parsed whole by the template's response parser, and the parse of a prefix of the
ids is not always a prefix of the whole parse: a reasoning block reads as content until it
closes, a tool call begins as text, a stop string cuts what came before it. So a stream sends
only what the parse of the ids so far shows that later ids cannot change:

- the reasoning, whole, once its block has closed;
- the content up to its first stop string, but for its last `HOLD_CHARS` characters (a
  marker or a stop string may be forming there) and trailing whitespace (the parser strips
  it), and not while it holds the text of a token the tokenizer added (`<think>`,
  `<tool_call>`: a structure the parser has not closed yet);
- nothing of tool calls: each is sent whole once the turn is.

The ids so far are parsed each time they have grown by a quarter (at least `MIN_STEP` ids),
so a turn of n ids costs O(n) parsing in all, not O(n²).

What the agent received is what the session serves: `reconcile` makes the reply begin with
the streamed text, so the agent's next request, which carries the turn as it read it, still
extends the stored ids. Should the whole parse disagree with what was sent (the rules above
are meant to make that impossible; it is logged), the reply is what was sent.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, Literal

from ..tokens import ParsedResponse

__all__ = ["TEXT_FIELDS", "ReplyStream", "TextKind", "marker_pattern"]

log = logging.getLogger("plies.gateway")

TextKind = Literal["reasoning", "content"]

HOLD_CHARS = 16
"""Content characters held back from the end: longer than the tool-call and reasoning
markers templates write as plain text (`<tool_call>` is 11, `<function=` 10)."""
MIN_STEP = 8
"""Fewest new ids between two parses of a streamed turn."""

TEXT_FIELDS: dict[TextKind, str] = {"reasoning": "reasoning_content", "content": "content"}
"""Each kind of streamed text, by the reply field that holds it, in the order a turn has them."""


def marker_pattern(tokenizer: Any) -> re.Pattern[str] | None:
    """A pattern matching the text of any token the tokenizer added (special or not)."""
    added = sorted(tokenizer.get_added_vocab(), key=len, reverse=True)
    return re.compile("|".join(map(re.escape, added))) if added else None


class ReplyStream:
    """Streams one turn's stable text through `emit`; see the module docstring.

    Args:
        emit: sends a piece of reasoning or content to the agent (the dialect's records).
        sent: what the agent has been sent of each kind so far, kept by the sender (the
            dialect, which `emit` writes through).
    """

    def __init__(
        self, emit: Callable[[TextKind, str], Awaitable[None]], sent: Mapping[TextKind, str]
    ):
        self._emit = emit
        self.sent = sent
        self._parse: Callable[[list[int]], ParsedResponse] | None = None
        self._markers: re.Pattern[str] | None = None
        self._hold = HOLD_CHARS
        self._stops: tuple[str, ...] = ()
        self._ids: list[int] = []
        self._next_parse = MIN_STEP
        self._content_open = True

    def begin(
        self,
        parse: Callable[[list[int]], ParsedResponse],
        markers: re.Pattern[str] | None,
        stops: Sequence[str],
    ) -> None:
        """Set how the turn's ids are read, once its prompt is rendered."""
        self._parse = parse
        self._markers = markers
        self._stops = tuple(stops)
        self._hold = max([HOLD_CHARS, *map(len, stops)])

    async def feed(self, ids: Sequence[int]) -> None:
        """Take newly sampled ids; send what they make stable (a `TokenSink`)."""
        self._ids += ids
        if self._parse is None or len(self._ids) < self._next_parse:
            return
        self._next_parse = len(self._ids) + max(MIN_STEP, len(self._ids) // 4)
        parsed = self._parse(self._ids)
        if parsed.ill_formed:
            return
        if parsed.reasoning and not self.sent["reasoning"] and not self.sent["content"]:
            await self._emit("reasoning", parsed.reasoning)
        await self._stream_content(parsed.content)

    async def _stream_content(self, content: str) -> None:
        if not self._content_open or (self._markers and self._markers.search(content)):
            return
        for stop in self._stops:  # the turn ends at a stop string: nothing after it goes out
            content = content.split(stop, 1)[0]
        stable = content[: len(content) - self._hold].rstrip()
        sent = self.sent["content"]
        if not stable.startswith(sent):
            self._content_open = False  # a reading changed under us: wait for the whole turn
            return
        if len(stable) > len(sent):
            await self._emit("content", stable[len(sent) :])

    def reconcile(self, reply: dict[str, Any]) -> dict[str, Any]:
        """The reply, its text beginning with what was streamed of it."""
        for kind, field in TEXT_FIELDS.items():
            sent = self.sent[kind]
            if sent and not (reply.get(field) or "").startswith(sent):
                log.warning(
                    "streamed %s disagrees with the whole turn's parse; serving what was sent",
                    kind,
                )
                reply = {**reply, field: sent}
        return reply
