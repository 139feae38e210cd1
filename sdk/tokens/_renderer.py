"""Incremental prompts: each turn's prompt is the previous prompt + the sampled ids + a delta.

Why: re-rendering the whole history every turn costs O(history) per turn and, for templates
that rewrite history (Qwen3 strips reasoning, tools baked into the system turn), silently
changes tokens the policy already saw. Here the history is never re-rendered or re-tokenized on
the incremental path; when it cannot be proven exact the prompt is fully re-rendered, and the
turn says so (`PromptDelta.fallback` names the reason; `extends` stays true only when that
full render still begins with the previous prompt + completion).
"""

from __future__ import annotations

import copy
import json
import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import anyio

from .._exceptions import ConfigError
from ._choice import TemplateChoice, TemplateMode, choose_template
from ._memo import Memo, MemoStatistics, plain_key
from ._parser import ParsedResponse, ResponseParser
from ._probe import (
    Fallback,
    FallbackReason,
    TemplateProfile,
    TransitionKind,
    classify,
    incremental_delta,
    is_multimodal,
    probe,
)
from ._template import Template, tool_schemas

__all__ = ["ChatRenderer", "Conversation", "PromptDelta", "RendererStatistics"]

log = logging.getLogger("plies.tokens")

_FINISH_REASONS = ("stop", "length", "abort")
_INLINE_OPENING_CHARS = 4096
"""Opening messages up to this many characters are rendered on the event loop once their key
is probed (bench/rollout_bench.py: the render then costs less than a thread hand-off)."""
DELTA_MEMO_SIZE = 1024
"""Incremental steps a renderer remembers (`ChatRenderer.statistics`)."""
DELTA_MEMO_KEY_CHARS = 2048
"""Steps whose assistant turn and new messages take more characters than this are not
remembered: long observations rarely repeat, and this bounds the memo's memory (tens of MB
at worst, well under one MB for short tool rounds)."""


@dataclass(frozen=True)
class PromptDelta:
    """What a recorder stores for one prompt, without copying history.

    Attributes:
        ids: the tokens added after the previous prompt + completion when `extends`, else the
            whole prompt. Record it with `Turn.from_completion(delta, completion)`.
        extends: the prompt is the previous prompt + completion + `ids` (the training segment
            goes on). True on the incremental path, and after a full render that turned out to
            start with the previous prompt + completion token for token.
        fallback: why the prompt was fully re-rendered, when it was after the first turn.
    """

    ids: list[int]
    extends: bool
    fallback: Fallback | None = None


@dataclass(frozen=True)
class RendererStatistics:
    """What a renderer's memos saved (`ChatRenderer.statistics`)."""

    deltas: MemoStatistics
    """Incremental steps: a hit skipped the template render and the tokenization."""
    parses: MemoStatistics
    """Parsed completions, over the renderer's parsers: a hit skipped decoding and parsing."""


class ChatRenderer:
    """Builds token prompts for multi-turn conversations with one tokenizer and chat template.

    One renderer serves many conversations and owns the cache of probe verdicts (one per
    template key), so create one per model and reuse it.

    Args:
        tokenizer: a transformers tokenizer with a chat template.
        tools: tools offered to the model (JSON schemas or callables), as for
            `apply_chat_template`.
        template_kwargs: extra template variables, e.g. `{"enable_thinking": False}`. Pin
            date-dependent variables (Llama's `date_string`) here so a run stays reproducible.
        template: which chat template prompts are rendered with. `"auto"` (default): TRL's
            `_training` variant when the model's template is not prefix-preserving (TRL's
            check, or the probe under these kwargs) and TRL ships one, else the model's own;
            `"model"`: always the model's own; `"training"`: the variant (or the model's own
            when TRL finds it training-compatible already). `choice` says which and why.

    Raises:
        ConfigError: the tokenizer has no chat template, an unknown `template`, or
            `template="training"` for a template TRL has no variant of.
    """

    def __init__(
        self,
        tokenizer: Any,
        tools: Sequence[Any] | None = None,
        template_kwargs: dict[str, Any] | None = None,
        *,
        template: TemplateMode = "auto",
    ):
        self.tokenizer = tokenizer
        self.tools = tool_schemas(tools)
        self.template_kwargs = dict(template_kwargs or {})
        self._profiles: dict[str, TemplateProfile] = {}
        self._parsers: dict[str, ResponseParser] = {}
        self._deltas: Memo[tuple[int, ...] | Fallback] = Memo(DELTA_MEMO_SIZE)
        self._lock = threading.Lock()
        self._text: str | None = None  # None: the tokenizer's own (named templates follow tools)
        self.choice: TemplateChoice = choose_template(
            tokenizer, template, self.tools, self._profile_of_text
        )
        """The chat template in use (`choice.text`, `choice.name`) and why it was chosen."""
        if self.choice.source == "trl":
            self._text = self.choice.text
            log.info(
                "rendering with TRL's %s chat template (sha256:%s): %s",
                self.choice.name,
                self.choice.sha256[:12],
                self.choice.reason,
            )

    @property
    def chat_template(self) -> str:
        """The template text prompts are rendered with, for the renderer's tools (pass it as
        `chat_template=` to `apply_chat_template` to reproduce a prompt)."""
        return self.choice.text

    def start(
        self, messages: Sequence[dict[str, Any]], *, tools: Sequence[Any] | None = None
    ) -> Conversation:
        """Begin a conversation; its first prompt is a full render of `messages`.

        Args:
            messages: the opening messages (system, user, or a resumed history).
            tools: tools for this conversation, overriding the renderer's.
        """
        return Conversation(self, messages, self.tools if tools is None else tool_schemas(tools))

    def resume(
        self,
        messages: Sequence[dict[str, Any]],
        prompt_ids: Sequence[int],
        completion_ids: Sequence[int],
        *,
        finish_reason: str,
        message: dict[str, Any],
        tools: Sequence[Any] | None = None,
    ) -> Conversation:
        """A conversation standing just after a stored turn, its ids taken as given.

        Why: a capture gateway branches off a stored turn (a sibling of a turn in flight, a
        thinking block replayed with its handle) and must go on from the ids the policy saw
        and sampled; rendering `messages` again would change them wherever the template
        rewrites history, and would cost O(history). Nothing is rendered or tokenized here;
        the next prompt is `prompt_ids + completion_ids` + a delta, as after `add_completion`.

        Args:
            messages: the messages `prompt_ids` is the render of.
            prompt_ids: the stored prompt of that turn.
            completion_ids: what was sampled for it, stop token included.
            finish_reason: as for `add_completion`.
            message: the assistant message the completion stands for.
            tools: the tools of that turn, overriding the renderer's.
        """
        conversation = self.start(messages, tools=tools)
        conversation._prompt = list(prompt_ids)
        conversation._delta = PromptDelta(list(prompt_ids), False)
        conversation._dirty = False
        conversation.add_completion(completion_ids, finish_reason, message=message)
        return conversation

    def template(
        self, tools: list[dict[str, Any]] | None, system: dict[str, Any] | None
    ) -> Template:
        """The template bound to these tools and system message (one template key)."""
        return Template(
            self.tokenizer,
            tools=tools,
            template_kwargs=self.template_kwargs,
            system=system,
            text=self._text,
        )

    def _profile_of_text(self, text: str) -> TemplateProfile:
        tpl = Template(
            self.tokenizer,
            tools=self.tools,
            template_kwargs=self.template_kwargs,
            system=None,
            text=text,
        )
        return self.profile(tpl)

    def probed(self, template: Template) -> TemplateProfile | None:
        """The probe's verdicts for `template`'s key if it was probed already (never probes)."""
        return self._profiles.get(template.key)

    def profile(self, template: Template) -> TemplateProfile:
        """The probe's verdicts for `template`'s key, probing on first use."""
        found = self._profiles.get(template.key)
        if found is None:
            with self._lock:
                found = self._profiles.get(template.key)
                if found is None:
                    found = self._profiles[template.key] = probe(template)
        return found

    def _delta(
        self,
        template: Template,
        profile: TemplateProfile,
        assistant: dict[str, Any],
        completion: list[int],
        new_messages: list[dict[str, Any]],
        kind: TransitionKind,
    ) -> list[int] | Fallback:
        """The incremental step (`incremental_delta`) for these inputs, remembered.

        The step reads nothing else (the synthetic context belongs to the key), so equal inputs
        give equal ids, and a group replaying one task, or a policy repeating a reply, renders
        each transition once. Inputs that are not plain data, or long, are never remembered.
        """
        shape = plain_key((assistant, new_messages))
        if shape is None or len(shape) > DELTA_MEMO_KEY_CHARS:
            return incremental_delta(template, profile, assistant, completion, new_messages, kind)
        key = (template.key, kind, tuple(completion), shape)
        found = self._deltas.get(key)
        if found is None:
            step = incremental_delta(template, profile, assistant, completion, new_messages, kind)
            found = tuple(step) if isinstance(step, list) else step
            self._deltas.put(key, found)
        return list(found) if isinstance(found, tuple) else found

    def statistics(self) -> RendererStatistics:
        """How often incremental steps and parses were served from memory."""
        parses = [p.statistics() for p in list(self._parsers.values())]
        return RendererStatistics(
            deltas=self._deltas.statistics(),
            parses=MemoStatistics(
                hits=sum(p.hits for p in parses),
                misses=sum(p.misses for p in parses),
                size=sum(p.size for p in parses),
            ),
        )

    def parser(self, tools: list[dict[str, Any]] | None) -> ResponseParser:
        """The response parser for these tools (cached).

        Raises:
            ConfigError: tools are offered and no response template is known.
        """
        key = json.dumps(tools, sort_keys=True, default=repr)
        found = self._parsers.get(key)
        if found is None:
            found = self._parsers[key] = ResponseParser.for_tokenizer(
                self.tokenizer,
                tools=tools,
                template_kwargs=self.template_kwargs,
                chat_template=self._text,
            )
        return found


class Conversation:
    """One episode's prompts. Not thread-safe: one task drives it.

    `prompt_ids` is a live list that grows in place as the conversation advances (that is what
    keeps a turn O(new tokens)); copy it to keep a snapshot, or better store `delta`.

    Example::

        conv = renderer.start([{"role": "user", "content": "hi"}])
        completion = await policy.sample(await conv.arender())
        parsed = conv.add_completion(completion.ids, completion.finish_reason)
        conv.add_messages([{"role": "tool", "name": "f", "content": "42"}])
        turn_delta = conv.delta  # ids added since prompt + completion, extends, fallback
    """

    def __init__(
        self,
        renderer: ChatRenderer,
        messages: Sequence[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
    ):
        if not messages:
            raise ConfigError("a conversation needs at least one message")
        self._renderer = renderer
        self._messages = [_checked_message(m) for m in messages]
        self._system = self._messages[0] if self._messages[0]["role"] == "system" else None
        self._tools = tools
        self._template = renderer.template(tools, self._system)
        self._parser: ResponseParser | None = None  # for these tools, looked up on first use
        self._turn = 0
        self._prompt: list[int] = []
        self._delta = PromptDelta([], False)
        self._dirty = True
        # State between a completion and the next prompt.
        self._base: list[int] | None = None
        self._base_len = 0
        self._completion: list[int] = []
        self._finish = "stop"
        self._assistant: dict[str, Any] = {}
        self._pending: list[dict[str, Any]] = []
        self._forced: Fallback | None = None
        self._transition_reasoning = False
        self._reasoning_since_user = _reasoning_since_user(self._messages)
        self.fallbacks: list[Fallback] = []
        """Every full re-render after the first prompt, with the turn it built and why."""

    @property
    def messages(self) -> list[dict[str, Any]]:
        """The history so far (parsed or given assistant turns included). Do not mutate."""
        return self._messages

    @property
    def tools(self) -> list[dict[str, Any]] | None:
        return self._tools

    @property
    def turn(self) -> int:
        """Index of the prompt being built: the number of completions added so far."""
        return self._turn

    @property
    def template_key(self) -> str:
        """sha256 of the template text, kwargs, tools and system message now in force."""
        return self._template.key

    @property
    def prompt_ids(self) -> list[int]:
        """The current prompt (rendered on first access after a change). A live list."""
        return self.render()

    @property
    def delta(self) -> PromptDelta:
        """How the current prompt relates to the previous turn, for compact recording."""
        self.render()
        return self._delta

    def render(self) -> list[int]:
        """Build the current prompt if a change is pending, and return it.

        Raises:
            TokenizationError: the template cannot render the conversation at all.
        """
        if not self._dirty:
            return self._prompt
        if self._base is None:
            ids = self._full_render()
            self._prompt, self._delta = ids, PromptDelta(list(ids), False)
        else:
            self._advance()
        self._dirty = False
        return self._prompt

    async def arender(self) -> list[int]:
        """`render`, with long renders in a worker thread so they never block the event loop.

        The incremental step is bounded (a short synthetic context and the new messages) and
        runs inline: a thread hand-off costs more than it does (bench/rollout_bench.py). A full
        render is O(history) and runs in a worker thread, except a short opening of a probed
        key, which only tokenizes what follows the system message.
        """
        if not self._dirty:
            return self._prompt
        if self._base is None:
            if self._short_opening():
                return self.render()
            return await anyio.to_thread.run_sync(self.render)
        outcome = self._incremental()
        if isinstance(outcome, list):
            self._advance(outcome)
        else:
            await anyio.to_thread.run_sync(self._advance, outcome)
        self._dirty = False
        return self._prompt

    def add_completion(
        self,
        completion_ids: Sequence[int],
        finish_reason: str = "stop",
        *,
        message: dict[str, Any] | None = None,
    ) -> ParsedResponse:
        """Record the sampled ids for the current prompt, verbatim.

        Args:
            completion_ids: what the sampler returned, stop token included.
            finish_reason: "stop" (a stop token was sampled), "length" or "abort" (no stop
                token: the template's close token is added to the next prompt, unmasked).
            message: the assistant message these ids stand for, when the caller already has
                it; else the ids are parsed with the template's response parser.

        Returns:
            The parsed turn (ill-formed output is data, not an exception).

        Raises:
            ConfigError: unknown finish reason, or tools offered with no response parser.
        """
        if finish_reason not in _FINISH_REASONS:
            raise ConfigError(
                f"finish_reason {finish_reason!r} is not one of {', '.join(_FINISH_REASONS)}"
            )
        prompt = self.render()
        ids = list(completion_ids)
        if message is None:
            parsed = self.parse(ids)
            message = parsed.to_message()
        else:
            message = _checked_message(message)
            if message["role"] != "assistant":
                raise ConfigError(f"a completion's message has role {message['role']!r}")
            parsed = ParsedResponse.from_message(message)
        base = prompt
        base.extend(ids)
        self._base, self._base_len = base, len(base)
        self._completion, self._finish, self._assistant = ids, finish_reason, message
        self._messages.append(message)
        self._pending = []
        self._forced = None
        self._turn += 1
        self._reasoning_since_user = self._reasoning_since_user or bool(
            message.get("reasoning_content")
        )
        self._transition_reasoning = self._reasoning_since_user
        self._dirty = True
        return parsed

    def parse(self, completion_ids: Sequence[int], *, prefix: bool = False) -> ParsedResponse:
        """Parse ids as a completion of the current prompt, without recording them: what
        `add_completion` would make of them.

        Args:
            prefix: the ids are the start of a completion still being sampled (the gateway
                streams what they show); their parse is not remembered.

        Raises:
            ConfigError: tools are offered with no response parser.
        """
        if self._parser is None:
            self._parser = self._renderer.parser(self._tools)
        return self._parser.parse(completion_ids, prompt_ids=self.render(), remember=not prefix)

    def add_messages(self, messages: Sequence[dict[str, Any]]) -> None:
        """Append non-assistant messages (tool results, user turns) for the next prompt."""
        checked = [_checked_message(m) for m in messages]
        for m in checked:
            if m["role"] == "assistant":
                raise ConfigError(
                    "assistant turns enter through add_completion, so their sampled ids are kept"
                )
            if m["role"] == "user":
                self._reasoning_since_user = False
        self._messages += checked
        self._pending += checked
        self._dirty = True

    def fork(self) -> Conversation:
        """An independent copy: advancing either leaves the other as it was.

        Why: a capture gateway answers a request that branches off a stored turn (a retry,
        a sub-agent, a token count) from that turn's state while the original goes on. The
        ids are copied, O(prompt), once per branch; nothing is re-rendered or re-tokenized.
        """
        other = copy.copy(self)
        other._messages = list(self._messages)
        other._pending = list(self._pending)
        other.fallbacks = list(self.fallbacks)
        if self._base is not None:
            other._base = list(self._base)
        other._prompt = other._base if self._prompt is self._base else list(self._prompt)
        return other

    def set_tools(self, tools: Sequence[Any] | None) -> None:
        """Change the tools offered from the next prompt on (a new template key: full render)."""
        schemas = tool_schemas(tools)
        template = self._renderer.template(schemas, self._system)
        if template.key != self._template.key and self._base is not None:
            self._forced = Fallback(self._turn, FallbackReason.KEY_CHANGED, "tools changed")
        self._tools, self._template, self._parser = schemas, template, None
        self._dirty = True

    def _advance(self, outcome: list[int] | Fallback | None = None) -> None:
        """Extend the prompt with a delta, or fully re-render and record why.

        `outcome` is what `_incremental` gave, when the caller already asked it.
        """
        if outcome is None:
            outcome = self._incremental()
        if self.fallbacks and self.fallbacks[-1].turn == self._turn:
            self.fallbacks.pop()  # messages arrived again before sampling: one fallback a turn
        assert self._base is not None
        if isinstance(outcome, list):
            del self._base[self._base_len :]
            self._base.extend(outcome)
            self._prompt, self._delta = self._base, PromptDelta(outcome, True)
            return
        fallback = Fallback(self._turn, outcome.reason, outcome.detail)
        ids = self._full_render()
        self.fallbacks.append(fallback)
        n = self._base_len
        if len(ids) >= n and ids[:n] == self._base[:n]:
            # The full render starts with the previous prompt + completion anyway (a template
            # that ignores the changed tools, a close marker BPE happened to keep whole): the
            # segment goes on. Only the render's cost was spent; sampled ids stay as sampled.
            delta = ids[n:]
            del self._base[n:]
            self._base.extend(delta)
            self._prompt, self._delta = self._base, PromptDelta(delta, True, fallback)
            return
        self._prompt, self._delta = ids, PromptDelta(list(ids), False, fallback)

    def _full_render(self) -> list[int]:
        """The whole prompt, equal to `apply_chat_template`; once the key is probed, the ids
        of the text the render shares with the probe's context (the system message and its
        tool schemas, usually) are reused instead of tokenized again."""
        profile = self._renderer.probed(self._template)
        if profile is None or not profile.splits:
            return self._template.render(self._messages, generation_prompt=True)
        text = self._template.text_of(self._messages, generation_prompt=True)
        return profile.encode_render(self._template, text)

    def _short_opening(self) -> bool:
        """Whether the first render is cheap enough to run inline: a probed key (only the
        opening messages get tokenized) and openings short enough that a thread hand-off
        would cost more than the render."""
        profile = self._renderer.probed(self._template)
        if profile is None or not profile.splits:
            return False
        size = 0
        for m in self._messages:
            content = m.get("content")
            size += len(content) if isinstance(content, str) else _INLINE_OPENING_CHARS
            if size > _INLINE_OPENING_CHARS:
                return False
        return True

    def _incremental(self) -> list[int] | Fallback:
        if self._forced is not None:
            return self._forced
        if any(is_multimodal(m) for m in (self._assistant, *self._pending)):
            return Fallback(self._turn, FallbackReason.MULTIMODAL, "non-text content")
        kind = classify(self._pending, self._transition_reasoning)
        if isinstance(kind, Fallback):
            return kind
        profile = self._renderer.profile(self._template)
        if profile.close_id is None:
            return Fallback(self._turn, FallbackReason.CLOSE_TOKEN, profile.close_detail)
        completion = self._completion
        if self._finish == "stop":
            if not completion or completion[-1] != profile.close_id:
                last = completion[-1] if completion else None
                return Fallback(
                    self._turn,
                    FallbackReason.NOT_CLOSED,
                    f"ended on id {last}, not the close token {profile.close_detail!r}",
                )
            appended: list[int] = []
        else:
            appended = [profile.close_id]
        verdict = profile.verdicts[kind]
        if not verdict.exact:
            assert verdict.reason is not None
            return Fallback(self._turn, verdict.reason, verdict.detail)
        delta = self._renderer._delta(
            self._template,
            profile,
            self._assistant,
            completion + appended if appended else completion,
            self._pending,
            kind,
        )
        if isinstance(delta, Fallback):
            return delta
        return appended + delta if appended else delta


def _checked_message(message: Any) -> dict[str, Any]:
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise ConfigError(f"a message must be a dict with a string 'role', got {message!r:.80}")
    return dict(message)


def _reasoning_since_user(messages: list[dict[str, Any]]) -> bool:
    """Whether an assistant turn after the last user message carried reasoning."""
    for m in reversed(messages):
        if m["role"] == "user":
            return False
        if m["role"] == "assistant" and m.get("reasoning_content"):
            return True
    return False
