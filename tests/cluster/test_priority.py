"""The cluster's processes keep the priority of what started them: each in a process group of its own (how it
is stopped) but in its starter's session, so that its nice value is what the scheduler weighs. In a session of its
own, autogroup scheduling gives it a group at nice 0, as heavy as the whole session that started it (``make
test``'s nice-10 real-cluster suite took half the CPU from the main suite this way)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SPAWN = """
import os, subprocess
from kiln_cluster.priority import SPAWN
ours = subprocess.Popen(["sleep", "30"], **SPAWN)
own_session = subprocess.Popen(["sleep", "30"], start_new_session=True)
group = lambda pid: open(f"/proc/{pid}/autogroup").read().split()[0]
print(os.getpriority(os.PRIO_PROCESS, ours.pid), os.getpgid(ours.pid) == ours.pid, os.getsid(ours.pid) == os.getsid(0),
      group(ours.pid) == group(os.getpid()), group(own_session.pid) == group(os.getpid()))
for p in (ours, own_session):
    p.kill()
"""


def test_a_started_process_has_a_group_of_its_own_in_its_starters_session_at_its_starters_nice_value():
    if not Path("/proc/self/autogroup").exists():
        pytest.skip("this kernel has no autogroup scheduling (CONFIG_SCHED_AUTOGROUP)")
    starter = min(os.getpriority(os.PRIO_PROCESS, 0) + 7, 19)
    done = subprocess.run(["nice", "-n", "7", sys.executable, "-P", "-c", SPAWN], capture_output=True, text=True,
                          timeout=60, check=True)
    assert done.stdout.split() == [str(starter), "True", "True", "True", "False"], done.stdout
