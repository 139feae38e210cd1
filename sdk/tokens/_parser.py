"""Sampled ids to an assistant message, with the response template the chat template implies.

Why a template lookup instead of a regex: a wrong parser reports "no tool calls" without
failing (Qwen3 JSON vs Qwen3.5 XML look alike). The response template is chosen by the exact
chat template text: the tokenizer's own `response_template` when it ships one, else the one
TRL associates with that text. There is no guessing: offering tools to a template with no
known response template is a `ConfigError`.
"""

from __future__ import annotations

import dataclasses
import logging
import types
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from .._exceptions import ConfigError
from ._memo import Memo, MemoStatistics, copy_plain, is_plain
from ._template import chat_template_text, template_hash

__all__ = ["ParsedResponse", "ResponseParser"]

log = logging.getLogger("plies.tokens")

_PREFIX_TOKENS = 64
"""How many trailing prompt tokens the parser sees: enough for any generation prompt and prefill,
and a bound that keeps parsing O(completion) however long the history is."""
PARSE_MEMO_SIZE = 1024
"""Parsed completions a parser remembers (`ResponseParser.statistics`)."""
PARSE_MEMO_IDS = 256
"""Completions longer than this are parsed every time: long ones rarely repeat, and this
bounds the memo's memory."""


@dataclass(frozen=True)
class ParsedResponse:
    """An assistant turn as parsed from sampled ids.

    Attributes:
        content: the visible answer ("" when there is none).
        reasoning: the thinking text, or None when the turn had none.
        tool_calls: OpenAI-shaped calls as chat templates read them:
            `{"type": "function", "function": {"name": str, "arguments": dict}}`.
        ill_formed: the ids did not parse; `content` then holds the raw decoded text.
        error: why parsing failed, when it did.
    """

    content: str
    reasoning: str | None = None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    ill_formed: bool = False
    error: str | None = None

    def to_message(self) -> dict[str, Any]:
        """The assistant message dict that a chat template renders back into this turn."""
        message: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.reasoning is not None:
            message["reasoning_content"] = self.reasoning
        if self.tool_calls:
            message["tool_calls"] = [dict(call) for call in self.tool_calls]
        return message

    @classmethod
    def from_message(cls, message: dict[str, Any]) -> ParsedResponse:
        """Wrap an assistant message that the caller already holds (e.g. a gateway request)."""
        return cls(
            content=message.get("content") or "",
            reasoning=message.get("reasoning_content"),
            tool_calls=list(message.get("tool_calls") or []),
        )


class ResponseParser:
    """Parses completions of one tokenizer and chat template; never raises on model output.

    Build it with `ResponseParser.for_tokenizer(tokenizer, tools=...)`. The tokenizer is not
    modified: the response template is kept on the parser and passed to
    `tokenizer.parse_response` on each call.
    """

    def __init__(
        self,
        tokenizer: Any,
        response_template: dict[str, Any] | None,
        *,
        source: str,
        template_key: str,
        default_prefix: str,
        tools: Sequence[dict[str, Any]] | None = None,
    ):
        self._tokenizer = tokenizer
        self._template = response_template
        # Compiled once: `parse_response` compiles a dict template's regexes on every call.
        self._schema = _compiled(response_template)
        self._tools = list(tools) if tools else None
        self._default_prefix = default_prefix
        self._memo: Memo[ParsedResponse] = Memo(PARSE_MEMO_SIZE)
        self.source = source
        """Where the response template came from: "tokenizer", "trl" or "none"."""
        self.template_key = template_key
        """sha256 of the chat template text the parser was chosen for."""

    @classmethod
    def for_tokenizer(
        cls,
        tokenizer: Any,
        *,
        tools: Sequence[dict[str, Any]] | None = None,
        template_kwargs: dict[str, Any] | None = None,
        chat_template: str | None = None,
    ) -> ResponseParser:
        """Choose the response template for `tokenizer`'s chat template.

        Args:
            tokenizer: a transformers tokenizer with a chat template.
            tools: the tools that will be offered. With tools and no known response template
                the parser refuses to exist rather than miss tool calls silently.
            template_kwargs: chat template kwargs (e.g. `enable_thinking=False`), used to find
                the generation prompt prefill when `parse` gets no prompt.
            chat_template: the template text prompts are rendered with, when it is not the
                tokenizer's own (a TRL training variant).

        Raises:
            ConfigError: tools are offered and no response template is known for the template.
        """
        text = chat_template_text(tokenizer, tools) if chat_template is None else chat_template
        digest = template_hash(text)
        own = getattr(tokenizer, "response_template", None)
        if own is not None:
            template, source = own, "tokenizer"
        else:
            template, source = _trl_response_template(text), "trl"
            if template is None:
                source = "none"
        if template is None and tools:
            raise ConfigError(
                f"no response template is known for chat template sha256:{digest[:16]}, and tools "
                "are offered: tool calls could not be parsed. Set `tokenizer.response_template` "
                "(see transformers' response parsing docs) or use a template TRL knows."
            )
        return cls(
            tokenizer,
            template,
            source=source,
            template_key=digest,
            default_prefix=_generation_prompt(tokenizer, text, template_kwargs or {}),
            tools=tools,
        )

    @property
    def has_schema(self) -> bool:
        """Whether tool calls and reasoning are parsed; without it only text comes back."""
        return self._template is not None

    def parse(
        self,
        completion_ids: Sequence[int],
        prompt_ids: Sequence[int] | None = None,
        *,
        remember: bool = True,
    ) -> ParsedResponse:
        """Parse sampled ids into content, reasoning and tool calls.

        Args:
            completion_ids: the sampled ids, stop token included or not.
            prompt_ids: the prompt they continue. Only its last tokens are read, to see a
                generation-prompt prefill (`<think>\\n\\n</think>\\n\\n`, `<think>\\n`). Without
                it, the template's usual generation prompt is assumed.
            remember: keep the parse for a repeat of these ids (False for ids that will not
                come again, such as the start of a completion being streamed).

        Returns:
            The parsed turn; on failure the raw text with `ill_formed=True`. The parse of
            short ids seen recently after the same prompt tail is remembered, and each caller gets
            its own copy of the tool calls.
        """
        ids = list(completion_ids)
        if self._template is None:
            return ParsedResponse(content=self._plain_text(ids))
        if len(ids) > PARSE_MEMO_IDS or not remember:
            return self._parse(ids, prompt_ids)
        tail = tuple(prompt_ids[-_PREFIX_TOKENS:]) if prompt_ids is not None else None
        key = (tuple(ids), tail)
        found = self._memo.get(key)
        if found is None:
            found = self._parse(ids, prompt_ids)
            if not is_plain(found.tool_calls):
                return found
            self._memo.put(key, found)
        return dataclasses.replace(found, tool_calls=copy_plain(found.tool_calls))

    def statistics(self) -> MemoStatistics:
        """How often parses were served from memory."""
        return self._memo.statistics()

    def _parse(self, ids: list[int], prompt_ids: Sequence[int] | None) -> ParsedResponse:
        tokenizer = self._tokenizer
        try:
            # Decoded here as `parse_response` would decode them, so it gets text to parse.
            text = tokenizer.decode(ids)
            prefix = (
                tokenizer.decode(list(prompt_ids[-_PREFIX_TOKENS:]))
                if prompt_ids is not None
                else self._default_prefix
            )
            parsed = tokenizer.parse_response(
                text, schema=self._schema, prefix=prefix, tools=self._tools
            )
            if not isinstance(parsed, dict):
                raise ValueError(f"parser returned {type(parsed).__name__}, not a message")
            return _checked(parsed, self._tokenizer.eos_token)
        except Exception as err:  # any parser failure is data about the sample, not a crash
            return ParsedResponse(
                content=self._tokenizer.decode(ids, skip_special_tokens=True),
                ill_formed=True,
                error=f"{type(err).__name__}: {err}",
            )

    def _plain_text(self, ids: list[int]) -> str:
        if ids and ids[-1] in _stop_ids(self._tokenizer):
            ids = ids[:-1]
        return self._tokenizer.decode(ids, skip_special_tokens=False)


def _checked(parsed: dict[str, Any], eos: str | None) -> ParsedResponse:
    content = parsed.get("content") or ""
    if not isinstance(content, str):
        raise ValueError(f"content is {type(content).__name__}, not text")
    if eos:
        content = content.removesuffix(eos)
    reasoning = parsed.get("reasoning_content", parsed.get("thinking"))
    if reasoning is not None and not isinstance(reasoning, str):
        raise ValueError(f"reasoning is {type(reasoning).__name__}, not text")
    calls = parsed.get("tool_calls") or []
    if not isinstance(calls, list):
        raise ValueError("tool_calls is not a list")
    checked = []
    for i, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise ValueError(f"tool call {i} has no function name")
        arguments = function.get("arguments")
        if arguments is None:
            arguments = {}
        if not isinstance(arguments, dict | str):
            raise ValueError(f"tool call {i} arguments are {type(arguments).__name__}")
        checked.append(
            {"type": "function", "function": {"name": function["name"], "arguments": arguments}}
        )
    return ParsedResponse(content=content, reasoning=reasoning, tool_calls=checked)


def _compiled(template: dict[str, Any] | None) -> Any:
    """The response template compiled for transformers' parser, or as given when it cannot be
    (an invalid template then fails each parse, as ill-formed output, exactly as before)."""
    if template is None:
        return None
    try:
        from transformers.utils.chat_parsing.response_templates import load_response_template

        return load_response_template(template)
    except (ImportError, ValueError, TypeError, KeyError) as exc:
        log.debug("response template kept uncompiled: %r", exc)
        return template


def _trl_response_template(text: str) -> dict[str, Any] | None:
    """TRL's response template for this exact chat template text, without touching a tokenizer.

    TRL's `_training` variants (prefix-preserving, what RL should sample with) emit the same
    assistant format as the template they patch, so they get that template's response template.
    """
    from trl import chat_template_utils as ctu

    for candidate in (text, _original_of_training_variant(ctu, text)):
        if candidate is None:
            continue
        holder = types.SimpleNamespace(chat_template=candidate, response_template=None)
        try:
            ctu.add_response_schema(holder)
        except ValueError:
            continue
        return holder.response_template
    return None


def _original_of_training_variant(ctu: Any, text: str) -> str | None:
    suffix = "_training_chat_template"
    for name, value in vars(ctu).items():
        if name.endswith(suffix) and value == text:
            return getattr(ctu, name.removesuffix(suffix) + "_chat_template", None)
    return None


def _generation_prompt(tokenizer: Any, text: str, kwargs: dict[str, Any]) -> str:
    """The text a bare one-user-message prompt ends with; "" if the template cannot say."""
    try:
        return tokenizer.apply_chat_template(
            [{"role": "user", "content": "x"}],
            chat_template=text,
            tokenize=False,
            add_generation_prompt=True,
            **kwargs,
        )
    except Exception as exc:  # an unrenderable template only loses the prefill hint
        log.debug("the chat template cannot render a generation prompt: %r", exc)
        return ""


def _stop_ids(tokenizer: Any) -> set[int]:
    ids = {tokenizer.eos_token_id, tokenizer.pad_token_id}
    return {i for i in ids if i is not None}
