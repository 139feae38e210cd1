"""`plies view` on a run of the default budget's size: the page's bytes and Chromium's load time.

The run is synthesized (`tests/view/_view_runs.py::write_default_size_run`): the default
budget's 1,757 groups, 12,302 episodes and about 20,000 turns, each episode distinct, its
prompts rendered by the Qwen3 chat template with the Blackjack tools. The page is built with
`write_page` and opened from file:// in headless Chromium (Debian's `chromium` and
`chromium-driver`), `--loads` times; "first paint" is the page's own time from navigation to
its first render, "wall" the driver's from `get` to ready, and "episode" the time to open the
last group's first member (inflating its chunk).

With `--old REV` (a git revision, 5a47bc1 for the viewer before chunks were compressed) the
same run is also laid out as that revision laid it out (every block plain JSON, its view.js)
and timed in the same browser, side by side.

    python bench/view_bench.py [--scale 1.0] [--loads 3] [--old 5a47bc1]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from transformers import AutoTokenizer

from plies.testing import qwen3_tokenizer_dir
from plies.view import RunView, write_page
from plies.view._page import CSP, _script_json, chunk_json, run_index
from plies.view._view import _ids

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "view"))
from _view_runs import write_default_size_run


def browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    options = Options()
    options.binary_location = shutil.which("chromium")
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"):
        options.add_argument(arg)
    options.add_argument("--window-size=1400,1000")
    return webdriver.Chrome(service=Service(shutil.which("chromedriver")), options=options)


def time_page(driver, page: Path, loads: int, last: int, asynchronous: bool) -> dict[str, float]:
    from selenium.webdriver.support.ui import WebDriverWait

    paint, wall, episode = [], [], []
    for _ in range(loads):
        driver.get("about:blank")
        t0 = time.perf_counter()
        driver.get(page.as_uri())
        WebDriverWait(driver, 120).until(
            lambda d: d.execute_script("return document.body.dataset.ready === '1'")
        )
        wall.append(time.perf_counter() - t0)
        paint.append(driver.execute_script("return window.plies.ready") / 1000)
        t0 = time.perf_counter()
        if asynchronous:
            driver.execute_async_script(
                "window.plies.select(arguments[0], 0).then(arguments[arguments.length - 1])", last
            )
        else:
            driver.execute_script("window.plies.select(arguments[0], 0)", last)
        assert driver.execute_script("return document.querySelectorAll('#traj .turn').length")
        episode.append(time.perf_counter() - t0)
    return {
        "paint": statistics.median(paint),
        "wall": statistics.median(wall),
        "episode": statistics.median(episode),
    }


def old_page(run: Path, tokenizer: Path, rev: str, out: Path) -> Path | None:
    """The run laid out as revision `rev` laid it out: plain JSON blocks and its view.js."""
    root = Path(__file__).resolve().parents[1]
    shown = subprocess.run(
        ["git", "-C", str(root), "show", f"{rev}:sdk/view/view.js"], capture_output=True, text=True
    )
    css = subprocess.run(
        ["git", "-C", str(root), "show", f"{rev}:sdk/view/view.css"], capture_output=True, text=True
    )
    if shown.returncode or css.returncode:
        print(f"--old {rev}: not in this checkout's history ({shown.stderr.strip()})")
        return None
    view = RunView(run, tokenizer=tokenizer)
    snap = view._reader.refresh()
    tokens = view._token_table(snap.groups)
    for entry in snap.groups:
        tokens.add(_ids(entry))
    index = run_index(snap, tokens, [(0, 0)] * len(snap.groups), live=False)
    blocks = [
        f'<script type="application/json" id="plies-g-{i}">{chunk_json(e.group)}</script>'
        for i, e in enumerate(snap.groups)
    ]
    out.write_text(
        "\n".join(
            [
                '<!doctype html><html lang="en"><head><meta charset="utf-8">',
                f'<meta http-equiv="Content-Security-Policy" content="{CSP}">',
                f"<style>{css.stdout}</style></head>",
                '<body><div id="app"></div>',
                f'<script type="application/json" id="plies-index">{_script_json(index)}</script>',
                f'<script type="application/json" id="plies-vocab">{_script_json(tokens.texts)}'
                "</script>",
                *blocks,
                f"<script>{shown.stdout}</script></body></html>",
            ]
        ),
        encoding="utf-8",
    )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", type=float, default=1.0)
    parser.add_argument("--loads", type=int, default=3)
    parser.add_argument("--old", default=None, help="a git revision to compare with")
    args = parser.parse_args()
    tok_dir = qwen3_tokenizer_dir()
    tokenizer = AutoTokenizer.from_pretrained(tok_dir)
    with tempfile.TemporaryDirectory(prefix="plies-view-bench-") as tmp:
        run = write_default_size_run(Path(tmp) / "run", tokenizer, scale=args.scale)
        groups = sum(1 for _ in (run / "groups.jsonl").open())
        raw = (run / "groups.jsonl").stat().st_size
        t0 = time.perf_counter()
        page = write_page(run, Path(tmp) / "view.html", tokenizer=tok_dir)
        built = time.perf_counter() - t0
        pages = [("this checkout", page, True, built)]
        if args.old:
            old = old_page(run, tok_dir, args.old, Path(tmp) / "old.html")
            if old is not None:
                pages.insert(0, (f"{args.old} (plain JSON)", old, False, float("nan")))
        print(f"run: {groups:,} groups, groups.jsonl {raw / 1e6:.1f} MB (scale {args.scale})")
        print(f"{'page':28} {'MB':>7} {'first paint s':>14} {'wall s':>8} {'episode s':>10}")
        driver = browser()
        try:
            results = []
            for name, path, asynchronous, _ in pages:
                t = time_page(driver, path, args.loads, groups - 1, asynchronous)
                size = path.stat().st_size / 1e6
                results.append((size, t))
                print(
                    f"{name:28} {size:7.2f} {t['paint']:14.2f} {t['wall']:8.2f} "
                    f"{t['episode']:10.3f}"
                )
        finally:
            driver.quit()
        print(f"page written in {built:.1f} s")
        if len(results) == 2:
            (s0, t0_), (s1, t1) = results
            print(
                f"new / old: size {s1 / s0:.3f}x, first paint {t1['paint'] / t0_['paint']:.3f}x, "
                f"wall {t1['wall'] / t0_['wall']:.3f}x"
            )


if __name__ == "__main__":
    main()
