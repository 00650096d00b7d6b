"""Compute threads ask for normal priority, and the threads they start inherit it."""

from __future__ import annotations

import os
import threading

import pytest

from target_actor.priority import NORMAL, raise_process_priority, raise_thread_priority

pytestmark = pytest.mark.skipif(not hasattr(os, "setpriority"), reason="no thread niceness")


def _in_thread(fn):
    out = {}

    def run():
        out["value"] = fn()

    t = threading.Thread(target=run)
    t.start()
    t.join()
    return out["value"]


def _nice() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


def test_a_niced_thread_gets_normal_priority_and_passes_it_on():
    def body():
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 15)  # as Ray's workers
        ok = raise_thread_priority()
        return ok, _nice(), _in_thread(_nice)  # a thread made afterwards (an OpenMP team)

    ok, mine, child = _in_thread(body)
    if not ok:  # no CAP_SYS_NICE here: the call says so and leaves the thread as it was
        assert mine == 15
        return
    assert mine == NORMAL and child == NORMAL


def test_a_thread_already_at_normal_priority_is_left_alone():
    if _nice() > NORMAL:
        pytest.skip("the suite itself runs niced")
    assert _in_thread(lambda: (raise_thread_priority(), _nice())) == (True, _nice())


def test_the_process_call_raises_every_thread_already_running():
    """A niced thread holding the GIL beside a computing thread is a priority inversion:
    the replica raises all of its threads (Serve's loops too), not only the engine's."""
    ready, done, seen = threading.Event(), threading.Event(), {}

    def niced():  # as Serve's event-loop threads in a Ray worker
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 15)
        seen["tid"] = threading.get_native_id()
        ready.set()
        done.wait(10)

    t = threading.Thread(target=niced)
    t.start()
    try:
        ready.wait(10)
        ok = raise_process_priority()
        nice = os.getpriority(os.PRIO_PROCESS, seen["tid"])
    finally:
        done.set()
        t.join()
    assert nice == (NORMAL if ok else 15)
