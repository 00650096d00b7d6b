"""tau and its standard error over prompts (``services.bench.eval_acceptance.tau_of``)."""

from __future__ import annotations

import random
import statistics

from services.bench.eval_acceptance import tau_of


def test_tau_is_accepted_over_rounds_plus_one():
    assert tau_of([(10, 5), (20, 30), (5, 0)])[0] == round(1 + 35 / 35, 3)
    assert tau_of([(4, 8)]) == (3.0, 0.0)
    assert tau_of([]) == (None, None) and tau_of([(0, 0)]) == (None, None)


def test_standard_error_matches_a_bootstrap_over_prompts():
    gen = random.Random(0)
    pairs = [(n, int(n * gen.uniform(0.2, 3.0))) for n in (gen.randint(5, 40) for _ in range(48))]
    tau, se = tau_of(pairs)
    boot = []
    for _ in range(3000):
        draw = [gen.choice(pairs) for _ in pairs]
        boot.append(1 + sum(a for _, a in draw) / sum(n for n, _ in draw))
    assert abs(statistics.mean(boot) - tau) < 0.02
    assert abs(statistics.stdev(boot) - se) < 0.15 * se


def test_identical_prompts_have_no_error():
    assert tau_of([(10, 7)] * 6) == (1.7, 0.0)
