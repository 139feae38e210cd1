"""`plies doctor`: is this tokenizer's chat template safe for incremental prompts?

It reports what the renderer will decide at run time (the same probe, the same checks), next
to TRL's own template checks, so a surprise fallback rate can be explained before a run.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .._exceptions import ConfigError
from ._parser import ResponseParser
from ._probe import TransitionKind
from ._renderer import ChatRenderer
from ._template import chat_template_text, template_hash

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
    """Every verdict about `tokenizer`'s chat template, as plain JSON-ready data."""
    from trl.chat_template_utils import (
        is_chat_template_prefix_preserving,
        is_chat_template_stop_token_trained,
        supports_tool_calling,
    )

    kwargs = dict(template_kwargs or {})
    text = chat_template_text(tokenizer)
    tools_ok = _check(supports_tool_calling, tokenizer)
    tools = [_DEMO_TOOL] if tools_ok is True else None
    renderer = ChatRenderer(tokenizer, tools=tools, template_kwargs=kwargs)
    template = renderer.template(renderer.tools, None)
    profile = renderer.profile(template)
    try:
        parser = ResponseParser.for_tokenizer(tokenizer, template_kwargs=kwargs)
        schema = parser.source if parser.has_schema else None
    except ConfigError as err:
        schema = f"error: {err}"
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
    return {
        "template_sha256": template_hash(text),
        "template_key": template.key,
        "template_kwargs": kwargs,
        "probed_with_tools": tools is not None,
        "close_token": profile.close_detail if profile.close_id is not None else None,
        "close_token_id": profile.close_id,
        "close_token_problem": None if profile.close_id is not None else profile.close_detail,
        "prefix_preserving": _check(is_chat_template_prefix_preserving, tokenizer),
        "reasoning_stripped_from_history": _reasoning_stripped(renderer, kwargs),
        "tool_calling_supported": tools_ok,
        "stop_token_in_assistant_span": _check(is_chat_template_stop_token_trained, tokenizer),
        "response_schema": schema,
        "transitions": verdicts,
    }


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
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
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
    facts = Table(title=f"plies doctor: {report['tokenizer_dir']}", show_header=False)
    facts.add_column("check", style="bold")
    facts.add_column("finding")
    for label, key in [
        ("template sha256", "template_sha256"),
        ("template key (kwargs, tools, system)", "template_key"),
        ("template kwargs", "template_kwargs"),
        ("turn-close token", "close_token"),
        ("close token problem", "close_token_problem"),
        ("prefix preserving (TRL)", "prefix_preserving"),
        ("reasoning stripped from history", "reasoning_stripped_from_history"),
        ("tool calling supported (TRL)", "tool_calling_supported"),
        ("stop token inside assistant span (TRL)", "stop_token_in_assistant_span"),
        ("response schema", "response_schema"),
    ]:
        facts.add_row(label, str(report[key]))
    console.print(facts)
    plans = Table(title="what the renderer will do")
    for col in ("transition", "probe", "renderer will"):
        plans.add_column(col)
    for kind in TransitionKind:
        v = report["transitions"][str(kind)]
        probe = f"{v['probe_incremental']}/{v['probe_transitions']} incremental"
        if v["reason"]:
            probe += f"; {v['reason']}: {v['detail']}"
        plans.add_row(str(kind), probe, v["renderer_will"])
    console.print(plans)
