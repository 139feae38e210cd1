"""A crafted run directory cannot run script in its page, and a default-size run's page is
small and quick: headless Chromium on real pages.

The page is built with the DOM only (no `innerHTML`), so whatever a model, an env or a
hand-edited file wrote into the run is text on the page; and run-log records of the wrong
types are listed as damaged before the page sees them.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from _view_runs import write_default_size_run, write_run
from test_view import member_counts, open_page, select

from plies import Group
from plies.runtime import JsonlSink, read_jsonl
from plies.view import write_page

HOOK = "window.__pwned = (window.__pwned || 0) + 1"
PAYLOADS = [
    f"<img src=x onerror='{HOOK}'>",
    f'"><svg onload="{HOOK}"></svg>',
    f"</script><script>{HOOK}</script>",
    f'<iframe srcdoc="<script>parent.{HOOK}</script>"></iframe>',
]
EVIL = " ".join(PAYLOADS)


def crafted_run(run: Path, tokenizer) -> Path:
    """A small real run with markup in every field a hand or a model can write."""
    write_run(run, tokenizer, groups=4, size=2, turns=2)
    evil = read_jsonl(run / "groups.jsonl", Group).records[0].model_dump(mode="json")
    evil.update(id=EVIL, task_id=EVIL)
    for traj in evil["trajectories"]:
        traj["messages"] = [
            {"role": "user", "content": EVIL},
            {"role": "assistant", "content": EVIL, "tool_calls": [
                {"type": "function", "function": {"name": EVIL, "arguments": {EVIL: EVIL}}}]},
            {"role": "tool", "name": EVIL, "content": EVIL},
        ]  # fmt: skip
        traj["info"] = {**traj["info"], "env": {EVIL: EVIL}, "ill_formed": EVIL}
        traj["error"] = EVIL
        traj["group_id"] = EVIL
        traj["turns"][0]["fallback"] = EVIL
    with JsonlSink(run / "groups.jsonl") as sink:
        sink.write_group(Group.model_validate(evil))
    why = [f"{EVIL}: {EVIL}"]
    with (run / "metrics.jsonl").open("a") as f:
        for record in (
            # The finding: a string step naming real groups went into innerHTML.
            {"kind": "step", "step": EVIL, "groups": ["train-0", EVIL], "refused": why,
             "train_return": 0.1, EVIL: 1.0, "policy": {"uri": EVIL, "version": 1}},
            {"kind": "step", "step": 9, "groups": [EVIL], "refused": why, EVIL: 2.0},
            {"kind": "eval", "step": 3, "return": 0.1, "label": EVIL, "hands": 5},
            {"kind": EVIL[:60], "step": 1},
        ):  # fmt: skip
            f.write(json.dumps(record) + "\n")
        f.write(EVIL + "\n")  # a line that is not JSON: its preview is on the page
    summary = json.loads((run / "summary.json").read_text())
    summary.update({EVIL: EVIL, "references": {EVIL: 0.2}, "final_return": EVIL})
    summary["strategy"] = {EVIL: {EVIL: EVIL}}
    (run / "summary.json").write_text(json.dumps(summary))
    (run / "run.json").write_text(json.dumps({EVIL: {EVIL: EVIL}}))
    return run


def test_a_crafted_run_cannot_run_script(tmp_path, browser, qwen3_tokenizer, qwen3_tokenizer_dir):
    run = crafted_run(tmp_path / "evil", qwen3_tokenizer)
    page = write_page(run, tmp_path / "evil.html", tokenizer=qwen3_tokenizer_dir)
    open_page(browser, page.as_uri())
    total = member_counts(browser)[0]
    assert total == 10  # the crafted group is listed with the others
    for g in range(5):
        for m in range(2):
            select(browser, g, m)
            time.sleep(0.05)
    time.sleep(0.5)  # an <img onerror> fires once the image fails to load
    assert browser.execute_script("return window.__pwned") is None
    injected = browser.execute_script(
        "return [...document.querySelectorAll('#app img, #app iframe, #app script, #app svg')]"
        ".filter(e => e.id !== 'curve').length"
    )
    assert injected == 0
    # The markup is on the page as text, where it was written.
    assert EVIL in browser.execute_script("return document.getElementById('traj').innerText")
    problems = browser.execute_script("return document.getElementById('problems').innerText")
    assert "metrics.jsonl: line" in problems and "step is str" in problems


def test_the_default_runs_page_is_small_quick_and_complete(
    tmp_path, browser, qwen3_tokenizer, qwen3_tokenizer_dir
):
    run = write_default_size_run(tmp_path / "default", qwen3_tokenizer)
    groups = read_jsonl(run / "groups.jsonl", Group).records
    episodes = sum(len(g.trajectories) for g in groups)
    turns = sum(len(t.turns) for g in groups for t in g.trajectories)
    assert len(groups) == 1757 and episodes == 12302 and turns > 18000
    page = write_page(run, tmp_path / "default.html", tokenizer=qwen3_tokenizer_dir)
    size = page.stat().st_size
    t0 = time.perf_counter()
    ready_ms = open_page(browser, page.as_uri())
    wall = time.perf_counter() - t0
    print(
        f"\ndefault-size run ({len(groups)} groups, {episodes} episodes, {turns} turns, "
        f"groups.jsonl {(run / 'groups.jsonl').stat().st_size / 1e6:.1f} MB): page "
        f"{size / 1e6:.2f} MB, first render {ready_ms:.0f} ms after navigation, {wall:.2f} s wall"
    )
    assert size <= 5_000_000
    assert ready_ms < 2000
    # The strategy as a grid at the top, hard and soft, before the steps' table.
    cells = browser.execute_script(
        "return ['hard', 'soft'].map(k => [...document.querySelectorAll("
        "'#strategy-' + k + ' tr[data-total]')].map(r => r.querySelectorAll('td.cell').length))"
    )
    assert cells == [[10] * 18, [10] * 10]
    coloured = browser.execute_script(
        "return [...document.querySelectorAll('#strategy td.cell')]"
        ".filter(c => c.dataset.rate !== '' && c.style.background).length"
    )
    assert coloured > 100
    order = browser.execute_script(
        "const all = [...document.querySelectorAll('#run *')];"
        "const at = id => all.indexOf(document.getElementById(id));"
        "return [at('curve'), at('strategy'), at('steps')]"
    )
    assert 0 <= order[0] < order[1] < order[2]
    summary_rows = "const t = document.getElementById('summary'); return t ? t.rows.length : 0"
    assert browser.execute_script(summary_rows) < 40  # not the ~400-row key/value table
    # Every episode is reachable: listed, and every group's trajectories inflate.
    assert member_counts(browser) == (episodes, 300)
    inflated = browser.execute_async_script(
        "const done = arguments[arguments.length - 1];"
        "Promise.all([...Array(arguments[0]).keys()].map(g => window.plies.members(g)))"
        ".then(done)",
        len(groups),
    )
    assert inflated == [len(g.trajectories) for g in groups]
    t0 = time.perf_counter()
    select(browser, len(groups) - 1, 0)
    opened = time.perf_counter() - t0
    shown = browser.execute_script("return document.querySelectorAll('#traj .turn').length")
    assert shown == len(groups[-1].trajectories[0].turns)
    print(f"last episode opened in {opened * 1000:.0f} ms")
