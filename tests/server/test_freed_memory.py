"""The server's malloc setting: once the heap has grown, a large tensor costs no page faults."""

from __future__ import annotations

import subprocess
import sys

import pytest

PROBE = """
import resource, sys, torch
from plies.server._serve import reuse_freed_memory
if sys.argv[1] == "tuned":
    assert reuse_freed_memory()
for _ in range(2):  # 256 MB, touched, then freed: the heap grows to hold it
    torch.ones(1 << 26)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
torch.ones(1 << 26)
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def faults_of_a_second_allocation(mode: str) -> int:
    done = subprocess.run(
        [sys.executable, "-c", PROBE, mode], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return int(done.stdout)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_a_freed_large_tensor_is_reused_rather_than_faulted_in_again():
    pages = (1 << 26) * 4 // 4096
    assert faults_of_a_second_allocation("default") > pages // 2  # glibc maps it afresh
    assert faults_of_a_second_allocation("tuned") < pages // 50  # the heap's own pages
