"""The cluster's processes start in sessions of their own and keep the priority of what started them: with
autogroup scheduling a new session is otherwise a group at nice 0, as heavy as every other session together
(``make test``'s nice-10 real-cluster suite took half the CPU from the main suite this way)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SPAWN = """
import subprocess
from kiln_cluster.priority import keep_priority
kept, plain = (subprocess.Popen(["sleep", "30"], start_new_session=True) for _ in range(2))
keep_priority(kept.pid)
for p in (kept, plain):
    print(open(f"/proc/{p.pid}/autogroup").read().split()[-1])
    p.kill()
"""


def test_a_process_in_a_session_of_its_own_keeps_its_starters_nice_value():
    if not Path("/proc/self/autogroup").exists():
        pytest.skip("this kernel has no autogroup scheduling (CONFIG_SCHED_AUTOGROUP)")
    starter = min(os.getpriority(os.PRIO_PROCESS, 0) + 7, 19)
    done = subprocess.run(["nice", "-n", "7", sys.executable, "-P", "-c", SPAWN], capture_output=True, text=True,
                          timeout=60, check=True)
    kept, plain = done.stdout.split()
    assert int(kept) == starter, done.stdout
    assert int(plain) == 0, done.stdout  # what a new session gets without it
