"""The server's malloc setting: once the heap has grown, a large tensor costs no page faults."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys

import pytest

PROBE = """
import json, resource, sys, torch
from plies.server._serve import reuse_freed_memory
if sys.argv[1] == "tuned":
    assert reuse_freed_memory()
for _ in range(2):  # 256 MB, touched, then freed: the heap grows to hold it
    torch.ones(1 << 26)
faults = []
for _ in range(8):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    torch.ones(1 << 26)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps(faults))
"""
PAGES = (1 << 26) * 4 // 4096


def faults_of_later_allocations(mode: str) -> list[int]:
    """Minor faults of each of eight 256 MB tensors allocated after the heap has grown."""
    done = subprocess.run(
        [sys.executable, "-c", PROBE, mode], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_a_freed_large_tensor_is_reused_rather_than_faulted_in_again():
    # The median, not every allocation: the claim is about the steady state of a training
    # loop (`bench/trainer_bench.py` prints its faults per step), and a host may now and then
    # fault a reused page in again (one CI run saw a whole tensor's pages once).
    default = faults_of_later_allocations("default")
    assert statistics.median(default) > PAGES // 2, default  # glibc maps each one afresh
    tuned = faults_of_later_allocations("tuned")
    assert statistics.median(tuned) < PAGES // 50, tuned  # the heap's own pages
