"""`run` keeps the collector's full scans off what was loaded, and gives its settings back."""

from __future__ import annotations

import json
import subprocess
import sys

SCRIPT = """
import gc, json
import plies.runtime
from plies.runtime import long_run_collector

seen = {}

async def main(interrupts):
    seen["threshold"] = gc.get_threshold()
    seen["frozen"] = gc.get_freeze_count()

gc.set_threshold(900, 11, 12)
code = plies.runtime.run(main)
print(json.dumps({"code": code, **seen, "after": gc.get_threshold()}))
try:
    with long_run_collector():
        raise ValueError("from the block")
except ValueError:
    print(json.dumps({"after_error": gc.get_threshold()}))
"""


def test_run_freezes_what_is_loaded_and_puts_the_threshold_back():
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120, check=True
    ).stdout.splitlines()
    during, error = json.loads(out[0]), json.loads(out[1])
    assert during["code"] == 0
    assert during["threshold"] == [20_000, 11, 12]
    assert during["frozen"] > 10_000  # plies, anyio and their imports, out of every scan
    assert during["after"] == [900, 11, 12]
    assert error["after_error"] == [900, 11, 12]
