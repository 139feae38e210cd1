"""`plies view` in a real browser: the page of a real demo run, filters, a 10,000-turn run."""

from __future__ import annotations

import io
import json
import subprocess
import time
from pathlib import Path

import pytest
from _view_runs import write_run
from smoke_run import ENV, demo_test

from plies import Group
from plies.runtime import JsonlSink, read_jsonl
from plies.testing import plies_command, serve_process_sync
from plies.view import RunView, write_page


def plies_view(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        plies_command("view", *args), capture_output=True, text=True, env=ENV, timeout=300
    )


def open_page(browser, url: str) -> float:
    """Load `url`; return the page's own time to its first render (ms since navigation)."""
    from selenium.webdriver.support.ui import WebDriverWait

    browser.get(url)
    WebDriverWait(browser, 30).until(
        lambda d: d.execute_script("return document.body.dataset.ready === '1'")
    )
    return browser.execute_script("return window.plies.ready")


def js(browser, script: str, *args):
    return browser.execute_script(script, *args)


def select(browser, g: int, m: int) -> None:
    """Open member `m` of group `g` and wait until it is on screen (its chunk inflated)."""
    browser.execute_async_script(
        "Promise.resolve(window.plies.select(arguments[0], arguments[1]))"
        ".then(arguments[arguments.length - 1])",
        g,
        m,
    )


def wait_shown(browser, g: int, m: int) -> None:
    """Wait until the episode a click opened is on screen (chunks inflate asynchronously)."""
    from selenium.webdriver.support.ui import WebDriverWait

    WebDriverWait(browser, 30).until(
        lambda d: d.execute_script("return document.body.dataset.shown") == f"{g}:{m}"
    )


TURNS_SHOWN = """
const toks = (t, part) => [...t.querySelectorAll(part + ' .tok')].map(
    s => [Number(s.dataset.id), s.dataset.mask, s.dataset.lp, s.textContent]);
return [...document.querySelectorAll('#traj .turn')].map(t => ({
    version: t.querySelector('.version').textContent,
    prompt: toks(t, '.prompt'), completion: toks(t, '.completion'),
    fallback: !!t.querySelector('.fallback'), ill: t.classList.contains('ill')}));
"""
"""Every turn of the episode on screen, token by token: id, mask, logprob, text."""

CURVE_POINTS = """
return [...document.querySelectorAll('#curve circle.pt')].map(
    c => [Number(c.dataset.step), Number(c.dataset.return)]);
"""


def member_counts(browser) -> tuple[int, int]:
    count = js(
        browser,
        "const c = document.getElementById('f-count');"
        "return [c.dataset.matched, document.querySelectorAll('tr.member').length]",
    )
    return int(count[0]), int(count[1])


@pytest.fixture(scope="module")
def demo_page(demo_run: Path, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("view-page") / "page.html"
    result = plies_view(str(demo_run), "--out", str(out))
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == str(out)
    return out


@demo_test
def test_the_summary_curve_and_steps_render(demo_run, demo_page, browser):
    open_page(browser, demo_page.as_uri())
    summary = json.loads((demo_run / "summary.json").read_text())
    assert js(browser, "return document.getElementById('problems')") is None
    shown = js(browser, "return document.querySelector('b[data-key=final_return]').textContent")
    # The summary's value to 3 places as JavaScript rounds it (a value half-way between two,
    # such as -0.3125 from 32 hands, has one right answer there, not two); a whole number
    # (0, -1) is shown as it is.
    expected = js(
        browser,
        "const x = arguments[0]; return Number.isInteger(x) ? String(x) : x.toFixed(3)",
        summary["final_return"],
    )
    assert shown == expected
    log = [json.loads(x) for x in (demo_run / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in log if r["kind"] == "eval"]
    steps = [r for r in log if r["kind"] == "step"]
    points = js(browser, CURVE_POINTS)
    assert sorted(points) == sorted([e["step"], e["return"]] for e in evals)
    assert js(browser, "return document.querySelectorAll('#steps tr[data-step]').length") == len(
        steps
    )
    versions = {s["policy"]["version"] for s in steps} | {
        r["policy"]["version"] for r in log if r["kind"] == "warm_start"
    }
    assert (
        js(browser, "return document.querySelectorAll('#policies tr').length") == len(versions) + 1
    )
    # Offline: nothing but the page itself was loaded.
    assert js(browser, "return performance.getEntriesByType('resource').length") == 0


@demo_test
def test_a_trajectorys_tokens_masks_and_logprobs_match_groups_jsonl(
    demo_run, demo_page, browser, qwen3_tokenizer
):
    from selenium.webdriver.common.by import By

    open_page(browser, demo_page.as_uri())
    groups = read_jsonl(demo_run / "groups.jsonl", Group)
    assert groups.clean and groups.records
    # The member with the most turns: prompt deltas as well as full prompts.
    g, m = max(
        ((g, m) for g, grp in enumerate(groups.records) for m in range(len(grp.trajectories))),
        key=lambda gm: len(groups.records[gm[0]].trajectories[gm[1]].turns),
    )
    traj = groups.records[g].trajectories[m]
    browser.find_element(By.CSS_SELECTOR, f'tr.member[data-g="{g}"][data-m="{m}"]').click()
    wait_shown(browser, g, m)
    turns = js(browser, TURNS_SHOWN)
    assert len(turns) == len(traj.turns) >= 1
    for shown, turn in zip(turns, traj.turns, strict=True):
        assert shown["version"] == f"v{turn.policy.version}"
        assert [p[0] for p in shown["prompt"]] == turn.prompt_ids
        assert {p[1] for p in shown["prompt"]} == {"0"}
        assert [c[0] for c in shown["completion"]] == turn.completion_ids
        assert {c[1] for c in shown["completion"]} == {"1"}
        assert [float(c[2]) for c in shown["completion"]] == turn.logprobs  # exactly
        text = "".join(c[3] for c in shown["completion"]).replace("↵\n", "\n")
        assert text == qwen3_tokenizer.decode(turn.completion_ids)
        assert shown["fallback"] == (turn.fallback is not None)
        assert shown["ill"] == turn.ill_formed
    # Mask and logprobs, read across turns, are the training segments' own.
    segment = traj.segments()[0]
    first, last = segment.turns
    mask = [int(x[1]) for t in turns[first:last] for x in t["prompt"] + t["completion"]]
    assert mask == segment.mask
    lps = [
        float(x[2]) if x[1] == "1" else 0.0
        for t in turns[first:last]
        for x in t["prompt"] + t["completion"]
    ]
    assert lps == segment.logprobs


@demo_test
def test_filters_select_the_members_they_say(demo_run, demo_page, browser):
    from selenium.webdriver.common.by import By

    open_page(browser, demo_page.as_uri())
    members = [
        (grp, t)
        for grp in read_jsonl(demo_run / "groups.jsonl", Group).records
        for t in grp.trajectories
    ]
    assert member_counts(browser) == (len(members), len(members))
    rewards = sorted({t.reward for _, t in members if t.reward is not None})
    cut = rewards[-1]
    browser.find_element(By.ID, "f-rmin").send_keys(str(cut))
    want = sum(t.reward is not None and t.reward >= cut for _, t in members)
    assert member_counts(browser) == (want, want) and want >= 1
    browser.find_element(By.ID, "f-rmin").clear()
    task = members[0][0].task_id
    browser.find_element(By.ID, "f-task").send_keys(task)
    want = sum(task in grp.task_id for grp, _ in members)
    assert member_counts(browser) == (want, want)
    assert set(
        js(browser, "return [...document.querySelectorAll('tr.member')].map(r => r.dataset.task)")
    ) <= {grp.task_id for grp, _ in members if task in grp.task_id}


def test_filters_on_status_fallback_and_ill_formed(
    tmp_path, browser, qwen3_tokenizer, qwen3_tokenizer_dir
):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    run = write_run(tmp_path / "run", qwen3_tokenizer, groups=20, size=4, turns=3)
    page = write_page(run, tmp_path / "page.html", tokenizer=qwen3_tokenizer_dir)
    open_page(browser, page.as_uri())
    trajs = [t for grp in read_jsonl(run / "groups.jsonl", Group).records for t in grp.trajectories]
    checks = [
        ("f-fallback", lambda t: any(x.fallback for x in t.turns)),
        ("f-ill", lambda t: any(x.ill_formed for x in t.turns)),
    ]
    for box, has in checks:
        browser.find_element(By.ID, box).click()
        want = sum(map(has, trajs))
        assert member_counts(browser) == (want, want) and 0 < want < len(trajs), box
        browser.find_element(By.ID, box).click()
    # The summary's strategy table, and the curve's band from the evaluations' stderr.
    strategy = js(
        browser, "return [...document.querySelectorAll('#strategy tr')].map(r => r.innerText)"
    )
    assert len(strategy) == 1 + 6 and strategy[-1].split() == ["hard", "17", *["stand"] * 10]
    assert js(browser, "return document.getElementById('curve-band') !== null")
    Select(browser.find_element(By.ID, "f-status")).select_by_value("failed")
    want = sum(t.status == "failed" for t in trajs)
    assert member_counts(browser) == (want, want) and want > 0
    Select(browser.find_element(By.ID, "f-status")).select_by_value("quarantined")
    assert member_counts(browser) == (1, 1)
    row = browser.find_element(By.CSS_SELECTOR, "tr.member")
    row.click()
    wait_shown(browser, row.get_attribute("data-g"), row.get_attribute("data-m"))
    leases = js(browser, "return document.getElementById('traj-quarantined').innerText")
    assert "sbx-9" in leases and "refused: failed_member" in js(
        browser, "return document.getElementById('traj').innerText"
    )


@demo_test
def test_a_screenshot_is_not_blank(demo_page, browser, tmp_path):
    from PIL import Image

    open_page(browser, demo_page.as_uri())
    png = browser.get_screenshot_as_png()
    image = Image.open(io.BytesIO(png)).convert("RGB")
    grey = image.convert("L").histogram()
    inked = 1 - grey[255] / sum(grey)
    assert inked > 0.03, f"only {inked:.1%} of the screenshot is not white"
    assert len(image.getcolors(1 << 24)) > 50


def test_a_10000_turn_run_opens_in_under_2_s(
    tmp_path, browser, qwen3_tokenizer, qwen3_tokenizer_dir
):
    run = write_run(tmp_path / "big", qwen3_tokenizer, groups=250, size=4, turns=10)
    t0 = time.perf_counter()
    page = write_page(run, tmp_path / "big.html", tokenizer=qwen3_tokenizer_dir)
    built = time.perf_counter() - t0
    turns = sum(
        len(t.turns)
        for g in read_jsonl(run / "groups.jsonl", Group).records
        for t in g.trajectories
    )
    assert turns == 10_000
    t0 = time.perf_counter()
    ready_ms = open_page(browser, page.as_uri())
    wall = time.perf_counter() - t0
    t0 = time.perf_counter()
    select(browser, 249, 3)
    shown = len(js(browser, "return document.querySelectorAll('#traj .turn')"))
    opened = time.perf_counter() - t0
    print(
        f"\n10,000 turns, {page.stat().st_size / 1e6:.1f} MB page built in {built:.2f} s: first "
        f"render {ready_ms:.0f} ms after navigation, {wall:.2f} s wall; one episode opened in "
        f"{opened * 1000:.0f} ms"
    )
    assert shown == 10
    assert ready_ms < 2000 and wall < 2.0


@demo_test
def test_bad_run_directories_give_a_page_that_says_what_is_missing(tmp_path, browser, demo_run):
    run = tmp_path / "damaged"
    run.mkdir()
    good = (demo_run / "groups.jsonl").read_text().splitlines()
    old = json.loads(good[0])
    old["trajectories"][0]["turns"][0]["sampled_ids"] = old["trajectories"][0]["turns"][0].pop(
        "completion_ids"
    )
    (run / "groups.jsonl").write_text(
        "\n".join([good[0], json.dumps(old), "[1, 2]", good[1][:200]])
    )
    (run / "metrics.jsonl").write_text('{"kind": "step", "step": 0}\nnot json\n')
    result = plies_view(str(run), "--out", str(tmp_path / "page.html"))
    assert result.returncode == 0, result.stderr[-2000:]
    open_page(browser, (tmp_path / "page.html").as_uri())
    text = js(browser, "return document.getElementById('problems').innerText")
    for expected in (
        "summary.json is missing", "run.json is missing", "metrics.jsonl: line 2 is not JSON",
        "groups.jsonl: line 2 is not a group this version reads", "groups.jsonl: line 3",
        "groups.jsonl: line 4 is torn",
    ):  # fmt: skip
        assert expected in text, (expected, text)
    assert member_counts(browser)[0] == len(json.loads(good[0])["trajectories"])

    empty = tmp_path / "empty"
    empty.mkdir()
    assert plies_view(str(empty), "--out", str(tmp_path / "empty.html")).returncode == 0
    open_page(browser, (tmp_path / "empty.html").as_uri())
    assert "groups.jsonl is missing" in js(
        browser, "return document.getElementById('problems').innerText"
    )

    bad_tokenizer = plies_view(str(empty), "--tokenizer", str(tmp_path / "nowhere"))
    assert bad_tokenizer.returncode == 2
    assert "--tokenizer" in bad_tokenizer.stderr and len(bad_tokenizer.stderr.splitlines()) == 1
    missing = plies_view(str(tmp_path / "nowhere"))
    assert missing.returncode == 2
    assert missing.stderr.strip() == f"plies view: {tmp_path / 'nowhere'} is not a directory"


def test_the_live_page_refreshes_as_the_run_writes(
    tmp_path, browser, qwen3_tokenizer, qwen3_tokenizer_dir
):
    run = write_run(tmp_path / "live", qwen3_tokenizer, groups=4, size=4, turns=2)
    argv = plies_command("view", str(run), "--serve", "--tokenizer", str(qwen3_tokenizer_dir))
    with serve_process_sync(argv, log=tmp_path / "serve.log", ready_timeout=120) as server:
        assert server.url.startswith("http://127.0.0.1:")
        open_page(browser, server.url)
        assert member_counts(browser)[0] == 16
        assert js(browser, "return document.getElementById('live').textContent").startswith("live")
        extra = (
            read_jsonl(run / "groups.jsonl", Group).records[0].model_copy(update={"id": "train-99"})
        )
        with JsonlSink(run / "groups.jsonl") as sink:  # as the run appends a group
            sink.write_group(Group.model_validate(extra.model_dump()))
        deadline = time.monotonic() + 15
        while member_counts(browser)[0] != 20 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert member_counts(browser)[0] == 20
        assert "train-99" in js(browser, "return document.getElementById('members').innerText")


def test_the_reader_parses_only_what_was_appended(tmp_path, qwen3_tokenizer):
    run = write_run(tmp_path / "run", qwen3_tokenizer, groups=3, size=2, turns=2)
    view = RunView(run)
    first = view._reader.refresh()
    lines = (run / "groups.jsonl").read_bytes()
    with (run / "groups.jsonl").open("ab") as f:
        f.write(lines.splitlines(keepends=True)[0][:50])  # a line being written
    live = view._reader.refresh(live=True)
    assert [e.group.id for e in live.groups] == [e.group.id for e in first.groups]
    assert all(a is b for a, b in zip(live.groups, first.groups, strict=True))  # not re-parsed
    assert not [p for p in live.problems if "torn" in p]
    assert any("line 4 is torn" in p for p in view._reader.refresh().problems)
