"""How the cluster starts its processes (the control plane's daemons, the node agent, each pod's sandbox and
containers): each in a process group of its own, which is how they are stopped (``os.killpg``), but in the
session of the process that started them, so that the nice value each inherits is what the scheduler weighs.

Not a session of their own (``start_new_session``): Linux's autogroup scheduling
(``/proc/sys/kernel/sched_autogroup_enabled``) gives every session a scheduling group, at nice 0, and shares
the CPU between groups before it looks at any process's nice value. ``make test`` runs the real-cluster suite at
nice 10 beside the main suite, and its apiserver, build Jobs and pods, each in a session of its own, took as much
of the two cores as the whole main suite. Giving each new session the starter's nice value instead is no better:
a group then weighs a tenth of the starter's whole session, even when that holds only nice-19 neighbours.
"""

from __future__ import annotations

SPAWN = {"process_group": 0}  # subprocess.Popen keywords for every process the cluster starts
