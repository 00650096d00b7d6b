"""bench throughput's report: spec/plain comparison rows and the problems that fail a run."""

from __future__ import annotations

from services.bench.throughput import _compare, _problems


def stage(name, tps, tpot, ids, tau=None, failed=0, modes=("ar",), check_ok=True):
    return {
        "stage": name,
        "output_tokens_per_s": tps,
        "tpot_ms": {"p50": tpot},
        "tau": tau,
        "_token_ids": ids,
        "failed": failed,
        "errors": ["HTTP 503"] if failed else [],
        "modes_seen": list(modes),
        "metrics_check": {"ok": check_ok, "problems": [] if check_ok else ["x: scraped +1"]},
    }


def test_compare_ratios_and_greedy_agreement():
    modes = {
        "ar": {"stages": [stage("C=1", 10.0, 100.0, [[1, 2], [3]])]},
        "spec": {"stages": [stage("C=1", 25.0, 40.0, [[1, 2], [4]], tau=2.5, modes=["spec"])]},
    }
    (row,) = _compare(modes)
    assert row["spec_over_plain_tokens_per_s"] == 2.5
    assert row["spec_over_plain_tpot"] == 0.4
    assert row["greedy_identical"] == "1/2" and row["tau"] == 2.5
    assert _compare({"spec": modes["spec"]}) == []


def test_problems_name_failures_wrong_modes_and_metric_disagreements():
    assert _problems("ar", {"stages": [stage("C=1", 1, 1, [])]}) == []
    probs = _problems(
        "spec",
        {"stages": [stage("C=4", 1, 1, [], failed=2, modes=["ar"], check_ok=False)]},
    )
    assert len(probs) == 3
    assert "2 failed requests (HTTP 503)" in probs[0]
    assert "decoded in mode ['ar'], not spec" in probs[1]
    assert "metrics disagree: x: scraped +1" in probs[2]
