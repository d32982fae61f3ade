"""Processes the cluster starts in sessions of their own run at the priority of the process that started them.

Linux's autogroup scheduling (``/proc/sys/kernel/sched_autogroup_enabled``) gives every session a scheduling
group of its own, at nice 0, and shares the CPU between groups before it looks at any process's nice value.
So a process started with ``start_new_session`` (the control plane's daemons, the node agent, each pod's
containers: they outlive the shell that started them and are stopped by session) drops the nice value it
inherited: ``make test`` runs the real-cluster suite at nice 10 beside the main suite, and its apiserver,
build Jobs and pods each took as much of the two cores as the whole main suite.
"""

from __future__ import annotations

import os
from pathlib import Path


def keep_priority(pid: int) -> None:
    """Give ``pid``'s session group (just made by ``start_new_session``) this process's nice value. Nothing
    where the kernel has no autogroups, the process is gone, or the value would need privileges."""
    try:
        Path(f"/proc/{pid}/autogroup").write_text(str(os.getpriority(os.PRIO_PROCESS, 0)))
    except OSError:
        pass
