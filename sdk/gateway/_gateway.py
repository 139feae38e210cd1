"""`Gateway`: sessions and turns, with no HTTP in sight.

The HTTP layer (`create_app`) authenticates, validates and sends; everything that decides
which tokens a turn consists of lives here, so it can be read in one place: canonicalise the
request, extend the served tokens or render in full, sample, parse, and hand back a prepared
turn that the caller commits once the reply is out.
"""

from __future__ import annotations

import json
import logging
import secrets
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio

from .._exceptions import GatewayRequestError, GatewaySessionError
from .._lifecycle import AsyncLifecycle
from ..policy import SamplingParams
from ..trajectory import Status, Trajectory, Turn
from ._canonical import CanonicalMessage, canonicalise, template_messages
from ._schemas import ChatCompletionRequest, RequestMessage
from ._session import GatewayFallback, PreparedTurn, Session, SessionState

__all__ = ["DEFAULT_MAX_TOKENS", "DEFAULT_SETTLE_TIMEOUT", "Gateway"]

log = logging.getLogger("plies.gateway")

DEFAULT_MAX_TOKENS = 1024
"""Completion tokens per turn when neither the request nor the gateway says otherwise."""
DEFAULT_SETTLE_TIMEOUT = 30.0
"""Seconds `finish_session` / `drop_session` wait for a turn in flight before cutting it off."""
KEY_PREFIX = "plies-sk-"
_UNKNOWN_KEY = "session key not recognised: it is unknown, or its session was finished or dropped"


class Gateway(AsyncLifecycle):
    """Capture sessions for black-box agents: render, sample, parse, record.

    Args:
        sampler: a policy client with `sample(prompt_ids, params, *, session=...)`.
        renderer: a `plies.tokens.ChatRenderer` for the served model's tokenizer.
        model: the model name `/v1/models` reports and replies carry.
        sampling: default sampling parameters; a request's temperature, top_p and stop
            override them, and its max_tokens is capped by theirs.
        settle_timeout: how long finishing or dropping a session waits for a turn in flight.
        admin_token: the bearer token of the HTTP session routes; None disables them.
        policy: which policy samples (a `PolicyRef` or served name; None: the sampler's
            default). The attribute of that name can be set after publishing a new
            policy; turns in flight keep theirs.

    The gateway does not own `sampler`: close it yourself after the gateway.

    Example::

        async with Gateway(client, ChatRenderer(tok)) as gw, GatewayServer(gw) as server:
            key = await gw.create_session("task-1")
            ...  # point an agent at server.url with api_key=key
            trajectory = await gw.finish_session(key, reward=1.0)
    """

    def __init__(
        self,
        sampler: Any,
        renderer: Any,
        *,
        model: str = "plies-policy",
        sampling: Any = None,
        settle_timeout: float = DEFAULT_SETTLE_TIMEOUT,
        admin_token: str | None = None,
        policy: Any = None,
    ):
        self.sampler = sampler
        self.renderer = renderer
        self.model = model
        if sampling is None:
            sampling = SamplingParams(max_tokens=DEFAULT_MAX_TOKENS)
        eos = renderer.tokenizer.eos_token_id
        if not sampling.stop_token_ids and eos is not None:
            sampling = sampling.model_copy(update={"stop_token_ids": (eos,)})
        self.sampling = sampling
        self.settle_timeout = settle_timeout
        self.admin_token = admin_token
        self.policy: Any = policy
        self._sessions: dict[str, Session] = {}

    # -- lifetime ------------------------------------------------------------------------

    _lifecycle_noun = "gateway"

    async def __aenter__(self) -> Gateway:
        self._open()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Drop every open session, reporting them; safe to call twice."""
        if not self._close():
            return
        open_sessions = list(self._sessions)
        if open_sessions:
            log.warning(
                "gateway closed with %d open session(s); dropped: %s",
                len(open_sessions),
                ", ".join(sorted(self._sessions[k].task_id for k in open_sessions)),
            )
        with anyio.CancelScope(shield=True):
            for key in open_sessions:
                await self.drop_session(key)

    # -- session API ---------------------------------------------------------------------

    async def create_session(
        self, task_id: str, *, group_id: str = "", info: dict[str, Any] | None = None
    ) -> str:
        """Open a session for one episode and return its bearer key."""
        self._check_open("create a session (use `async with Gateway(...)`)")
        key = KEY_PREFIX + secrets.token_urlsafe(24)
        self._sessions[key] = Session(
            key=key, task_id=task_id, group_id=group_id, info=dict(info or {})
        )
        return key

    async def finish_session(
        self,
        key: str,
        *,
        reward: float | None = None,
        status: Status = Status.COMPLETED,
        error: str | None = None,
        info: dict[str, Any] | None = None,
    ) -> Trajectory:
        """Close a session and return its trajectory; the key is refused from now on.

        `info` is merged into the trajectory's info (the session's own info comes first).

        A turn in flight is given `settle_timeout` to be sent and committed, then cut off
        (its reply never reaches the agent, so it is not recorded).

        Raises:
            GatewaySessionError: the key is unknown, finished or dropped.
        """
        session = await self._retire(key, SessionState.FINISHED)
        return Trajectory(
            task_id=session.task_id,
            group_id=session.group_id,
            turns=list(session.turns),
            messages=list(session.messages),
            reward=reward,
            status=status,
            error=error,
            metrics=session.metrics(),
            info={**session.info, "fallbacks": dict(session.fallbacks), **(info or {})},
        )

    async def drop_session(self, key: str) -> None:
        """Discard a session and its turns; the key is refused from now on.

        Raises:
            GatewaySessionError: the key is unknown, finished or dropped.
        """
        await self._retire(key, SessionState.DROPPED)

    async def _retire(self, key: str, state: SessionState) -> Session:
        session = self.session(key)
        del self._sessions[key]
        session.state = state
        with anyio.move_on_after(self.settle_timeout) as waited:
            await session.lock.acquire()
        if waited.cancelled_caught:
            if session.in_flight is not None:
                session.in_flight.cancel()
            log.warning("session %s: a turn in flight was cut off at %s", session.task_id, state)
            await session.lock.acquire()
        session.lock.release()
        return session

    def session(self, key: str) -> Session:
        """The open session named by `key`.

        Raises:
            GatewaySessionError: the key is unknown, finished or dropped.
        """
        session = self._sessions.get(key)
        if session is None:
            raise GatewaySessionError(_UNKNOWN_KEY)
        return session

    def has_session(self, key: str) -> bool:
        """Whether `key` names an open session."""
        return key in self._sessions

    @property
    def open_sessions(self) -> int:
        return len(self._sessions)

    # -- turns ---------------------------------------------------------------------------

    @asynccontextmanager
    async def turn(self, key: str) -> AsyncIterator[Session]:
        """Hold a session for one turn: one turn at a time, cancellable by finish or drop.

        Raises:
            GatewaySessionError: the key is not (or no longer) an open session.
        """
        session = self.session(key)
        async with session.lock:
            if session.state is not SessionState.OPEN:
                raise GatewaySessionError(_UNKNOWN_KEY)
            with anyio.CancelScope() as scope:
                session.in_flight = scope
                try:
                    yield session
                finally:
                    session.in_flight = None

    async def prepare(self, session: Session, request: ChatCompletionRequest) -> PreparedTurn:
        """Build the prompt, sample and parse one turn; nothing is recorded yet.

        The caller holds `turn(key)`. On success it sends the reply and calls
        `session.commit`; on any failure it calls `session.lose_conversation()`.

        Raises:
            GatewayRequestError: the request asks for something the gateway cannot do.
            PolicyError: sampling failed.
            TokenizationError: the template could not render the messages.
        """
        params = self._params(request)
        canon = canonicalise(request.messages)
        messages = template_messages(request.messages)
        tools = request.tool_dicts()

        fallback: str | None = None
        conversation = session.conversation
        n_served = len(session.served)
        if conversation is not None:
            fallback = _extension_failure(canon, session.served)
        elif session.lost is not None:
            fallback = session.lost
        elif session.turns:
            fallback = GatewayFallback.HISTORY_EDITED

        # The conversation object is mutated below; if this turn is not committed, the
        # session must not extend it again.
        session.lose_conversation()
        if conversation is not None and fallback is None:
            if tools != session.tools:
                conversation.set_tools(tools)
            conversation.add_messages(messages[n_served:])
        else:
            conversation = self.renderer.start(messages, tools=tools)
        prompt_ids = await conversation.arender()
        n_prompt = len(prompt_ids)  # a live list: add_completion extends it in place
        delta = conversation.delta
        if delta.fallback is not None:
            fallback = delta.fallback.reason

        started = time.time()
        completion = await self.sampler.sample(
            prompt_ids, params, policy=self.policy, session=session.key
        )
        latency = time.time() - started
        parsed = conversation.add_completion(completion.ids, completion.finish_reason)

        reply = self._reply(parsed, completion.ids, request)
        turn = Turn.from_completion(
            delta,
            completion,
            message=reply,
            ill_formed=parsed.ill_formed,
            fallback=None if fallback is None else str(fallback),
            started_at=started,
            latency_s=latency,
        )
        served = [*canon, *canonicalise([RequestMessage.model_validate(reply)])]
        finish = "length" if completion.finish_reason == "length" else "stop"
        if reply.get("tool_calls"):
            finish = "tool_calls"
        return PreparedTurn(
            turn=turn,
            reply=reply,
            finish_reason=finish,
            prompt_tokens=n_prompt,
            served=served,
            messages=messages,
            conversation=conversation,
            tools=tools,
        )

    def _params(self, request: ChatCompletionRequest) -> Any:
        choice = request.tool_choice
        if choice is not None and choice not in ("auto", "none"):
            raise GatewayRequestError(
                "tool_choice must be 'auto' or 'none': the gateway samples the policy as it "
                "is and cannot force a tool call",
                param="tool_choice",
            )
        cap = self.sampling.max_tokens
        asked = request.max_completion_tokens or request.max_tokens or cap
        update: dict[str, Any] = {"max_tokens": min(asked, cap)}
        if request.temperature is not None:
            update["temperature"] = request.temperature
        if request.top_p is not None:
            update["top_p"] = request.top_p
        if request.seed is not None:
            update["seed"] = request.seed
        stops = request.stop_strings()
        if stops:
            update["stop_token_ids"] = (*self.sampling.stop_token_ids, *self._stop_ids(stops))
        return self.sampling.model_copy(update=update)

    def _stop_ids(self, stops: list[str]) -> list[int]:
        """Stop strings as token ids: sampling stops by id, so each must be one token."""
        ids = []
        for text in stops:
            encoded = self.renderer.tokenizer.encode(text, add_special_tokens=False)
            if len(encoded) != 1:
                raise GatewayRequestError(
                    f"stop string {text!r} is {len(encoded)} tokens; the gateway stops "
                    "sampling by token id, so each stop string must be exactly one token",
                    param="stop",
                )
            ids.append(encoded[0])
        return ids

    def _reply(
        self, parsed: Any, completion_ids: list[int], request: ChatCompletionRequest
    ) -> dict[str, Any]:
        """The assistant message in OpenAI's shape: argument JSON as a string, fresh ids."""
        calls = parsed.tool_calls
        content = parsed.content
        if calls and request.tool_choice == "none":
            # The agent asked for no tool calls: what the model wrote is returned as text.
            content = self.renderer.tokenizer.decode(completion_ids, skip_special_tokens=True)
            calls = []
        reply: dict[str, Any] = {
            "role": "assistant",
            "content": content if content or not calls else None,
        }
        if calls:
            reply["tool_calls"] = [_openai_call(call) for call in calls]
        if parsed.reasoning:
            reply["reasoning_content"] = parsed.reasoning
        return reply


def _openai_call(call: dict[str, Any]) -> dict[str, Any]:
    function = call["function"]
    arguments = function["arguments"]
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": function["name"], "arguments": arguments},
    }


def _extension_failure(
    canon: list[CanonicalMessage], served: list[CanonicalMessage]
) -> GatewayFallback | None:
    """Why `canon` does not extend `served`, or None when it does."""
    if len(canon) <= len(served):
        return GatewayFallback.HISTORY_EDITED
    for asked, given in zip(canon, served, strict=False):
        if not asked.matches_served(given):
            return GatewayFallback.HISTORY_EDITED
    if any(m.role == "assistant" for m in canon[len(served) :]):
        return GatewayFallback.UNSERVED_ASSISTANT
    return None
