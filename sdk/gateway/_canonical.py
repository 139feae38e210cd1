"""Canonical messages: what must be equal for a request to extend the served conversation.

Clients reformat what they send back: the official client and agent frameworks regenerate
tool call ids, re-serialise argument JSON with other spacing or key order, send `None`
where the gateway sent "" (or the reverse), split content into text parts, and drop the
reasoning field. None of that changes what the policy saw, so none of it may break the
token prefix. Anything else that differs (a rewritten user turn, an edited answer, a
dropped tool result) is an edit of history: the gateway renders the request in full and
starts a new training segment.

Comparison is on these small records, never on re-tokenized history, so checking a request
costs string work proportional to the request and no tokenization.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ._schemas import RequestMessage, ToolCall

__all__ = ["CanonicalMessage", "canonical_arguments", "canonicalise", "template_messages"]


@dataclass(frozen=True, slots=True)
class CanonicalMessage:
    """One message reduced to what the chat template renders.

    Attributes:
        role: "developer" is folded into "system".
        content: text; None and "" are the same; assistant content is stripped of
            surrounding whitespace, which clients trim.
        tool_calls: (name, canonical argument JSON) per call; ids are dropped.
        tool_call_ref: for a tool result, the ordinal of the call it answers within the
            conversation (ids are client-chosen), or the raw id if no call has it.
        name: the optional participant name.
        reasoning: assistant reasoning; None when the client may have left it out (a chat
            client), "" when it sent the turn without any (a Messages or Responses client,
            where thinking is a block the agent keeps or drops on purpose).
        handles: the handles replayed with the turn's thinking (never compared: the gateway
            looks them up in its session).
    """

    role: str
    content: str
    tool_calls: tuple[tuple[str, str], ...] = ()
    tool_call_ref: int | str | None = None
    name: str | None = None
    reasoning: str | None = None
    handles: tuple[str, ...] = ()

    def matches_served(self, served: CanonicalMessage) -> bool:
        """Whether this (requested) message is the served one, reformatted at most.

        A chat client that leaves the reasoning field out still matches: the sampled
        tokens, reasoning included, are what the next prompt extends. A turn sent with no
        thinking at all (`reasoning == ""`) where the served one had some does not: the agent
        dropped it, and the model must not see it (`drops_reasoning_of`).
        """
        if self.reasoning is not None and self.reasoning != (served.reasoning or ""):
            return False
        return (
            self.role == served.role
            and self.content == served.content
            and self.tool_calls == served.tool_calls
            and self.tool_call_ref == served.tool_call_ref
            and self.name == served.name
        )

    def drops_reasoning_of(self, served: CanonicalMessage) -> bool:
        """Whether this message is the served one with its thinking dropped (as Claude Code
        drops the thinking of older turns)."""
        if self.reasoning != "" or not served.reasoning:
            return False
        return dataclasses.replace(self, reasoning=None).matches_served(served)


def canonical_arguments(arguments: str | dict[str, Any]) -> str:
    """Argument JSON with sorted keys and no spacing; unparseable text is kept, stripped."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return arguments.strip()
    return json.dumps(arguments, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def _calls(tool_calls: Sequence[ToolCall] | None) -> tuple[tuple[str, str], ...]:
    return tuple(
        (c.function.name, canonical_arguments(c.function.arguments)) for c in tool_calls or ()
    )


def canonicalise(messages: Sequence[RequestMessage]) -> list[CanonicalMessage]:
    """Canonical records for a whole request, tool call ids resolved to ordinals."""
    ordinals: dict[str, int] = {}
    n_calls = 0
    out: list[CanonicalMessage] = []
    for m in messages:
        role = "system" if m.role == "developer" else m.role
        if role == "assistant":
            for call in m.tool_calls or ():
                if call.id is not None:
                    ordinals[call.id] = n_calls
                n_calls += 1
            reasoning = m.reasoning_content if m.reasoning_content is not None else m.reasoning
            out.append(
                CanonicalMessage(
                    role=role,
                    content=m.text().strip(),
                    tool_calls=_calls(m.tool_calls),
                    name=m.name,
                    reasoning=reasoning.strip() if reasoning is not None else None,
                    handles=m._handles,
                )
            )
        elif role == "tool":
            ref = m.tool_call_id
            out.append(
                CanonicalMessage(
                    role=role,
                    content=m.text(),
                    tool_call_ref=ordinals.get(ref, ref) if ref is not None else None,
                    name=m.name,
                )
            )
        else:
            out.append(CanonicalMessage(role=role, content=m.text(), name=m.name))
    return out


def template_messages(messages: Sequence[RequestMessage]) -> list[dict[str, Any]]:
    """Messages in the shape Hugging Face chat templates expect.

    Argument JSON becomes an object (templates serialise it themselves), content becomes a
    string, and "developer" becomes "system".
    """
    out: list[dict[str, Any]] = []
    for m in messages:
        msg: dict[str, Any] = {
            "role": "system" if m.role == "developer" else m.role,
            "content": m.text(),
        }
        if m.name is not None:
            msg["name"] = m.name
        if m.role == "tool" and m.tool_call_id is not None:
            msg["tool_call_id"] = m.tool_call_id
        if m.role == "assistant":
            reasoning = m.reasoning_content if m.reasoning_content is not None else m.reasoning
            if reasoning:
                msg["reasoning_content"] = reasoning
            if m.tool_calls:
                msg["tool_calls"] = [_template_call(c) for c in m.tool_calls]
        out.append(msg)
    return out


def _template_call(call: ToolCall) -> dict[str, Any]:
    args: Any = call.function.arguments
    if isinstance(args, str):
        # Unparseable text stays a string: the template renders it as the model wrote it.
        with contextlib.suppress(ValueError):
            args = json.loads(args)
    fn = {"name": call.function.name, "arguments": args}
    out: dict[str, Any] = {"type": "function", "function": fn}
    if call.id is not None:
        out["id"] = call.id
    return out
