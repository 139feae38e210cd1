"""Fairness between tenants: a neighbour's flood of queued ops does not starve a tenant's
futures. One worker runs every tenant's ordered ops, taking the tenants with work in turn
(`_futures.WorkQueue`), so a tenant's op waits for at most one op of each busy neighbour."""

from __future__ import annotations

import json
import time
from pathlib import Path

from tinker import types

SEQ = [9707, 11, 1879, 0, 151644, 872, 198, 3838, 374, 220, 17, 10, 17, 30, 151645]
FLOOD = 12


def _datum(tokens: list[int]) -> types.Datum:
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:]},
    )


def _events(root: Path, model_id: str, event: str) -> int:
    path = root / "state" / "tinker" / model_id.replace(":", "_") / "ops.jsonl"
    lines = path.read_text().splitlines(keepends=True) if path.exists() else []
    return sum(1 for line in lines if line.endswith("\n") and json.loads(line)["event"] == event)


def test_a_flooding_neighbour_does_not_starve_a_tenants_futures(new_tenant, tinker_root):
    busy, quiet = new_tenant(seed=1), new_tenant(seed=2)
    heavy = [_datum(SEQ)] * 16  # one op of the neighbour: 16 sequences through the head
    light = [_datum(SEQ)]

    def timed(tc, data) -> float:
        t = time.monotonic()
        tc.forward(data, "cross_entropy").result()
        return time.monotonic() - t

    timed(busy, heavy), timed(quiet, light)  # warm both
    heavy_s = min(timed(busy, heavy) for _ in range(2))
    alone_s = min(timed(quiet, light) for _ in range(3))
    base = _events(tinker_root, busy.model_id, "submit")
    t_flood = time.monotonic()
    flood = [busy.forward(heavy, "cross_entropy") for _ in range(FLOOD)]
    deadline = time.monotonic() + 120
    while _events(tinker_root, busy.model_id, "submit") < base + FLOOD:  # all queued
        assert time.monotonic() < deadline, "the flood was never queued"
        time.sleep(0.02)
    settled_before = _events(tinker_root, busy.model_id, "done") - base
    beside_s = timed(quiet, light)
    busy_done = _events(tinker_root, busy.model_id, "done") - base
    for f in flood:
        f.result()
    flood_s = time.monotonic() - t_flood
    print(
        f"\nfairness: the quiet tenant's forward took {alone_s * 1e3:.0f} ms alone and "
        f"{beside_s * 1e3:.0f} ms beside a flood of {FLOOD} ops of {heavy_s * 1e3:.0f} ms each "
        f"({flood_s:.1f} s in all; first come, first served would make it wait about "
        f"{FLOOD * heavy_s:.1f} s); {busy_done - settled_before} of the flood's ops settled "
        "while it waited"
    )
    # Round-robin: the op running when it arrived, at most one more turn of the neighbour.
    assert busy_done - settled_before <= 2, (settled_before, busy_done)
    assert busy_done < FLOOD  # the flood was still queued behind it
