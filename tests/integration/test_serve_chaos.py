"""The small chaos load under real Ray Serve: the load test's three faults (the drafter,
the target rank and the engine replica, each SIGKILLed once while requests flow) against
the default served layout (the API inside the replica, TP 1, as ``longspark serve``).

Every request ends in a full answer (greedy ones equal plain decoding in this process,
at the same TP, so the sums add in the same order) or a clear error; none hangs, and the
replica that is left holds nothing (KV, sequences, drafter states, object store).
The full-size run (SmolLM2, 300 requests at 64) is in docs/HARDENING.md.
"""

from __future__ import annotations

import pytest

from tests.conftest import make_tiny_chat_model
from tests.serving_helpers import serve_app

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return make_tiny_chat_model(tmp_path_factory.mktemp("tiny-chaos"))


@pytest.fixture(scope="module")
def chaos_server(tiny_model):
    args = dict(
        target=str(tiny_model),
        model_name="tiny",
        drafter="random",
        k=2,
        kv_cache_tokens=8192,
        cpus_per_actor=0.5,
        max_ongoing_requests=16,
        target_process="actors",  # a rank of its own to kill
    )
    with serve_app(args, name="chaos") as url:
        yield url


def test_small_chaos_load_every_fault(chaos_server, tiny_model):
    from services.bench.loadtest import LoadTestConfig, run

    cfg = LoadTestConfig(
        url=chaos_server,
        requests=60,
        concurrency=8,
        time_limit_s=300,
        request_timeout_s=120,
        max_tokens=12,
        disconnect_fraction=0.15,
        faults=("drafter", "rank", "replica"),
        target=str(tiny_model),
    )
    report = run(cfg)
    print("chaos load:", report.to_dict())
    assert report.tried == 60 and sum(report.outcomes.values()) == 60
    assert all(pid > 0 for pid in report.faults.values()) and len(report.faults) == 3
    assert report.outcomes.get("bad", 0) == 0 and report.outcomes.get("hung", 0) == 0
    assert set(report.outcomes) <= {
        "ok",
        "disconnected",
        "error:503:replica_unavailable",
        "error:stream:replica_unavailable",
    }, report.outcomes
    assert report.outcomes.get("ok", 0) > 0 and report.greedy_checked > 0
    assert report.greedy_mismatches == 0, report.problems
    assert not report.leaked and report.passed
