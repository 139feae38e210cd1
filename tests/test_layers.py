"""The import layers in pyproject.toml hold: `lint-imports` over plies as it installs.

plies' import packages live in three folders (`sdk/`, `environments/`, `harness/`, mapped by
`[tool.setuptools] package-dir`). An editable install in setuptools' default mode resolves
them with a finder of its own, which import-linter cannot walk: it sees only `sdk/` (the
README's `editable_mode=strict` install avoids that). So that the check holds however plies
was installed, it lays the package out as a wheel would (the same mapping, read from
pyproject.toml) in a temporary folder and runs the real `lint-imports` there, function-level
imports included.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _lay_out(target: Path) -> None:
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    # Parents before children, so a child folder lands inside its parent's copy.
    for package, folder in sorted(setuptools["package-dir"].items(), key=lambda kv: kv[0]):
        dest = target.joinpath(*package.split("."))
        shutil.copytree(ROOT / folder, dest, ignore=ignore, dirs_exist_ok=True)


def _lint(tmp_path: Path) -> subprocess.CompletedProcess[str]:
    lint = Path(sys.executable).with_name("lint-imports")
    return subprocess.run(
        [str(lint), str(ROOT / "pyproject.toml"), "--no-cache"],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(tmp_path / "site")},
        capture_output=True,
        text=True,
        timeout=240,
    )


def test_import_layers_hold(tmp_path: Path):
    _lay_out(tmp_path / "site")
    result = _lint(tmp_path)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
    assert "broken" not in result.stdout.lower().replace("0 broken", "")
    assert "kept" in result.stdout


def test_an_import_cycle_between_two_modules_breaks_the_contract(tmp_path: Path):
    # The cycle the runtime had: the episode context reaching back into the driver (a type
    # import is an import too).
    _lay_out(tmp_path / "site")
    episode = tmp_path / "site" / "plies" / "runtime" / "_episode.py"
    episode.write_text(episode.read_text() + "\nfrom . import _driver  # noqa\n")
    result = _lint(tmp_path)
    assert result.returncode != 0
    assert "No import cycles between modules of plies BROKEN" in result.stdout
    assert "._episode -> ._driver" in result.stdout
