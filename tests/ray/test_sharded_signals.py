"""Ctrl-C once, twice and three times on a script that runs a `ShardedDriver` on its own Ray.

Each run starts `sharded_script.py` in a session of its own (so every process it and its
Ray start can be found by session id), sends SIGINT to its whole process group, as a
terminal's Ctrl-C does, 1-3 times at random moments, and checks: exit code 130 and no
traceback; the sink holds only whole records, and every group the driver admitted is in
it once (none lost, drained or cancelled); once only, every episode completed; the merged
quarantine report is complete and lists exactly the leases that the trajectories name; a
cancelled run reports each shard's state; afterwards no process of the run is left: no
shard actor, no Ray worker, raylet or GCS.
"""

from __future__ import annotations

import os
import random
import signal
import time

import pytest
from sessions import Script, left_after
from shard_parts import SKIP

pytest.importorskip("ray.actor", reason=SKIP)

from plies import Group, Status
from plies.runtime import read_jsonl
from plies.runtime._report import read_report

STEPS = ("interrupt: admission stopped", "second interrupt", "third interrupt")


@pytest.mark.timeout(240)
@pytest.mark.parametrize("presses", [1, 2, 3])
def test_ctrl_c_on_sharded_driver(policy_url, tmp_path, presses):
    rng = random.Random(presses)
    script = Script(tmp_path, policy_url, seed=presses)
    sid = script.proc.pid
    try:
        assert script.ready.wait(120), "the script never became ready:\n" + "".join(script.stderr)
        deadline = time.monotonic() + 30
        while len(script.ids("group")) < 4 and time.monotonic() < deadline:
            time.sleep(0.05)  # some groups through, so there is something to lose
        for _ in range(presses):
            os.killpg(sid, signal.SIGINT)
            time.sleep(rng.uniform(0.1, 0.4))
        code, err = script.finish(timeout=120)
        context = f"presses={presses}\n{err[-4000:]}"
        assert code == 130, context
        assert "Traceback" not in err, context
        for line in STEPS[:presses]:
            assert line in err, context

        # No lost records: every group admitted is on disk once, whole, with its members.
        read = read_jsonl(tmp_path / "groups.jsonl", Group)
        assert read.malformed == [], context
        on_disk = [g.id for g in read.records]
        assert len(on_disk) == len(set(on_disk)), context
        admitted = script.ids("admitted")
        assert admitted and admitted <= set(on_disk), context
        assert script.ids("group") <= set(on_disk), context
        assert all(g.complete for g in read.records), context
        statuses = {t.status for g in read.records for t in g.trajectories}
        if presses == 1:  # draining runs every episode to its end
            assert statuses == {Status.COMPLETED}, context
        else:
            assert statuses <= {Status.COMPLETED, Status.CANCELLED, Status.QUARANTINED}, context
        (stats,) = [e for e in script.events if e["event"] == "stats"]
        assert stats["running"] == 0 and stats["live"] == 0, (stats, context)
        assert stats["borrowed"] == stats["released"] + stats["quarantined"], (stats, context)
        assert stats["shards_alive"] == 2, (stats, context)

        # One merged report: exactly the leases the trajectories say were quarantined.
        report = read_report(tmp_path / "quarantine.json")
        assert report.complete, context
        named = {
            q["lease"]
            for g in read.records
            for t in g.trajectories
            for q in t.info.get("quarantined_leases", [])
        }
        assert {e.lease_id for e in report.entries if e.stage == "lease"} == named, context
        assert len(named) == stats["quarantined"], context
        if presses >= 2:  # a cancelled run says where each shard was left
            for index in (0, 1):
                assert f"plies: shard {index}:" in err, context
    finally:
        if script.proc.poll() is None:
            os.killpg(sid, signal.SIGKILL)
    # Nothing of the run is left: no shard actor, no Ray worker, raylet or GCS.
    assert left_after(sid, 15) == []
