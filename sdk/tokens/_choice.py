"""Which chat template a renderer samples with: the model's own, or TRL's training variant.

Why: a template that is not prefix-preserving (Qwen3 drops the non-thinking prefill and the
reasoning of earlier turns) makes every later turn a full render and a new training segment.
TRL ships `_training` variants that keep history as sampled; its GRPO trainer switches to
them when the model's template is not prefix-preserving. The renderer does the same by
default (`template="auto"`), and every guarantee of docs/tito.md then holds against the
template in use: sample with the template you train with.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, get_args

from .._exceptions import ConfigError
from ._probe import FallbackReason, TemplateProfile
from ._template import chat_template_text, template_hash, trl_template_name

__all__ = ["TemplateChoice", "TemplateMode", "choose_template", "not_preserving"]

log = logging.getLogger("plies.tokens")

TemplateMode = Literal["auto", "model", "training"]
"""`"auto"`: TRL's training variant when the model's template is not prefix-preserving and TRL
ships one, else the model's; `"model"`: always the model's; `"training"`: the variant, or
`ConfigError` when there is none."""

_MODES: tuple[str, ...] = get_args(TemplateMode)

_NOT_PRESERVING = frozenset(
    {
        FallbackReason.PREFILL_DROPPED,
        FallbackReason.REASONING_STRIPPED,
        FallbackReason.RERENDERED,
        FallbackReason.PROBE_FAILED,
    }
)
"""Probe findings that mean history re-renders differently (not vocabulary or coverage issues)."""


@dataclass(frozen=True)
class TemplateChoice:
    """The chat template a renderer uses, and why.

    Attributes:
        mode: what was asked for ("auto", "model" or "training").
        source: "model" (the tokenizer's own template) or "trl" (a TRL training variant).
        name: TRL's name for the template text in use ("qwen3_training"), or "model" when TRL
            does not know it.
        text: the template text every render uses (`chat_template=` of `apply_chat_template`).
        reason: why this template, in one sentence.
    """

    mode: str
    source: Literal["model", "trl"]
    name: str
    text: str
    reason: str

    @property
    def sha256(self) -> str:
        return template_hash(self.text)


@dataclass(frozen=True)
class _Variant:
    text: str | None
    """TRL's training variant, or None."""
    why_none: str = ""
    """When `text` is None: why there is no variant to switch to."""
    compatible: bool = False
    """TRL needs no variant: the model's template is training-compatible as it is."""


def training_variant(tokenizer: Any, model_text: str) -> _Variant:
    """TRL's training variant of `model_text`, chosen by TRL's `get_training_chat_template`."""
    from trl.chat_template_utils import get_training_chat_template

    own = tokenizer.chat_template
    default = own.get("default") if isinstance(own, dict) else own
    if default != model_text:
        return _Variant(None, "the template in use is a named variant TRL does not patch")
    try:
        text = get_training_chat_template(tokenizer)
    except ValueError as err:  # TRL: "patching is not supported for this template"
        return _Variant(None, f"TRL ships no training variant of it ({err})")
    except Exception as err:  # TRL's checks render the template; a template may refuse
        return _Variant(None, f"TRL's checks could not render it: {type(err).__name__}: {err}")
    if text is None:
        return _Variant(None, "it is prefix-preserving with generation markers", compatible=True)
    return _Variant(text)


def _trl_prefix_preserving(tokenizer: Any) -> bool | None:
    """TRL's own prefix-preservation check; None when the template cannot run it."""
    from trl.chat_template_utils import is_chat_template_prefix_preserving

    try:
        return bool(is_chat_template_prefix_preserving(tokenizer))
    except Exception as exc:  # e.g. a template that rejects the tool role: no evidence
        log.debug("TRL's prefix-preservation check could not run: %r", exc)
        return None


def not_preserving(profile: TemplateProfile) -> list[str]:
    """The probe's findings that history re-renders, as "kind: reason" strings."""
    found = []
    for kind, verdict in profile.verdicts.items():
        reasons = {str(verdict.reason)} if verdict.reason in _NOT_PRESERVING else set()
        reasons |= {r for r in verdict.local_fallbacks if r in _NOT_PRESERVING}
        found += [f"{kind}: {r}" for r in sorted(reasons)]
    return found


def choose_template(
    tokenizer: Any,
    mode: str,
    tools: list[dict[str, Any]] | None,
    profile_of: Callable[[str], TemplateProfile],
) -> TemplateChoice:
    """Decide the template for a renderer.

    Args:
        tokenizer: the model's tokenizer.
        mode: "auto", "model" or "training".
        tools: the renderer's tools (they can select a named template).
        profile_of: the probe's profile of a template text under the renderer's kwargs and
            tools (cached by the renderer, so a later conversation reuses it).

    Raises:
        ConfigError: an unknown mode, or "training" with no variant for this template.
    """
    if mode not in _MODES:
        raise ConfigError(f"template={mode!r} is not one of {', '.join(map(repr, _MODES))}")
    model_text = chat_template_text(tokenizer, tools)
    name = trl_template_name(model_text) or "model"
    if mode == "model":
        return TemplateChoice(mode, "model", name, model_text, "template='model' was asked for")
    if name.endswith("_training"):
        reason = "the model's template is TRL's training variant already"
        return TemplateChoice(mode, "model", name, model_text, reason)
    variant = training_variant(tokenizer, model_text)
    if variant.text is None:
        if mode == "training" and not variant.compatible:
            raise ConfigError(
                f"template='training': no training variant for the chat template "
                f"sha256:{template_hash(model_text)[:16]} ({name}): {variant.why_none}. Pass "
                "template='model' to sample with the model's own template."
            )
        reason = f"kept the model's template: {variant.why_none}"
        return TemplateChoice(mode, "model", name, model_text, reason)
    variant_name = trl_template_name(variant.text) or "trl_training"
    if mode == "training":
        return TemplateChoice(
            mode, "trl", variant_name, variant.text, "template='training' was asked for"
        )
    if _trl_prefix_preserving(tokenizer) is False:
        reason = "the model's template is not prefix-preserving (TRL's check)"
    else:
        findings = not_preserving(profile_of(model_text))
        if not findings:
            return TemplateChoice(
                mode, "model", name, model_text, "the model's template is prefix-preserving"
            )
        reason = "the probe found history re-rendered (" + "; ".join(findings) + ")"
    return TemplateChoice(mode, "trl", variant_name, variant.text, reason)
