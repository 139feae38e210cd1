"""`plies doctor`: is this tokenizer's chat template safe for incremental prompts?

It reports what the renderer will decide at run time (the same probe, the same checks), next
to TRL's own template checks, so a surprise fallback rate can be explained before a run. It
does so for the model's own template and for TRL's training variant of it, says which one
`template="auto"` picks, and recommends the one the probe takes incrementally more often.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

from .._exceptions import ConfigError
from ._parser import ResponseParser
from ._probe import TemplateProfile, TransitionKind
from ._renderer import ChatRenderer
from ._template import template_hash

__all__ = ["diagnose", "run_doctor"]

_DEMO_TOOL = {
    "type": "function",
    "function": {
        "name": "lookup",
        "description": "Look something up.",
        "parameters": {
            "type": "object",
            "properties": {"query": {"type": "string"}},
            "required": ["query"],
        },
    },
}


def diagnose(tokenizer: Any, template_kwargs: dict[str, Any] | None = None) -> dict[str, Any]:
    """Every verdict about `tokenizer`'s chat template and its training variant, as JSON data.

    Returns:
        `templates["model"]` and `templates["training"]` (None when TRL has no variant; then
        `training_problem` says why): the verdicts of each; `auto`: what `template="auto"`
        picks and why; `recommended` ("model" or "training") and `recommendation`.
    """
    from trl.chat_template_utils import supports_tool_calling

    kwargs = dict(template_kwargs or {})
    tools_ok = _check(supports_tool_calling, tokenizer)
    tools = [_DEMO_TOOL] if tools_ok is True else None
    auto = ChatRenderer(tokenizer, tools=tools, template_kwargs=kwargs)
    model = ChatRenderer(tokenizer, tools=tools, template_kwargs=kwargs, template="model")
    templates: dict[str, Any] = {"model": _diagnose_text(tokenizer, model.chat_template, kwargs)}
    problem = None
    try:
        training = ChatRenderer(tokenizer, tools=tools, template_kwargs=kwargs, template="training")
    except ConfigError as err:
        templates["training"], problem = None, str(err)
    else:
        templates["training"] = _diagnose_text(tokenizer, training.chat_template, kwargs)
        templates["training"]["name"] = training.choice.name
    templates["model"]["name"] = model.choice.name
    in_use = "training" if auto.choice.source == "trl" else "model"
    recommended, why = _recommend(templates, in_use)
    return {
        "template_kwargs": kwargs,
        "probed_with_tools": tools is not None,
        "templates": templates,
        "training_problem": problem,
        "auto": {"uses": in_use, "name": auto.choice.name, "reason": auto.choice.reason},
        "recommended": recommended,
        "recommendation": why,
    }


def _incremental(report: dict[str, Any]) -> int:
    """Probe transitions the renderer would take incrementally under this template."""
    return sum(v["probe_incremental"] for v in report["transitions"].values() if v["exact"])


def _recommend(templates: dict[str, Any], in_use: str) -> tuple[str, str]:
    model, training = templates["model"], templates["training"]
    if training is None:
        return "model", "TRL has no training variant of this template: sample with the model's"
    m, t = _incremental(model), _incremental(training)
    if t != m:
        best = "training" if t > m else "model"
        return best, (
            f"the probe takes {t} transitions incrementally with {training['name']} and {m} "
            f"with the model's template: use template={best!r}"
            + (" (what template='auto' picks)" if best == in_use else "")
        )
    return in_use, (
        f"both take {m} probe transitions incrementally; template='auto' picks the {in_use} "
        "template, and sampling with the template you train with keeps prompts as sampled"
    )


def _diagnose_text(tokenizer: Any, text: str, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The verdicts about one template text, with TRL's checks run against that text."""
    from trl.chat_template_utils import (
        is_chat_template_prefix_preserving,
        is_chat_template_stop_token_trained,
        supports_tool_calling,
    )

    tokenizer = copy.copy(tokenizer)  # TRL's checks read the tokenizer's own template
    tokenizer.chat_template = text
    tools_ok = _check(supports_tool_calling, tokenizer)
    tools = [_DEMO_TOOL] if tools_ok is True else None
    renderer = ChatRenderer(tokenizer, tools=tools, template_kwargs=kwargs, template="model")
    template = renderer.template(renderer.tools, None)
    profile = renderer.profile(template)
    try:
        parser = ResponseParser.for_tokenizer(tokenizer, template_kwargs=kwargs)
        schema = parser.source if parser.has_schema else None
    except ConfigError as err:
        schema = f"error: {err}"
    return {
        "template_sha256": template_hash(text),
        "template_key": template.key,
        "close_token": profile.close_detail if profile.close_id is not None else None,
        "close_token_id": profile.close_id,
        "close_token_problem": None if profile.close_id is not None else profile.close_detail,
        "prefix_preserving": _check(is_chat_template_prefix_preserving, tokenizer),
        "reasoning_stripped_from_history": _reasoning_stripped(renderer, kwargs),
        "tool_calling_supported": tools_ok,
        "stop_token_in_assistant_span": _check(is_chat_template_stop_token_trained, tokenizer),
        "response_schema": schema,
        "transitions": _transitions(profile),
    }


def _transitions(profile: TemplateProfile) -> dict[str, Any]:
    verdicts = {}
    for kind, v in profile.verdicts.items():
        verdicts[str(kind)] = {
            "exact": v.exact,
            "reason": str(v.reason) if v.reason else None,
            "detail": v.detail,
            "probe_incremental": v.incremental,
            "probe_transitions": v.total,
            "probe_local_fallbacks": v.local_fallbacks,
            "renderer_will": _plan(v),
        }
    return verdicts


def _check(fn: Any, tokenizer: Any) -> bool | str:
    try:
        return bool(fn(tokenizer))
    except Exception as err:  # a check that cannot run is itself a finding
        return f"error: {type(err).__name__}: {err}"


def _reasoning_stripped(renderer: ChatRenderer, kwargs: dict[str, Any]) -> bool | str:
    marker = "plies-doctor-reasoning"
    messages = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "a", "reasoning_content": marker},
        {"role": "user", "content": "q2"},
    ]
    text = renderer.template(None, None).render_text(messages, generation_prompt=True)
    if text is None:
        return "error: the template could not render user/assistant/user"
    alone = renderer.template(None, None).render_text(messages[:2], generation_prompt=False)
    if alone is not None and marker not in alone:
        return "reasoning_content is never rendered"
    return marker not in text


def _plan(verdict: Any) -> str:
    if not verdict.exact:
        return f"full render ({verdict.reason})"
    if verdict.total and verdict.incremental == verdict.total:
        return "incremental"
    if verdict.incremental == 0:
        reasons = ", ".join(sorted(verdict.local_fallbacks)) or "no probe data"
        return f"full render in the probe's episodes ({reasons})"
    reasons = ", ".join(sorted(verdict.local_fallbacks))
    return f"incremental when the turn re-renders as sampled, else full render ({reasons})"


def run_doctor(tokenizer_dir: Path, as_json: bool, kwarg_pairs: list[str]) -> dict[str, Any]:
    """Load a tokenizer directory offline, diagnose it, print the report."""
    import os

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    kwargs = {}
    for pair in kwarg_pairs:
        name, sep, value = pair.partition("=")
        if not sep or not name:
            raise ConfigError(f"--kwarg expects NAME=VALUE, got {pair!r}")
        try:
            kwargs[name] = json.loads(value)
        except json.JSONDecodeError:
            kwargs[name] = value
    if not tokenizer_dir.is_dir():
        raise ConfigError(f"{tokenizer_dir} is not a directory")
    try:
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    except Exception as exc:  # transformers raises ValueError, OSError or KeyError here
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0].rstrip(": ")
        raise ConfigError(f"{tokenizer_dir} holds no tokenizer that loads ({first})") from exc
    report = diagnose(tokenizer, kwargs)
    report["tokenizer_dir"] = str(tokenizer_dir)
    if as_json:
        print(json.dumps(report, indent=2))
    else:
        _print_table(report)
    return report


def _print_table(report: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    shown = {k: v for k, v in report["templates"].items() if v is not None}
    facts = Table(title=f"plies doctor: {report['tokenizer_dir']}")
    facts.add_column("check", style="bold")
    for which, t in shown.items():
        facts.add_column(f"{which}: {t['name']}")
    facts.add_row("template kwargs", *[str(report["template_kwargs"])] * len(shown))
    for label, key in [
        ("template sha256", "template_sha256"),
        ("template key (kwargs, tools, system)", "template_key"),
        ("turn-close token", "close_token"),
        ("close token problem", "close_token_problem"),
        ("prefix preserving (TRL)", "prefix_preserving"),
        ("reasoning stripped from history", "reasoning_stripped_from_history"),
        ("tool calling supported (TRL)", "tool_calling_supported"),
        ("stop token inside assistant span (TRL)", "stop_token_in_assistant_span"),
        ("response schema", "response_schema"),
    ]:
        facts.add_row(label, *[str(t[key]) for t in shown.values()])
    console.print(facts)
    for which, t in shown.items():
        plans = Table(title=f"what the renderer will do with the {which} template ({t['name']})")
        for col in ("transition", "probe", "renderer will"):
            plans.add_column(col)
        for kind in TransitionKind:
            v = t["transitions"][str(kind)]
            probe = f"{v['probe_incremental']}/{v['probe_transitions']} incremental"
            if v["reason"]:
                probe += f"; {v['reason']}: {v['detail']}"
            plans.add_row(str(kind), probe, v["renderer_will"])
        console.print(plans)
    if report["training_problem"]:
        console.print(f"training variant: none ({report['training_problem']})")
    auto = report["auto"]
    console.print(
        f"template='auto' uses the {auto['uses']} template ({auto['name']}): {auto['reason']}"
    )
    console.print(
        f"[bold]recommended: template={report['recommended']!r}[/] - {report['recommendation']}"
    )
