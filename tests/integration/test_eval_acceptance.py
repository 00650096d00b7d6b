"""``longspark eval acceptance`` reports tau per category through the real engine."""

from __future__ import annotations

import pytest

from services.bench.eval_acceptance import eval_acceptance
from services.data.prompts import BENCHMARK_SETS

pytestmark = pytest.mark.slow


def test_eval_reports_tau_per_category(smollm2_path):
    report = eval_acceptance("random", k=3, per_category=1, max_tokens=8, temperatures=(0.0, 1.0))
    for key in ("T=0", "T=1"):
        tau = report[key]["tau"]
        assert set(tau) == set(BENCHMARK_SETS) | {"overall"}
        assert all(v is None or 1.0 <= v <= 4.0 for v in tau.values())
        assert set(report[key]["se"]) == set(tau)


def test_eval_reports_the_flags_in_effect(smollm2_path):
    report = eval_acceptance(
        "random",
        k=3,
        per_category=1,
        max_tokens=4,
        temperatures=(0.0,),
        carry=False,
        context_copy=False,
    )
    assert (report["carry"], report["context_copy"]) == (False, False)
