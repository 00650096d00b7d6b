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

A process whose Python threads share the GIL with a computing thread (the Serve replica:
its engine thread, with the rank computing there at TP 1, beside Serve's event loops)
takes one priority for all of them (``raise_process_priority``). A niced loop thread that
holds the GIL is preempted by the compute threads it shares the cores with, and the engine
thread then waits for the GIL behind it: a priority inversion that cost ~15% of a served
token (``docs/experiments/runtime-kernels.md``, session 15).
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
    return _raise(threading.get_native_id(), nice)


def raise_process_priority(nice: int = NORMAL) -> bool:
    """``raise_thread_priority`` for every thread of this process now (threads made later
    inherit it from the thread that makes them); False if one of them could not be raised."""
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:  # no procfs: this thread at least
        tids = [threading.get_native_id()]
    return all([_raise(tid, nice) for tid in tids])


def _raise(tid: int, nice: int) -> bool:
    if not hasattr(os, "setpriority"):
        return False
    try:
        if os.getpriority(os.PRIO_PROCESS, tid) <= nice:
            return True
        os.setpriority(os.PRIO_PROCESS, tid, nice)
    except ProcessLookupError:  # the thread ended meanwhile
        return True
    except OSError as exc:  # EPERM / EACCES: an unprivileged container
        log.debug("thread priority stays as it is: %s", exc)
        return False
    return True
