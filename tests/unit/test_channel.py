"""The engine -> rank channel: messages, errors, a closed or silent peer, the key."""

from __future__ import annotations

import threading
from multiprocessing.connection import Client
from multiprocessing.context import AuthenticationError

import pytest
import torch

from target_actor.channel import ChannelGroup, TargetLostError, dumps, loads, new_key, serve


def test_tensors_round_trip_by_value() -> None:
    cases = [
        torch.randn(3, 4),
        torch.randn(2, 3).bfloat16(),
        torch.zeros(0, 5),
        torch.tensor(7),
        torch.arange(10)[::2],  # not contiguous
        torch.ones(2, 2, dtype=torch.bool),
    ]
    back = loads(dumps({"xs": cases, "n": 3}))
    assert back["n"] == 3
    for sent, got in zip(cases, back["xs"], strict=True):
        assert got.dtype == sent.dtype and got.shape == sent.shape
        assert torch.equal(got, sent)
    back["xs"][0].add_(1)  # writable, its own memory
    assert not torch.equal(back["xs"][0], cases[0])


class _Rank:
    def __init__(self) -> None:
        self.calls: list[str] = []
        self.release = threading.Event()

    def handle(self, method: str, args: tuple) -> object:
        self.calls.append(method)
        if method == "add":
            return args[0] + args[1]
        if method == "fail":
            raise ValueError("bad sequence 3")
        if method == "hang":
            self.release.wait(10)
            return "released"
        raise AttributeError(method)


def _group(ranks: list[_Rank], beat_s: float = 0.5, silence_s: float | None = None):
    key = new_key()
    addresses = [serve("127.0.0.1", key, r.handle, beat_s) for r in ranks]
    return ChannelGroup(addresses, key, silence_s)


def test_every_rank_runs_the_call_and_rank_0_answers() -> None:
    ranks = [_Rank(), _Rank()]
    group = _group(ranks)
    assert group.call("add", (torch.ones(2), torch.ones(2))).tolist() == [2.0, 2.0]
    assert [r.calls for r in ranks] == [["add"], ["add"]]
    group.close()


def test_a_rank_error_is_raised_as_it_was_and_the_channel_goes_on() -> None:
    group = _group([_Rank()])
    with pytest.raises(ValueError, match="bad sequence 3"):
        group.call("fail", ())
    assert group.call("add", (1, 2)) == 3
    group.close()


def test_a_slow_rank_that_beats_is_waited_for() -> None:
    rank = _Rank()
    group = _group([rank], beat_s=0.05, silence_s=0.3)
    threading.Timer(1.0, rank.release.set).start()  # the call runs > 3x the silence bound
    assert group.call("hang", ()) == "released"
    group.close()


def test_a_silent_rank_is_lost_and_so_is_a_closed_channel() -> None:
    quiet, beating = _Rank(), _Rank()
    key = new_key()
    addresses = [
        serve("127.0.0.1", key, beating.handle, 0.05),
        serve("127.0.0.1", key, quiet.handle, 60),
    ]
    group = ChannelGroup(addresses, key, silence_s=0.3)  # rank 0 beats, rank 1 is silent
    with pytest.raises(TargetLostError, match="rank 1 sent nothing"):
        group.call("hang", ())
    quiet.release.set()
    beating.release.set()
    group.close()
    with pytest.raises(TargetLostError, match="closed"):
        group.call("add", (1, 2))


def test_a_peer_without_the_key_is_refused() -> None:
    rank = _Rank()
    address = serve("127.0.0.1", new_key(), rank.handle)
    with pytest.raises(AuthenticationError):
        Client(address, authkey=new_key())
    assert rank.calls == []
