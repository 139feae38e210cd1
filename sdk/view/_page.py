"""One self-contained HTML page of a run: inline script and style, the records compressed.

Why the page is built this way: it must open from disk with no network (a strict
Content-Security-Policy forbids any fetch but the live server's own), and the default run
(about 20,000 turns, 37 MB of trajectories as JSON) must open in under 2 s in a page of at
most 5 MB. So the run's index (steps, groups, one row per member) is one gzip-compressed
block, and the groups' trajectories are compressed in chunks of consecutive groups (about
256 KB of JSON each: a chunk shares the prompts its groups repeat, and one chunk is quick to
inflate) that the page inflates with the browser's `DecompressionStream` only when one of
their members is opened. Token ids stay ids; their texts are one table.
`bench/view_bench.py` prints the page's size and Chromium's load time.
"""

from __future__ import annotations

import base64
import gzip
import json
import math
import time
from collections.abc import Iterable
from importlib import resources
from typing import Any

from plies import Group, PolicyRef, Trajectory

from ._load import GroupEntry, RunSnapshot
from ._tokens import TokenTable

__all__ = ["CHUNK_BYTES", "chunk_json", "packed", "render_page", "run_index"]

CHUNK_BYTES = 256 << 10
"""Raw JSON per compressed chunk: 64 KB chunks made the default run's page 25% larger, 1 MB
chunks 10% smaller but four times slower to open one episode from."""


def _script_json(value: Any) -> str:
    """JSON that is safe inside a <script> element (no `</script>`, no `<!--`)."""
    text = json.dumps(value, separators=(",", ":"), allow_nan=False, default=str)
    return text.replace("<", "\\u003c").replace("\u2028", "\\u2028").replace("\u2029", "\\u2029")


def _finite(value: Any) -> Any:
    """NaN and infinities become None: JSON has no spelling for them."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def _turns(traj: Trajectory) -> list[dict[str, Any]]:
    return [
        {
            "p": t.prompt_ids,
            "x": t.extends,
            "c": t.completion_ids,
            "l": t.logprobs,
            "f": t.finish_reason,
            "v": t.policy.version,
            "fb": t.fallback,
            "ill": t.ill_formed,
            "msg": t.message,
            "lat": t.latency_s,
        }
        for t in traj.turns
    ]


def chunk_json(group: Group) -> str:
    """One group's trajectories as JSON, one element of a chunk."""
    members = [
        {
            "turns": _turns(t),
            "messages": t.messages,
            "info": t.info,
            "error": t.error,
            "metrics": t.metrics,
        }
        for t in group.trajectories
    ]
    return _script_json(_finite({"members": members}))


def packed(text: str) -> str:
    """`text` gzip-compressed and base64-encoded: what the page inflates on demand."""
    return base64.b64encode(gzip.compress(text.encode(), compresslevel=9, mtime=0)).decode()


def _policies(snapshot: RunSnapshot) -> list[dict[str, Any]]:
    """Each policy version the run log names, where it first appeared."""
    seen: dict[int, dict[str, Any]] = {}
    for record in snapshot.metrics:
        raw = record.get("policy")
        if not isinstance(raw, dict):
            continue
        try:
            policy = PolicyRef.model_validate(raw)
        except ValueError:
            continue
        where = record["kind"] + (f" {record['step']}" if "step" in record else "")
        seen.setdefault(policy.version, {**policy.model_dump(), "first": where})
    return [seen[v] for v in sorted(seen)]


def _step_of(snapshot: RunSnapshot) -> dict[str, tuple[int, str | None]]:
    """Group id -> (the step that took it, the refusal reason if it was refused)."""
    out: dict[str, tuple[int, str | None]] = {}
    for record in snapshot.steps():
        ids = [g for g in record.get("groups") or [] if isinstance(g, str)]
        refused: dict[str, str] = {}
        for text in record.get("refused") or []:
            for gid in ids:
                if isinstance(text, str) and text.startswith(f"{gid}: "):
                    refused[gid] = text[len(gid) + 2 :]
        for gid in ids:
            out[gid] = (record.get("step"), refused.get(gid))
    return out


def _group_row(
    index: int, entry: GroupEntry, steps: dict[str, tuple[int, str | None]], place: tuple[int, int]
) -> dict:
    group = entry.group
    step, refused = steps.get(group.id, (None, None))
    return {
        "i": index,
        "c": place,
        "id": group.id,
        "task": group.task_id,
        "size": group.size,
        "v": group.policy.version,
        "line": entry.line,
        "step": step,
        "refused": refused,
        "members": entry.members,
    }


def run_index(
    snapshot: RunSnapshot,
    tokens: TokenTable,
    places: list[tuple[int, int]],
    *,
    live: bool,
    stamp: str = "",
) -> dict[str, Any]:
    """The page's index: the run, its steps and one row per member (no token ids).

    `places[i]` is (chunk, position in it) of group i's trajectories.
    """
    steps = _step_of(snapshot)
    return _finite(
        {
            "dir": str(snapshot.run_dir),
            "generated": time.time(),
            "live": live,
            "stamp": stamp,
            "problems": snapshot.problems + ([tokens.problem] if tokens.problem else []),
            "run": snapshot.run,
            "summary": snapshot.summary,
            "evals": snapshot.evals(),
            "steps": snapshot.steps(),
            "policies": _policies(snapshot),
            "quarantine": snapshot.quarantine,
            "tokenizer": tokens.source,
            "groups": [_group_row(i, e, steps, places[i]) for i, e in enumerate(snapshot.groups)],
        }
    )


def _asset(name: str) -> str:
    return resources.files("plies.view").joinpath(name).read_text(encoding="utf-8")


CSP = (
    "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
    "img-src data:; connect-src 'self'"
)
"""Nothing but the page itself (and, when served live, its own server) is ever fetched."""


def render_page(index: dict[str, Any], vocab: dict[int, str], chunks: Iterable[str]) -> str:
    """The whole page: `index` inflated at load, each packed chunk when one of its groups is
    opened (`chunks` are `packed` JSON lists of `chunk_json` elements, in group order; the
    index's groups say which chunk holds them)."""
    blocks = [
        f'<script type="application/gzip-base64" id="plies-c-{i}">{c}</script>'
        for i, c in enumerate(chunks)
    ]
    title = f"plies view: {index['dir']}".replace("&", "&amp;").replace("<", "&lt;")
    return "\n".join(
        [
            "<!doctype html>",
            '<html lang="en"><head><meta charset="utf-8">',
            f'<meta http-equiv="Content-Security-Policy" content="{CSP}">',
            f"<title>{title}</title>",
            f"<style>{_asset('view.css')}</style></head>",
            '<body><div id="app"><p>Loading the run…</p></div>',
            f'<script type="application/gzip-base64" id="plies-index">'
            f"{packed(_script_json(index))}</script>",
            f'<script type="application/json" id="plies-vocab">{_script_json(vocab)}</script>',
            *blocks,
            f"<script>{_asset('view.js')}</script>",
            "</body></html>",
        ]
    )
