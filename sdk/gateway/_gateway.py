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
from collections.abc import AsyncIterator, Callable, Collection
from contextlib import asynccontextmanager
from typing import Any

import anyio

from .._exceptions import GatewaySessionError
from .._lifecycle import AsyncCloseable
from ..policy import SamplingParams, StreamingPolicyClient
from ..trajectory import Status, Trajectory, Turn
from ._canonical import CanonicalMessage, canonicalise, template_messages
from ._errors import forced_tool_choice
from ._schemas import ChatCompletionRequest, RequestMessage
from ._session import Branch, GatewayFallback, PreparedTurn, Session, SessionState
from ._stops import StopStrings, check_stops
from ._stream import ReplyStream, marker_pattern

__all__ = ["DEFAULT_MAX_TOKENS", "DEFAULT_SETTLE_TIMEOUT", "Gateway"]

log = logging.getLogger("plies.gateway")

DEFAULT_MAX_TOKENS = 1024
"""Completion tokens per turn when neither the request nor the gateway says otherwise."""
DEFAULT_SETTLE_TIMEOUT = 30.0
"""Seconds `finish_session` / `drop_session` wait for a turn in flight before cutting it off."""
KEY_PREFIX = "plies-sk-"
REASONING_CLOSE = "</think>"
"""The token that closes a reasoning block, for `reasoning_tokens` in usage (Qwen3, DeepSeek)."""
_UNKNOWN_KEY = "session key not recognised: it is unknown, or its session was finished or dropped"


class Gateway(AsyncCloseable):
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
        auxiliary_models: model names whose requests are auxiliary calls (a title or topic
            request to a small model); Anthropic requests with `output_config.format` are
            too. Auxiliary turns are recorded with `Turn.auxiliary` and never trained.
        train_auxiliary: train them after all (they are then an ordinary branch named
            "auxiliary").

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
        auxiliary_models: Collection[str] = (),
        train_auxiliary: bool = False,
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
        self.auxiliary_models = frozenset(auxiliary_models)
        self.train_auxiliary = train_auxiliary
        self._sessions: dict[str, Session] = {}
        self._markers = marker_pattern(renderer.tokenizer)

    # -- lifetime ------------------------------------------------------------------------

    _lifecycle_noun = "gateway"

    async def __aenter__(self) -> Gateway:
        self._open()
        return self

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
            while session.in_flight:
                await session.settled.wait()
        if waited.cancelled_caught:
            for scope in session.in_flight:
                scope.cancel()
            log.warning(
                "session %s: %d turn(s) in flight cut off at %s",
                session.task_id,
                len(session.in_flight),
                state,
            )
            while session.in_flight:
                await session.settled.wait()
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
        """Hold a session for one turn, cancellable by finish or drop.

        Turns of one session run concurrently (sub-agents, parallel requests of one agent),
        up to `MAX_TURNS_IN_FLIGHT`; each extends a branch no other turn in flight holds.

        Raises:
            GatewaySessionError: the key is not (or no longer) an open session.
        """
        session = self.session(key)
        async with session.slots:
            if session.state is not SessionState.OPEN:
                raise GatewaySessionError(_UNKNOWN_KEY)
            with anyio.CancelScope() as scope:
                if not session.in_flight:
                    session.settled = anyio.Event()
                session.in_flight.add(scope)
                try:
                    yield session
                finally:
                    session.in_flight.discard(scope)
                    if not session.in_flight:
                        session.settled.set()

    async def prepare(
        self,
        session: Session,
        request: ChatCompletionRequest,
        *,
        on_prompt: Callable[[int, int], None] | None = None,
        branch_name: str | None = None,
        auxiliary: bool = False,
        stream: ReplyStream | None = None,
    ) -> PreparedTurn:
        """Build the prompt, sample and parse one turn; nothing is recorded yet.

        The caller holds `turn(key)`. On success it sends the reply and calls
        `session.commit`, or `session.lose(prepared.taken)` if the reply did not go out; a
        failure in here releases what the turn took.

        Where the prompt starts (`_continue`): the live branch tip whose served messages the
        request extends (the longest); else, as a sibling, a tip a turn in flight holds, or
        the latest turn whose handle the request replays (a thinking `signature`, a reasoning
        item), restored from its stored ids (`ChatRenderer.resume`); else a full render, a
        new branch, with the reason.

        Args:
            on_prompt: told (prompt tokens, of which reused from the stored prefix) once the
                prompt is rendered and before sampling starts, so a stream can open.
            branch_name: the agent or sub-agent the request came from (a header), named on
                the turn; by default the branch it extends, or a new name.
            auxiliary: the caller knows the request is an auxiliary call (a title or a
                structured summary); requests to `auxiliary_models` are too.
            stream: told the turn's ids as they are sampled, where the sampler streams
                (`StreamingPolicyClient`) and the request allows tool calls; the reply then
                begins with what it sent.

        Raises:
            GatewayRequestError: the request asks for something the gateway cannot do.
            PolicyError: sampling failed.
            TokenizationError: the template could not render the messages.
        """
        params, stops = await self._params(request)
        canon = canonicalise(request.messages)
        messages = template_messages(request.messages)
        tools = request.tool_dicts()

        start, fallback = self._continue(session, canon, take=True)
        # A taken tip's conversation is mutated below; if this turn is not committed, the
        # session must not extend it again (`Session.lose`).
        taken = start if isinstance(start, Branch) else None
        if isinstance(start, Branch):
            name, parent = branch_name or start.name, start.last
        else:
            session.n_branches += 1
            name, parent = branch_name or f"branch-{session.n_branches}", start
        sampled = False
        try:
            conversation = await self._conversation(session, start, messages, tools, fork=False)
            prompt_ids = await conversation.arender()
            n_prompt = len(prompt_ids)  # a live list: add_completion extends it in place
            delta = conversation.delta
            cached = n_prompt - len(delta.ids) if delta.extends else 0
            if delta.fallback is not None:
                fallback = delta.fallback.reason
            if on_prompt is not None:
                on_prompt(n_prompt, cached)

            started = time.time()
            streaming = isinstance(self.sampler, StreamingPolicyClient)
            if stream is not None and streaming and request.tool_choice != "none":
                stream.begin(
                    lambda ids: conversation.parse(ids, prefix=True), self._markers, stops.matched
                )
                completion = await self.sampler.sample_streaming(
                    prompt_ids, params, stream.feed, policy=self.policy, session=session.key
                )
            else:
                completion = await self.sampler.sample(
                    prompt_ids, params, policy=self.policy, session=session.key
                )
            latency = time.time() - started
            completion, stop_sequence = await self._cut_at_stop(completion, stops)
            parsed = conversation.add_completion(completion.ids, completion.finish_reason)
            auxiliary = auxiliary or request.model in self.auxiliary_models
            if auxiliary and self.train_auxiliary:
                auxiliary, name = False, "auxiliary"

            reply = self._reply(parsed, completion.ids, request, stop_sequence)
            if stream is not None:
                reply = stream.reconcile(reply)
            turn = Turn.from_completion(
                delta,
                completion,
                message=reply,
                ill_formed=parsed.ill_formed,
                fallback=None if fallback is None else str(fallback),
                started_at=started,
                latency_s=latency,
                parent=parent if delta.extends else None,
                branch=name,
                auxiliary=auxiliary,
            )
            served = [*canon, *canonicalise([RequestMessage.model_validate(reply)])]
            finish = "length" if completion.finish_reason == "length" else "stop"
            if reply.get("tool_calls"):
                finish = "tool_calls"
            prepared = PreparedTurn(
                turn=turn,
                reply=reply,
                finish_reason=finish,
                prompt_tokens=n_prompt,
                served=served,
                messages=messages,
                conversation=conversation,
                tools=tools,
                cached_tokens=cached,
                reasoning_tokens=self._reasoning_tokens(completion.ids, parsed),
                stop_sequence=stop_sequence,
                branch=name,
                assistant=conversation.messages[-1],
            )
            prepared.taken = taken
            sampled = True
            return prepared
        finally:
            if not sampled:
                session.lose(taken)

    async def count_tokens(self, session: Session, request: ChatCompletionRequest) -> int:
        """The length of the prompt `prepare` would send for `request`, sampling nothing.

        The caller holds `turn(key)`. The session's conversation is copied (or a stored turn
        restored), never advanced, so counting leaves the next turn's prompt as it was.
        """
        canon = canonicalise(request.messages)
        messages = template_messages(request.messages)
        tools = request.tool_dicts()
        start, _ = self._continue(session, canon, take=False)
        conversation = await self._conversation(session, start, messages, tools, fork=True)
        return len(await conversation.arender())

    async def _conversation(
        self,
        session: Session,
        start: Branch | int | None,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        *,
        fork: bool,
    ) -> Any:
        """The conversation whose next prompt answers the request: a new one, the live tip
        advanced (a copy of it with `fork`), or a stored turn restored and advanced."""
        if start is None:
            return self.renderer.start(messages, tools=tools)
        if isinstance(start, Branch):
            conversation = start.conversation.fork() if fork else start.conversation
            return self._advance(conversation, messages, len(start.served), tools)
        return await self._restore(session, start, messages, tools)

    def _continue(
        self, session: Session, canon: list[CanonicalMessage], *, take: bool
    ) -> tuple[Branch | int | None, GatewayFallback | None]:
        """Where the request's prompt starts, or why it starts afresh.

        Returns a live tip to extend (with `take`, it leaves the live set: the turn mutates
        its conversation), the index of a stored turn to restore and extend, or None and the
        reason for a full render. Costs string work over the request per candidate, never a
        tokenization.
        """
        best: Branch | None = None
        for branch in session.branches:
            longer = best is None or len(branch.served) >= len(best.served)
            extends = len(canon) > len(branch.served)  # checked first: the common case
            if longer and extends and _extension_failure(canon, branch.served) is None:
                best = branch
        if best is not None:
            if take:
                session.branches.remove(best)
                session.busy.append(best)
            return best, None
        # Siblings: of a tip a turn in flight holds, or of a turn whose handle is replayed.
        candidates = {b.last for b in session.busy}
        candidates.update(
            session.handles[h] for m in canon for h in m.handles if h in session.handles
        )
        restorable = [(session.records[k].served, k) for k in candidates if k in session.records]
        failures = set()
        for served, k in sorted(restorable, key=lambda c: -len(c[0])):
            failure = _extension_failure(canon, served)
            if failure is None:
                return k, None
            failures.add(failure)
        for branch in session.branches:
            if _is_retry(canon, branch.served):
                return None, GatewayFallback.RETRIED
            failures.add(_extension_failure(canon, branch.served))
        if GatewayFallback.HANDLE_MISMATCH in failures:
            unknown = any(h not in session.handles for m in canon for h in m.handles)
            return (
                None,
                GatewayFallback.UNKNOWN_HANDLE if unknown else GatewayFallback.HANDLE_MISMATCH,
            )
        if GatewayFallback.THINKING_DROPPED in failures:
            return None, GatewayFallback.THINKING_DROPPED
        if session.lost is not None:
            return None, session.lost
        if session.turns:
            return None, GatewayFallback.HISTORY_EDITED
        return None, None

    async def _restore(
        self, session: Session, k: int, messages: list[dict[str, Any]], tools: Any
    ) -> Any:
        """A conversation just after stored turn `k`, its ids as stored, extended by the
        request's messages after the ones served up to `k`'s reply. O(history) once, on a
        path that would otherwise have been a full render."""
        record = session.records[k]
        turn = session.turns[k]
        # The trajectory's own rebuild from the stored deltas, over the turns so far.
        prompt = Trajectory.model_construct(turns=session.turns).prompt_ids(k)
        conversation = self.renderer.resume(
            record.messages,
            prompt,
            turn.completion_ids,
            finish_reason=turn.finish_reason,
            message=record.assistant,
            tools=record.tools,
        )
        return self._advance(conversation, messages, len(record.served), tools)

    def _advance(
        self, conversation: Any, messages: list[dict[str, Any]], n_served: int, tools: Any
    ) -> Any:
        """`conversation` extended by the messages after the served ones."""
        if tools != conversation.tools:
            conversation.set_tools(tools)
        conversation.add_messages(messages[n_served:])
        return conversation

    async def _params(self, request: ChatCompletionRequest) -> tuple[Any, StopStrings]:
        """Sampling parameters for `request`, and its stop strings compiled off the loop."""
        choice = request.tool_choice
        if choice is not None and choice not in ("auto", "none"):
            raise forced_tool_choice(
                choice if isinstance(choice, str) else choice.type, "tool_choice"
            )
        cap = self.sampling.max_tokens
        asked = request.max_completion_tokens or request.max_tokens or cap
        update: dict[str, Any] = {"max_tokens": min(asked, cap)}
        if request.temperature is not None:
            update["temperature"] = request.temperature
        if request.top_p is not None:
            update["top_p"] = request.top_p
        if request.top_k is not None:
            update["top_k"] = request.top_k
        if request.seed is not None:
            update["seed"] = request.seed
        texts = check_stops(request.stop_strings(), "stop")
        stops = StopStrings({}, ())
        if texts:
            tokenizer = self.renderer.tokenizer
            stops = await anyio.to_thread.run_sync(StopStrings.compile, tokenizer, texts)
        if stops.by_id:
            update["stop_token_ids"] = (*self.sampling.stop_token_ids, *stops.by_id)
        return self.sampling.model_copy(update=update), stops

    async def _cut_at_stop(self, completion: Any, stops: StopStrings) -> tuple[Any, str | None]:
        """The completion cut after the first stop string it completes, and that string.

        A cut completion did not sample the template's close token, so it is recorded with
        finish reason "abort": the close token is added to the next prompt, as for a
        truncated one, and the next turn still extends it.
        """
        ids = completion.ids
        if ids and completion.finish_reason == "stop" and ids[-1] in stops.by_id:
            return completion, stops.by_id[ids[-1]]
        matcher = stops.matcher(self.renderer.tokenizer)
        if matcher is None:
            return completion, None
        found = await anyio.to_thread.run_sync(matcher.first_match, ids)
        if found is None:
            return completion, None
        n, text = found
        cut = completion.model_copy(
            update={"ids": ids[:n], "logprobs": completion.logprobs[:n], "finish_reason": "abort"}
        )
        return cut, text

    def _reasoning_tokens(self, ids: list[int], parsed: Any) -> int:
        """Completion ids up to the end of the reasoning block (0 when there was none)."""
        if not parsed.reasoning:
            return 0
        close = self.renderer.tokenizer.convert_tokens_to_ids(REASONING_CLOSE)
        return ids.index(close) + 1 if isinstance(close, int) and close in ids else 0

    def _reply(
        self,
        parsed: Any,
        completion_ids: list[int],
        request: ChatCompletionRequest,
        stop_sequence: str | None,
    ) -> dict[str, Any]:
        """The assistant message in OpenAI's shape: argument JSON as a string, fresh ids."""
        calls = parsed.tool_calls
        content = parsed.content
        if calls and request.tool_choice == "none":
            # The agent asked for no tool calls: what the model wrote is returned as text.
            content = self.renderer.tokenizer.decode(completion_ids, skip_special_tokens=True)
            calls = []
        if stop_sequence is not None and content and stop_sequence in content:
            # Clients never see the stop string, nor what its last token sampled after it.
            # No earlier id completed a stop, so its first place in the text is the match.
            content = content[: content.index(stop_sequence)]
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
    """Why `canon` does not extend `served`, or None when it does.

    A replayed handle must be the one served at its place (the gateway's own on a turn it
    sampled, or what the agent sent there before): the served handle on a changed message,
    or another handle on the served message, is `HANDLE_MISMATCH`, never trusted. A message
    that carries none is compared by its content alone.
    """
    for asked, given in zip(canon, served, strict=False):
        if not asked.matches_served(given):
            if asked.drops_reasoning_of(given):
                return GatewayFallback.THINKING_DROPPED
            if set(asked.handles) & set(given.handles):
                return GatewayFallback.HANDLE_MISMATCH
            return GatewayFallback.HISTORY_EDITED
        if not _same_handles(asked, given):
            return GatewayFallback.HANDLE_MISMATCH
    if len(canon) <= len(served):
        return GatewayFallback.HISTORY_EDITED
    if any(m.role == "assistant" for m in canon[len(served) :]):
        return GatewayFallback.UNSERVED_ASSISTANT
    return None


def _is_retry(canon: list[CanonicalMessage], served: list[CanonicalMessage]) -> bool:
    """Whether `canon` is the request that `served`'s last reply answered, sent again."""
    if len(canon) != len(served) - 1 or served[-1].role != "assistant":
        return False
    return all(
        a.matches_served(s) and _same_handles(a, s) for a, s in zip(canon, served, strict=False)
    )


def _same_handles(asked: CanonicalMessage, served: CanonicalMessage) -> bool:
    """Whether a message replays the handles served at its place (or carries none)."""
    return not asked.handles or set(asked.handles) == set(served.handles)
