"""The small soak: steady mixed load on a real Serve app (tiny model, spec with a random
drafter) for 90 s; no request may fail, the object store must come back to where it
started and the engine's processes (replica, target rank, drafter) must not grow after
warm-up. The 30-minute run on SmolLM2 is ``longspark soak`` (docs/HARDENING.md)."""

from __future__ import annotations

import pytest

from tests.conftest import make_tiny_chat_model
from tests.serving_helpers import serve_app

pytestmark = pytest.mark.ray

ENGINE_PROCESSES = ("ray::ServeReplica", "ray::TargetWorker", "ray::DrafterWorker")


def test_small_soak_is_flat_and_error_free(tmp_path):
    from services.bench.loadtest import OBJECT_STORE_SLACK
    from services.bench.soak import SoakConfig, run

    path = make_tiny_chat_model(tmp_path / "tiny")
    args = dict(
        target=str(path),
        model_name="tiny",
        drafter="random",
        k=3,
        adaptive=False,  # keep drafting: the drafter's state is part of what must not grow
        kv_cache_tokens=8192,
        cpus_per_actor=0.5,
    )
    with serve_app(args, name="soak") as url:
        cfg = SoakConfig(url=url, duration_s=90, warmup_s=30, sample_s=10, concurrency=4)
        report = run(cfg)
    print("soak:", {k: v for k, v in report.to_dict().items() if k != "samples"})
    assert report.requests > 0 and report.failed == 0, report.problems
    assert len(report.samples) >= 5
    assert report.object_store_growth <= OBJECT_STORE_SLACK
    ours = {p: g for p, g in report.rss_growth.items() if p.startswith(ENGINE_PROCESSES)}
    assert len(ours) == 2, (
        report.rss_growth
    )  # the replica (the tp-1 rank computes in it), the drafter
    assert all(g < cfg.max_growth for g in ours.values()), ours
