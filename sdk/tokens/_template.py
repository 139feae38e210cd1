"""One chat template bound to a tokenizer: rendering to ids, template keys, the turn-close token.

Why keys: whether prompts may be built incrementally depends on the template text, its kwargs,
the tools and the system message (tools and system are often baked into the first turn), so
every verdict about a template is cached under the sha256 of all four.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from collections.abc import Sequence
from typing import Any

from transformers.utils.chat_template_utils import (
    _CONTROL_TOKEN_END,
    _CONTROL_TOKEN_START,
    _get_control_token_patterns,
    encode_marked_chat,
    mark_control_tokens,
)

from .._exceptions import ConfigError, TokenizationError

__all__ = ["Template", "chat_template_text", "template_hash", "trl_template_name"]

log = logging.getLogger("plies.tokens")


def chat_template_text(tokenizer: Any, tools: Sequence[Any] | None = None) -> str:
    """The template text `apply_chat_template` would use for these tools.

    Raises:
        ConfigError: the tokenizer has no chat template.
    """
    try:
        text = tokenizer.get_chat_template(None, list(tools) if tools else None)
    except ValueError as err:
        raise ConfigError(f"tokenizer has no usable chat template: {err}") from err
    if not isinstance(text, str) or not text:
        raise ConfigError("tokenizer has no chat template")
    return text


def template_hash(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def trl_template_name(text: str) -> str | None:
    """TRL's name for this exact template text ("qwen3", "qwen3_training"), if TRL ships it."""
    from trl import chat_template_utils as ctu

    suffix = "_chat_template"
    for name, value in vars(ctu).items():
        if name.endswith(suffix) and value == text:
            return name.removesuffix(suffix)
    return None


def tool_schemas(tools: Sequence[Any] | None) -> list[dict[str, Any]] | None:
    """Tools as JSON schemas (callables converted the way transformers does), or None."""
    if not tools:
        return None
    from transformers.utils import get_json_schema

    return [t if isinstance(t, dict) else get_json_schema(t) for t in tools]


class Template:
    """A tokenizer, one template text, kwargs, tools and system message: one template key.

    `text` is the template in use (a TRL training variant, say); by default the tokenizer's.

    Renders are exactly `apply_chat_template(..., tokenize=True, return_dict=False,
    sanitize_control_tokens=True)`, the definition of a correct prompt; failures become
    `TokenizationError` naming the key.

    Control-token text in content is plain text (docs/tito.md, "Control tokens in content"):
    a tool result or a web page that contains `<|im_end|>` must not close the turn it sits
    in. Every string of the messages, tools and template variables is marked where it holds
    a control token (transformers' `mark_control_tokens`: the tokenizer's special tokens and
    the added tokens the template writes), so the rendered text carries the marks, and
    `encode` tokenizes a marked token as the characters it is made of. Marking is per
    string, so the incremental step marks only its own messages: the tools and template
    variables belong to the key and are marked once, here (an agent's tool schemas run to
    tens of kilobytes, and every turn renders them).
    """

    def __init__(
        self,
        tokenizer: Any,
        *,
        tools: list[dict[str, Any]] | None,
        template_kwargs: dict[str, Any],
        system: dict[str, Any] | None,
        text: str | None = None,
    ):
        self.tokenizer = tokenizer
        self.tools = tools
        self.kwargs = template_kwargs
        self.system = system
        self.text = chat_template_text(tokenizer, tools) if text is None else text
        payload = json.dumps(
            {"template": self.text, "kwargs": template_kwargs, "tools": tools, "system": system},
            sort_keys=True,
            default=repr,
        )
        self.key = hashlib.sha256(payload.encode("utf-8")).hexdigest()
        fast = getattr(tokenizer, "is_fast", False) and not getattr(
            tokenizer, "split_special_tokens", False
        )
        self._backend: Any = getattr(tokenizer, "backend_tokenizer", None) if fast else None
        self._control = _control_tokens(tokenizer, self.text)
        # Marked once: transformers copies what the template sees, so these are never changed.
        self._marked_tools = mark_control_tokens(tools, self._control)
        self._marked_kwargs = mark_control_tokens(template_kwargs, self._control)

    def render(self, messages: Sequence[dict[str, Any]], *, generation_prompt: bool) -> list[int]:
        """Token ids of `messages`, as `apply_chat_template` gives them (control tokens in
        content sanitized).

        Raises:
            TokenizationError: the template could not render these messages.
        """
        return self.encode(self.text_of(messages, generation_prompt=generation_prompt))

    def render_text(
        self, messages: Sequence[dict[str, Any]], *, generation_prompt: bool
    ) -> str | None:
        """Rendered text, or None if the template refuses (only used to discover markers)."""
        try:
            return self.text_of(messages, generation_prompt=generation_prompt)
        except TokenizationError as exc:  # discovery tolerates any failure, reports it elsewhere
            log.debug("chat template key %s refused a discovery render: %r", self.key[:12], exc)
            return None

    def text_of(self, messages: Sequence[dict[str, Any]], *, generation_prompt: bool) -> str:
        """The text `render` tokenizes: the incremental step tokenizes only its tail.

        Raises:
            TokenizationError: the template could not render these messages.
        """
        text = self._apply(messages, generation_prompt)
        if not isinstance(text, str):
            raise TokenizationError(
                f"chat template key {self.key[:12]}: apply_chat_template returned "
                f"{type(text).__name__}, not text"
            )
        return text

    def encode(self, text: str) -> list[int]:
        """Ids of `text` as `render` tokenizes a rendered chat (no special tokens added).

        A fast tokenizer's backend is called directly, as `render` ends up calling it, while it
        is set as `render` sets it (no truncation, no padding, special tokens matched): the
        wrapper costs as much as encoding a short delta. Otherwise (a caller left truncation
        or padding on the shared backend, a slow tokenizer) the wrapper is called, which sets
        the backend the way `render` does. Whoever splits a render relies on this agreeing
        with `render`, and checks it (`plies.tokens._probe.find_splits`). Text that carries
        control-token marks (`text_of` of content holding one) is encoded by transformers'
        `encode_marked_chat`: each marked token as plain text, the rest as above.
        """
        if _CONTROL_TOKEN_START in text or _CONTROL_TOKEN_END in text:
            return encode_marked_chat(self.tokenizer, text)
        backend = self._backend
        if (
            backend is not None
            and backend.truncation is None
            and backend.padding is None
            and not backend.encode_special_tokens
        ):
            return backend.encode(text, add_special_tokens=False).ids
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def _apply(self, messages: Sequence[dict[str, Any]], generation_prompt: bool) -> Any:
        marks = self._control
        try:
            return self.tokenizer.apply_chat_template(
                [mark_control_tokens(dict(m), marks) for m in messages],
                tools=self._marked_tools,
                chat_template=self.text,
                add_generation_prompt=generation_prompt,
                tokenize=False,
                return_dict=False,
                **self._marked_kwargs,
            )
        except Exception as err:  # jinja, TypeError, template raise_exception: all one failure
            roles = ",".join(str(m.get("role")) for m in messages[-4:])
            raise TokenizationError(
                f"chat template key {self.key[:12]} could not render {len(messages)} messages "
                f"(last roles {roles}): {type(err).__name__}: {err}"
            ) from err


def _control_tokens(tokenizer: Any, template_text: str) -> re.Pattern[str]:
    """What counts as a control token in content: what `apply_chat_template(...,
    sanitize_control_tokens=True)` counts (the special tokens, `chat_control_tokens`, else
    the added tokens the template's text writes), as one regex."""
    chosen = tokenizer._get_control_tokens(template_text)  # transformers' own rule
    return _get_control_token_patterns(tuple(chosen))[0]
