"""Scheduling priority of the threads on a round's critical path.

Ray starts every worker process at niceness 15 (its ``worker_niceness``): the target ranks,
the drafter, the Serve replica and its HTTP proxy alike. On a host with as many cores as
a rank has OpenMP threads, the replica's and the proxy's per-token streaming work then
preempts a forward's threads as often as not, and each preemption stalls the other thread
at the next OpenMP barrier: served steps took 15-17 ms where the same forward takes ~10 ms
alone. The threads that compute a round (a rank's channel thread and its OpenMP team,
the drafter's, the engine thread) therefore ask for normal priority; streaming still runs,
in the gaps.

Linux keeps niceness per thread, and threads inherit it when created, so this is called
on the computing thread before it runs its first parallel region: its OpenMP team is
created then, with the same priority.
"""

from __future__ import annotations

import logging
import os
import threading

log = logging.getLogger("longspark.priority")

NORMAL = 0


def raise_thread_priority(nice: int = NORMAL) -> bool:
    """Set the calling thread's niceness to ``nice`` if it is lower than now; False (logged
    once per process at debug level) where the process may not (no CAP_SYS_NICE), or off
    Linux."""
    if not hasattr(os, "setpriority"):
        return False
    tid = threading.get_native_id()
    try:
        if os.getpriority(os.PRIO_PROCESS, tid) <= nice:
            return True
        os.setpriority(os.PRIO_PROCESS, tid, nice)
    except OSError as exc:  # EPERM / EACCES: an unprivileged container
        log.debug("thread priority stays as it is: %s", exc)
        return False
    return True
