"""The incremental step and the probe that decides, per template key, when it may be trusted.

The step: after an assistant turn A (sampled as `completion`) and new messages M, render
`context + [A] + M` with a generation prompt, where `context` is a short synthetic history
(the real system message, one synthetic user message). Cut at the first turn-close token
after the context's own prompt: what follows is the delta. Before trusting it, check locally
that the rendered A equals the sampled completion token for token; else report why not.

Only the tail of that render is tokenized: from the last added token of the context's own
prompt on (`Split`). A fast tokenizer cuts its input at every added token before it runs the
pre-tokenizer and the model on the pieces between, so the ids of a text that begins with the
context's prompt are the context's ids up to the cut plus the ids of the tail alone, provided
no other added token can match across the cut (checked per vocabulary) and the cut tokenizes
that way on the context itself (checked per key). Tokenizing the system message and its tool
schemas every turn, to cut them away again, was most of a turn's cost.

The probe: run synthetic episodes (tool rounds, parallel calls, reasoning, new user turns)
through that same step and compare every result with a full `apply_chat_template` render.
A transition kind on which the step ever produced a wrong prompt is never taken
incrementally for that key. The step's local checks catch what concerns the newest turn;
the probe catches templates that re-render older turns (reasoning stripped from history,
counters, moved tool blocks).
"""

from __future__ import annotations

import bisect
import json
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Any

from .._exceptions import TokenizationError
from ._parser import ParsedResponse
from ._template import Template

__all__ = [
    "Fallback",
    "FallbackReason",
    "KindVerdict",
    "Split",
    "TemplateProfile",
    "TransitionKind",
    "classify",
    "find_splits",
    "incremental_delta",
    "probe",
]


class TransitionKind(StrEnum):
    """What arrived after an assistant turn; the probe judges each kind separately."""

    TOOL_ROUND = "tool_round"
    """Only tool results."""
    USER_TURN = "user_turn"
    """A user message, no reasoning since the previous user message."""
    USER_TURN_AFTER_REASONING = "user_turn_after_reasoning"
    """A user message after assistant turns that carried reasoning (Qwen3 strips it)."""


class FallbackReason(StrEnum):
    """Why a prompt was fully re-rendered instead of extended (and a new segment starts)."""

    KEY_CHANGED = "key_changed"
    """Tools or the system message changed mid-episode."""
    CLOSE_TOKEN = "close_token_not_atomic"
    """The turn-close marker is not one added token here: BPE could merge across the cut."""
    NOT_CLOSED = "completion_not_closed"
    """The completion stopped on a token other than the template's turn-close token."""
    PREFILL_DROPPED = "prefill_dropped"
    """The generation prompt (or its prefill) is not kept when the turn is in history."""
    REASONING_STRIPPED = "reasoning_stripped"
    """The template drops reasoning from earlier assistant turns on a new user turn."""
    RERENDERED = "assistant_rerendered"
    """The template renders the assistant turn differently once messages follow it."""
    NONCANONICAL = "noncanonical_completion"
    """The sampled ids are not the template's rendering of the parsed message."""
    PROBE_FAILED = "probe_failed"
    """The probe saw the incremental path give a wrong prompt for this transition kind."""
    UNPROBED = "unprobed"
    """The probe cannot vouch for this transition (roles it did not cover, no messages)."""
    MULTIMODAL = "multimodal"
    """A message carries non-text content."""
    RENDER_ERROR = "render_error"
    """The synthetic render failed; the full render decides whether the template can cope."""


@dataclass(frozen=True)
class Fallback:
    """One full re-render: the turn whose prompt it built, and why."""

    turn: int
    reason: FallbackReason
    detail: str = ""

    def __str__(self) -> str:
        return f"{self.reason}: {self.detail}" if self.detail else str(self.reason)


@dataclass(frozen=True)
class KindVerdict:
    """The probe's finding for one transition kind under one template key."""

    kind: TransitionKind
    exact: bool
    """Whether the incremental path (with its local checks) may be used for this kind."""
    reason: FallbackReason | None = None
    detail: str = ""
    incremental: int = 0
    """Probe transitions of this kind that were extended incrementally (and matched)."""
    total: int = 0
    """Probe transitions of this kind that rendered at all."""
    local_fallbacks: dict[str, int] = field(default_factory=dict)
    """Why the local checks refused the others, counted by reason."""


@dataclass(frozen=True)
class Split:
    """A cut in the context's prompt text where a render may be tokenized in two halves.

    Every text that starts with `prefix` tokenizes as `ids_before` + the ids of the text from
    `at` on: `at` is where an added token starts (one no other added token can overlap), and
    `prefix` runs to that token's end, so a text with this prefix matches the same token there.
    """

    at: int
    """Position in the context's prompt text where the added token starts."""
    prefix: str
    """The context's prompt text up to the end of that token."""
    ids_before: int
    """How many of the context's prompt ids come before the cut."""


@dataclass(frozen=True)
class TemplateProfile:
    """Everything the renderer knows about one template key, computed once."""

    key: str
    close_id: int | None
    """The turn-close token id, when it is a single added token."""
    close_detail: str
    """Which marker was found, or why none was usable."""
    context: tuple[dict[str, Any], ...]
    context_prompt: tuple[int, ...]
    """Ids of `context` with the generation prompt: every synthetic render starts with them."""
    verdicts: dict[TransitionKind, KindVerdict]
    context_text: str = ""
    """The text of `context` with the generation prompt ("" when it did not render)."""
    splits: tuple[Split, ...] = ()
    """Verified cuts in `context_text`, last first; empty: tokenize every render whole."""

    def encode_render(self, template: Template, text: str) -> list[int]:
        """Ids of `text`, a render of this key, reusing the context's ids where it shares them.

        Equal to `template.encode(text)`; only the part after the last cut `text` shares with
        the context's prompt is tokenized (the whole text when it shares none).
        """
        for split in self.splits:
            if text.startswith(split.prefix):
                return [
                    *self.context_prompt[: split.ids_before],
                    *template.encode(text[split.at :]),
                ]
        return template.encode(text)


_USER = "Plies probe question."
_ANSWER = "Plies probe answer."
_FOLLOW = "Plies probe follow-up."
_REASONING = "Plies probe reasoning about the question."


def classify(
    new_messages: Sequence[dict[str, Any]], reasoning_since_user: bool
) -> TransitionKind | Fallback:
    """The kind of transition `new_messages` make, or why the probe cannot vouch for it."""
    if not new_messages:
        return Fallback(-1, FallbackReason.UNPROBED, "no new messages after the completion")
    roles = {m.get("role") for m in new_messages}
    if roles == {"tool"}:
        return TransitionKind.TOOL_ROUND
    if roles <= {"tool", "user"}:
        if reasoning_since_user:
            return TransitionKind.USER_TURN_AFTER_REASONING
        return TransitionKind.USER_TURN
    extra = sorted(str(r) for r in roles - {"tool", "user"})
    return Fallback(-1, FallbackReason.UNPROBED, f"role(s) {extra} mid-episode are not probed")


def is_multimodal(message: dict[str, Any]) -> bool:
    content = message.get("content")
    if isinstance(content, list):
        return any(not (isinstance(p, dict) and p.get("type") == "text") for p in content)
    return content is not None and not isinstance(content, str)


def incremental_delta(
    template: Template,
    profile: TemplateProfile,
    assistant: dict[str, Any],
    completion: Sequence[int],
    new_messages: Sequence[dict[str, Any]],
    kind: TransitionKind,
) -> list[int] | Fallback:
    """The ids that follow `completion` (close token included), or why they cannot be trusted.

    Cost: one text render of the bounded context plus the new turn and messages, and
    tokenizing what follows the context's last cut: O(new tokens).
    """
    assert profile.close_id is not None
    messages = [*profile.context, assistant, *new_messages]
    n = len(profile.context_prompt)
    try:
        if profile.splits:
            text = template.text_of(messages, generation_prompt=True)
            split = profile.splits[0]
            if not text.startswith(profile.context_text):
                return _prefill_dropped()
            # Only the tail is tokenized; `ids` holds the context's ids before the cut.
            ids = template.encode(text[split.at :])
            n -= split.ids_before
            if ids[:n] != list(profile.context_prompt[split.ids_before :]):
                return _prefill_dropped()
        else:
            ids = template.render(messages, generation_prompt=True)
            if tuple(ids[:n]) != profile.context_prompt:
                return _prefill_dropped()
    except TokenizationError as err:
        return Fallback(-1, FallbackReason.RENDER_ERROR, str(err))
    try:
        cut = ids.index(profile.close_id, n) + 1
    except ValueError:
        return Fallback(-1, FallbackReason.RERENDERED, "no close token after the assistant turn")
    if ids[n:cut] != list(completion):
        return _why_differs(template, profile, assistant, completion, kind)
    return ids[cut:]


def _prefill_dropped() -> Fallback:
    return Fallback(
        -1,
        FallbackReason.PREFILL_DROPPED,
        "the generation prompt is not kept when the assistant turn sits in history",
    )


def _why_differs(
    template: Template,
    profile: TemplateProfile,
    assistant: dict[str, Any],
    completion: Sequence[int],
    kind: TransitionKind,
) -> Fallback:
    """Tell a template that re-renders history from a sample the template would not produce."""
    n = len(profile.context_prompt)
    try:
        alone = template.render([*profile.context, assistant], generation_prompt=False)
        end = alone.index(profile.close_id, n) + 1 if profile.close_id in alone[n:] else None
    except TokenizationError:
        end = None
    if end is not None and alone[n:end] == list(completion):
        if kind is TransitionKind.USER_TURN_AFTER_REASONING and assistant.get("reasoning_content"):
            return Fallback(
                -1,
                FallbackReason.REASONING_STRIPPED,
                "the template drops this turn's reasoning once a user message follows",
            )
        return Fallback(
            -1,
            FallbackReason.RERENDERED,
            f"the template renders the assistant turn differently once {kind} follows",
        )
    return Fallback(
        -1,
        FallbackReason.NONCANONICAL,
        "the sampled ids differ from the template's rendering of the parsed message",
    )


def find_close_token(template: Template, context: list[dict[str, Any]]) -> tuple[int | None, str]:
    """The added token that closes an assistant turn, or why there is no usable one."""
    text = template.render_text(
        [*context, {"role": "assistant", "content": _ANSWER}, {"role": "user", "content": _FOLLOW}],
        generation_prompt=True,
    )
    if text is None or _ANSWER not in text:
        return None, "the template could not render a plain user/assistant/user exchange"
    after = text[text.rindex(_ANSWER) + len(_ANSWER) :].lstrip(" \t")
    added = template.tokenizer.get_added_vocab()
    matches = [tok for tok in added if tok and after.startswith(tok)]
    if not matches:
        return None, (
            f"the marker after an assistant turn ({after[:24]!r}) is not a single added token "
            "of this vocabulary, so BPE could merge across the cut"
        )
    token = max(matches, key=len)
    return added[token], token


def find_splits(template: Template, text: str, ids: Sequence[int]) -> tuple[Split, ...]:
    """The cuts in `text` (a render whose ids are `ids`) where the tail tokenizes alone.

    A cut sits where an added token starts that the vocabulary lets no other added token
    overlap, and is kept only when the text on each side of it tokenizes alone to exactly
    its part of `ids` (so the encoder agrees with the renderer's, split-special-tokens
    settings and all). Last cut first. Empty for slow tokenizers, whose splitting is not
    the backend's.
    """
    if not text or not ids or not getattr(template.tokenizer, "is_fast", False):
        return ()
    safe = _splittable(template.tokenizer)
    starts = sorted({(i, token) for token in safe for i in _occurrences(text, token)}, reverse=True)
    splits = []
    for at, token in starts[:_MAX_CUTS]:
        tail = template.encode(text[at:])
        before = len(ids) - len(tail)
        if (
            tail
            and before >= 0
            and list(ids[before:]) == tail
            and template.encode(text[:at]) == list(ids[:before])
        ):
            splits.append(Split(at, text[: at + len(token)], before))
    return tuple(splits)


_MAX_CUTS = 8
"""Cuts tried per key, last first: the incremental step uses the last, a first render the
one before its first message after the system turn; each try tokenizes the context once."""


def _occurrences(text: str, token: str) -> list[int]:
    found, i = [], text.find(token)
    while i >= 0:
        found.append(i)
        i = text.find(token, i + 1)
    return found


def _splittable(tokenizer: Any) -> set[str]:
    """Added tokens a text may be cut before: matched verbatim, and never part of a longer or
    overlapping match of another added token (leftmost-longest matching would prefer it)."""
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    tokens = [t for t in decoder.values() if getattr(t, "content", "")]
    contents = sorted({t.content for t in tokens})
    by_char: dict[str, list[tuple[str, int]]] = {}
    for c in contents:
        for j in range(1, len(c)):
            by_char.setdefault(c[j], []).append((c, j))
    safe = set()
    for t in tokens:
        s = t.content
        if t.normalized or t.lstrip or t.rstrip or t.single_word:
            continue
        k = bisect.bisect_right(contents, s)
        if k < len(contents) and contents[k].startswith(s):
            continue  # a longer added token starts with this one
        if any(c[j:].startswith(s) or s.startswith(c[j:]) for c, j in by_char.get(s[0], ())):
            continue  # another added token could match across the cut
        safe.add(s)
    return safe


def probe(template: Template) -> TemplateProfile:
    """Run the synthetic episodes for one template key and return its profile."""
    context: list[dict[str, Any]] = [{"role": "user", "content": _USER}]
    if template.system is not None:
        context.insert(0, template.system)
    close_id, close_detail = find_close_token(template, context)
    try:
        context_prompt = tuple(template.render(context, generation_prompt=True))
        context_text = template.text_of(context, generation_prompt=True)
    except TokenizationError as err:
        close_id, close_detail, context_prompt, context_text = None, str(err), (), ""
    base = TemplateProfile(
        template.key,
        close_id,
        close_detail,
        tuple(context),
        context_prompt,
        {},
        context_text,
        find_splits(template, context_text, context_prompt),
    )
    if close_id is None:
        reason = FallbackReason.CLOSE_TOKEN
        verdicts = {k: KindVerdict(k, False, reason, close_detail) for k in TransitionKind}
        return replace(base, verdicts=verdicts)
    tally = _Tally()
    for episode in _episodes(template):
        _run_episode(template, base, context, episode, tally)
    return replace(base, verdicts=tally.verdicts())


class _Tally:
    def __init__(self) -> None:
        self.total = {k: 0 for k in TransitionKind}
        self.incremental = {k: 0 for k in TransitionKind}
        self.local: dict[TransitionKind, dict[str, int]] = {k: {} for k in TransitionKind}
        self.wrong: dict[TransitionKind, str] = {}
        self.errors: dict[TransitionKind, str] = {}

    def verdicts(self) -> dict[TransitionKind, KindVerdict]:
        out = {}
        for k in TransitionKind:
            common = {
                "incremental": self.incremental[k],
                "total": self.total[k],
                "local_fallbacks": self.local[k],
            }
            if k in self.wrong:
                reason = (
                    FallbackReason.REASONING_STRIPPED
                    if k is TransitionKind.USER_TURN_AFTER_REASONING
                    else FallbackReason.PROBE_FAILED
                )
                out[k] = KindVerdict(k, False, reason, self.wrong[k], **common)
            elif self.total[k] == 0:
                detail = self.errors.get(k, "no probe episode reached this transition")
                out[k] = KindVerdict(k, False, FallbackReason.UNPROBED, detail, **common)
            elif self.incremental[k] == 0:
                # Every varied transition of this kind was refused by the local checks: the
                # refusal belongs to the key, so the renderer goes straight to the full render
                # instead of paying a synthetic render per turn to be refused again.
                local = self.local[k]
                reason = FallbackReason(max(sorted(local), key=local.__getitem__))
                detail = f"the probe's {self.total[k]} transitions of this kind all fell back"
                out[k] = KindVerdict(k, False, reason, f"{detail} ({local})", **common)
            else:
                out[k] = KindVerdict(k, True, **common)
        return out


def _call(name: str, arguments: dict[str, Any], as_text: bool) -> dict[str, Any]:
    args: Any = json.dumps(arguments) if as_text else arguments
    return {"type": "function", "function": {"name": name, "arguments": args}}


def _episodes(template: Template) -> list[list[tuple[dict[str, Any], list[dict[str, Any]]]]]:
    """Synthetic (assistant turn, new messages) scripts; tool names follow the real tools."""
    names = [t.get("function", t).get("name", "probe_tool") for t in template.tools or []]
    a, b = [*names, "probe_lookup", "probe_fetch"][:2]

    def tool(name: str, text: str) -> dict[str, Any]:
        return {"role": "tool", "name": name, "content": text}

    def assistant(content: str = "", reasoning: str | None = None, calls=None) -> dict[str, Any]:
        return ParsedResponse(content, reasoning, calls or []).to_message()

    def user(text: str) -> dict[str, Any]:
        return {"role": "user", "content": text}

    episodes = []
    for as_text in (False, True):  # some templates only take JSON-string arguments
        c1, c2 = _call(a, {"q": "one"}, as_text), _call(b, {"id": 2, "deep": True}, as_text)
        episodes.append(
            [
                (assistant(calls=[c1]), [tool(a, "result one")]),
                (assistant(calls=[c1, c2]), [tool(a, "result two"), tool(b, "result three")]),
                (assistant(_ANSWER), [user(_FOLLOW)]),
                (assistant(_ANSWER, calls=[c2]), [tool(b, "result four")]),
                (assistant(_ANSWER), [user(_FOLLOW)]),
            ]
        )
        episodes.append(
            [
                (assistant(reasoning=_REASONING, calls=[c1]), [tool(a, "result one")]),
                (
                    assistant("Calling both.", _REASONING, [c1, c2]),
                    [tool(a, "result two"), tool(b, "result three")],
                ),
                (assistant(_ANSWER, _REASONING), [user(_FOLLOW)]),
                (assistant(_ANSWER, _REASONING, [c2]), [tool(b, "result four")]),
                (assistant(_ANSWER), [user(_FOLLOW)]),
            ]
        )
    episodes.append(
        [
            (assistant(_ANSWER), [user(_FOLLOW)]),
            (assistant(_ANSWER, _REASONING), [user(_FOLLOW)]),
            (assistant(_ANSWER), [user(_FOLLOW)]),
            (assistant(_ANSWER, _REASONING), [user(_FOLLOW)]),
        ]
    )
    return episodes


def _run_episode(
    template: Template,
    profile: TemplateProfile,
    context: list[dict[str, Any]],
    episode: list[tuple[dict[str, Any], list[dict[str, Any]]]],
    tally: _Tally,
) -> None:
    history = list(context)
    reasoning_since_user = False
    try:
        prompt = template.render(history, generation_prompt=True)
    except TokenizationError:
        return
    for assistant, new in episode:
        reasoning_since_user = reasoning_since_user or bool(assistant.get("reasoning_content"))
        kind = classify(new, reasoning_since_user)
        assert isinstance(kind, TransitionKind)
        try:
            completion = _canonical_completion(template, profile, history, assistant, prompt)
            expected = template.render([*history, assistant, *new], generation_prompt=True)
        except TokenizationError as err:
            tally.errors.setdefault(kind, str(err))
            return
        tally.total[kind] += 1
        delta = incremental_delta(template, profile, assistant, completion, new, kind)
        if isinstance(delta, Fallback):
            counts = tally.local[kind]
            counts[str(delta.reason)] = counts.get(str(delta.reason), 0) + 1
        elif [*prompt, *completion, *delta] == expected:
            tally.incremental[kind] += 1
        elif kind not in tally.wrong:
            got = [*prompt, *completion, *delta]
            at = next(
                (i for i, (x, y) in enumerate(zip(got, expected, strict=False)) if x != y), None
            )
            at = min(len(got), len(expected)) if at is None else at
            tally.wrong[kind] = (
                f"probe: after {len(history) - len(context)} messages, {kind} gave "
                f"{len(got)} ids where the full render has {len(expected)} (first difference "
                f"at {at})"
            )
        history += [assistant, *new]
        prompt = expected
        if any(m["role"] == "user" for m in new):
            reasoning_since_user = False


def _canonical_completion(
    template: Template,
    profile: TemplateProfile,
    history: list[dict[str, Any]],
    assistant: dict[str, Any],
    prompt: list[int],
) -> list[int]:
    """What a model trained on this template samples for `assistant`: its ids after the prompt."""
    rendered = template.render([*history, assistant], generation_prompt=False)
    start = len(prompt)
    try:
        end = rendered.index(profile.close_id, start) + 1
    except ValueError:
        end = len(rendered)
    return rendered[start:end]
