"""One gateway session: the token state of one episode, named by its bearer key.

A session holds what the gateway served so far, as canonical messages, beside the renderer
conversation whose tokens produced it. A request that extends the served messages extends
those tokens; anything else is an edit of history, rendered in full. Turns are appended only
by `commit`, which runs after the reply was sent, so the trajectory never holds a turn the
agent did not see.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Any

import anyio

from ..trajectory import Turn
from ._canonical import CanonicalMessage

__all__ = [
    "MAX_BRANCHES",
    "MAX_HANDLE_CHARS",
    "MAX_RESTORABLE",
    "MAX_TURNS_IN_FLIGHT",
    "Branch",
    "GatewayFallback",
    "PreparedTurn",
    "Session",
    "SessionState",
    "TurnRecord",
]


class SessionState(StrEnum):
    """Where a session stands. Only an open session serves requests."""

    OPEN = "open"
    """Its key is valid; turns are recorded."""
    FINISHED = "finished"
    """`finish_session` returned its trajectory; the key is refused."""
    DROPPED = "dropped"
    """`drop_session` discarded it; the key is refused."""


class GatewayFallback(StrEnum):
    """Why the gateway rendered a prompt in full instead of extending the served tokens.

    The renderer has reasons of its own (a tool set changed, reasoning would be stripped);
    these are the ones only the gateway can see.
    """

    HISTORY_EDITED = "history_edited"
    """The request's messages do not start with the conversation the gateway served."""
    UNSERVED_ASSISTANT = "unserved_assistant"
    """New messages include an assistant message the gateway did not sample."""
    REPLY_NOT_DELIVERED = "reply_not_delivered"
    """The previous request failed or its client left, so its tokens were not kept."""
    RETRIED = "retried"
    """The request repeats the one before a served reply (a retry): a sibling branch."""
    THINKING_DROPPED = "thinking_dropped"
    """The agent replayed a served turn without the thinking the policy sampled for it (as
    Claude Code does for older turns): the model now sees a history without it."""
    UNKNOWN_HANDLE = "unknown_handle"
    """A replayed thinking signature or reasoning item names no turn of this session (made
    up, altered, or from another session or provider): nothing in the request is trusted."""
    HANDLE_MISMATCH = "handle_mismatch"
    """A handle of this session came back on a message that is not the turn it names (its
    thinking, text or tool calls changed): nothing in the request is trusted."""


MAX_BRANCHES = 64
"""Live branch tips per session; past it the oldest can no longer be extended (a request
that continues it is rendered in full, as a new branch)."""
MAX_RESTORABLE = 64
"""Turns per session (the most recent) a request can branch off by handle or as the sibling
of a turn in flight; an older turn's handle is still known, but not restored."""
MAX_TURNS_IN_FLIGHT = 16
"""Turns of one session sampled at once; further requests on its key wait for a slot."""
MAX_HANDLE_CHARS = 128
"""Longest handle looked up; a longer one is cut (and so unknown)."""


@dataclass(eq=False)
class Branch:
    """One tip of a session's tree: the served messages and the tokens that produced them."""

    name: str
    served: list[CanonicalMessage]
    conversation: Any
    last: int
    """Index of the branch's last turn."""


@dataclass(frozen=True, slots=True)
class TurnRecord:
    """What it takes to go on from a stored turn without rendering it again: the messages
    its prompt rendered, the assistant message its completion stands for, its tools, and the
    canonical messages served up to and including its reply. Its ids are in `Session.turns`."""

    served: list[CanonicalMessage]
    messages: list[dict[str, Any]]
    assistant: dict[str, Any]
    tools: list[dict[str, Any]] | None


@dataclass(slots=True)
class PreparedTurn:
    """A sampled turn and its reply, waiting to be sent and then committed."""

    turn: Turn
    reply: dict[str, Any]
    finish_reason: str
    prompt_tokens: int
    served: list[CanonicalMessage]
    messages: list[dict[str, Any]]
    conversation: Any
    tools: list[dict[str, Any]] | None
    cached_tokens: int = 0
    """Prompt tokens reused from the stored prefix (the cache hit agents are told of)."""
    reasoning_tokens: int = 0
    """Completion tokens up to the end of the reasoning block."""
    stop_sequence: str | None = None
    """The request's stop string that ended the completion, if one did."""
    handle: str | None = None
    """The opaque handle minted for this turn (a thinking signature, an encrypted_content)."""
    branch: str = ""
    taken: Branch | None = None
    """The live tip this turn extends, out of the live set until the turn is committed."""
    assistant: dict[str, Any] = field(default_factory=dict)
    """The assistant message the renderer parsed from the completion."""


@dataclass(eq=False)
class Session:
    """The state of one session.

    Turns run concurrently (up to `MAX_TURNS_IN_FLIGHT`, by `slots`): each takes its branch
    tip out of `branches` while it samples, so no two turns advance one conversation, and
    state changes happen between awaits, on one event loop.
    """

    key: str
    task_id: str
    group_id: str = ""
    info: dict[str, Any] = field(default_factory=dict)
    state: SessionState = SessionState.OPEN
    turns: list[Turn] = field(default_factory=list)
    messages: list[dict[str, Any]] = field(default_factory=list)
    branches: list[Branch] = field(default_factory=list)
    """Live branch tips, oldest first; a turn in flight has taken its branch out."""
    busy: list[Branch] = field(default_factory=list)
    """Tips taken out by turns in flight: a request that extends one is their sibling."""
    n_branches: int = 0
    lost: GatewayFallback | None = None
    fallbacks: Counter[str] = field(default_factory=Counter)
    dropped_tools: Counter[str] = field(default_factory=Counter)
    """Tools the agent offered that the gateway cannot serve (hosted, namespaced), by kind."""
    ill_formed: int = 0
    responses: dict[str, list[Any]] = field(default_factory=dict)
    """The conversation of each recent Responses reply, for `previous_response_id`."""
    handles: dict[str, int] = field(default_factory=dict)
    """Minted handles (thinking signatures, reasoning encrypted_content) -> the turn they
    name."""
    records: dict[int, TurnRecord] = field(default_factory=dict)
    """The most recent `MAX_RESTORABLE` turns, by index, for branching off them."""
    slots: anyio.CapacityLimiter = field(
        default_factory=lambda: anyio.CapacityLimiter(MAX_TURNS_IN_FLIGHT)
    )
    in_flight: set[anyio.CancelScope] = field(default_factory=set)
    settled: anyio.Event = field(default_factory=anyio.Event)
    """Set when the last turn in flight ends; a new one is made when a turn starts."""

    def commit(self, prepared: PreparedTurn) -> None:
        """Record a turn whose reply was sent, and keep its tokens for the next prompt."""
        k = len(self.turns)
        if prepared.handle is not None:
            self.handles[prepared.handle] = k
            # The reply as served carries its handle: a replay must bring back this one.
            prepared.served[-1] = replace(prepared.served[-1], handles=(prepared.handle,))
        self.turns.append(prepared.turn)
        self.messages = [*prepared.messages, prepared.reply]
        self.records[k] = TurnRecord(
            prepared.served, prepared.messages, prepared.assistant, prepared.tools
        )
        self.records.pop(k - MAX_RESTORABLE, None)
        self._release(prepared.taken)
        self.branches.append(Branch(prepared.branch, prepared.served, prepared.conversation, k))
        del self.branches[:-MAX_BRANCHES]
        self.lost = None
        if prepared.turn.fallback is not None:
            self.fallbacks[prepared.turn.fallback] += 1
        self.ill_formed += prepared.turn.ill_formed

    def lose(self, taken: Branch | None) -> None:
        """Forget the branch a turn took out when the turn was not delivered.

        Its conversation object may already hold the lost turn's messages and tokens, so it
        cannot be extended again; the next request that would have renders in full and
        says why. Other branches are untouched. Safe to call twice.
        """
        if self.turns:
            self.lost = GatewayFallback.REPLY_NOT_DELIVERED
        self._release(taken)

    def _release(self, taken: Branch | None) -> None:
        if taken is not None and taken in self.busy:
            self.busy.remove(taken)

    def metrics(self) -> dict[str, float]:
        out: dict[str, float] = {
            "turns": float(len(self.turns)),
            "fallbacks": float(sum(self.fallbacks.values())),
            "ill_formed": float(self.ill_formed),
        }
        for reason, n in sorted(self.fallbacks.items()):
            out[f"fallback.{reason}"] = float(n)
        for kind, n in sorted(self.dropped_tools.items()):
            out[f"dropped_tool.{kind}"] = float(n)
        return out
