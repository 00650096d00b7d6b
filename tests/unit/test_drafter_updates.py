"""A plain round's drafter updates wait in the Ray handle and go with the next call."""

from __future__ import annotations

import torch

from drafter_actor.worker import RayDrafter
from target_actor.channel import dumps, loads
from target_actor.messages import DraftRequest, RoundUpdate


class _Method:
    def __init__(self, log: list, name: str) -> None:
        self.log, self.name = log, name

    def remote(self, *args):
        if self.name == "call_packed":  # a tensor-carrying call: (method, packed args)
            method, payload = args
            self.log.append((method, loads(payload)))
            return dumps(None)
        self.log.append((self.name, args))
        return args


class _Actor:
    """Records the calls a ``RayDrafter`` makes (a stand-in for the Ray actor)."""

    def __init__(self) -> None:
        self.log: list = []

    def __getattr__(self, name: str) -> _Method:
        return _Method(self.log, name)


def _handle() -> RayDrafter:
    class _Ray:
        @staticmethod
        def get(value):
            return value

    h = object.__new__(RayDrafter)
    h._ray, h.actor, h.pending = _Ray, _Actor(), []
    return h


def _update(seq_id: int, length: int) -> RoundUpdate:
    e = torch.empty(0)
    return RoundUpdate(seq_id, length, e, e, e, e)


def test_plain_round_updates_go_with_the_next_propose_in_order() -> None:
    h = _handle()
    h.update([_update(1, 10), _update(2, 20)])
    h.update([_update(1, 11)])
    assert h.actor.log == []  # nothing crossed yet
    h.propose([DraftRequest(1, 5, 12)], 4, [_update(1, 12)])
    ((name, (requests, k, updates)),) = h.actor.log
    assert name == "propose" and k == 4
    assert [(u.seq_id, u.length) for u in updates] == [(1, 10), (2, 20), (1, 11), (1, 12)]
    assert h.pending == []


def test_updates_of_freed_or_restarted_sequences_are_dropped() -> None:
    h = _handle()
    h.update([_update(1, 10), _update(2, 20), _update(3, 30)])
    h.free([2])
    h.drop_pending([3])  # what a re-prefill does
    assert [(u.seq_id, u.length) for u in h.take_pending()] == [(1, 10)]


def test_a_long_plain_stretch_flushes_in_one_call() -> None:
    h = _handle()
    for i in range(RayDrafter.FLUSH_AT):
        h.update([_update(1, i)])
    ((name, (updates,)),) = h.actor.log
    assert name == "update" and len(updates) == RayDrafter.FLUSH_AT
    assert [u.length for u in updates] == list(range(RayDrafter.FLUSH_AT))
    assert h.pending == []
