"""Replica metrics: EngineStats' new totals and timing logs, and their export as increments."""

from __future__ import annotations

from types import SimpleNamespace

from services.engine.metrics import EngineStats, TimingLog
from services.serving.metrics import COUNTERS, GAUGES, HISTOGRAMS, EngineMetrics, series_names


class Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[float, dict]] = []

    def inc(self, value, tags):
        self.calls.append((value, dict(tags)))

    set = observe = inc

    def total(self, **tags) -> float:
        return sum(v for v, t in self.calls if tags.items() <= t.items())


def finished_seq(prompt: int, output: int, reason: str = "length"):
    return SimpleNamespace(
        prompt_ids=[1] * prompt,
        output_ids=[2] * output,
        finish_reason=reason,
        arrival_time=10.0,
        finish_time=10.5,
    )


def fake_engine(stats: EngineStats, drafter=None):
    sched = SimpleNamespace(running=[1, 2], waiting=[3], reserved_tokens=25, capacity=100)
    return SimpleNamespace(stats=stats, scheduler=sched, drafter=drafter)


def recording_metrics() -> EngineMetrics:
    m = EngineMetrics("m")  # Ray's metric objects work without a cluster (records dropped)
    m.counters = {n: Recorder() for n in COUNTERS}
    m.labelled = {n: Recorder() for n in m.labelled}
    m.gauges = {n: Recorder() for n in GAUGES}
    m.histograms = {n: Recorder() for n in HISTOGRAMS}
    return m


def test_engine_stats_counts_what_clients_get():
    s = EngineStats()
    s.observe_round(0.01, 0.02, 0.035, num_draft=[3, 0], num_accepted=[2, 0])
    s.observe_finish(finished_seq(7, 4))
    s.observe_finish(finished_seq(5, 2, reason="abort"))
    assert (s.num_prompt_tokens, s.num_output_tokens, s.finished) == (12, 6, 2)
    assert s.round_log.drain() == [(0.01, 0.02, 0.035)] and s.round_log.drain() == []
    assert s.request_log.drain() == [(0.5,)]  # the abort is not a latency sample
    assert s.summary()["num_output_tokens"] == 6


def test_timing_log_keeps_the_most_recent():
    log = TimingLog(maxlen=3)
    for i in range(5):
        log.add(float(i))
    assert log.drain() == [(2.0,), (3.0,), (4.0,)]


def test_update_exports_increments_labels_and_histograms():
    stats = EngineStats()
    drafter = SimpleNamespace(
        counters=lambda: {"drafter_fallbacks": 2, "drafter_failures": 1, "drafter_enabled": True}
    )
    engine = fake_engine(stats, drafter)
    m = recording_metrics()
    stats.observe_round(0.01, 0.02, 0.04, [4, 4], [3, 1])
    stats.observe_finish(finished_seq(10, 6))
    m.update(m.snapshot(engine))
    stats.observe_round(0.01, 0.02, 0.04, [4], [4])
    stats.observe_finish(finished_seq(10, 6, reason="stop"))
    m.update(m.snapshot(engine))

    c = m.counters
    assert c["spec_decode_num_drafts"].total() == 3
    assert c["spec_decode_num_draft_tokens"].total() == 12
    assert c["spec_decode_num_accepted_tokens"].total() == 8
    assert c["output_tokens"].total() == 12 and c["prompt_tokens"].total() == 20
    assert c["drafter_fallbacks"].total() == 2  # exported once, not per snapshot
    per_pos = m.labelled["spec_decode_num_accepted_tokens_per_pos"]
    assert [per_pos.total(position=str(p)) for p in range(4)] == [3, 2, 2, 1]
    success = m.labelled["request_success"]
    assert success.total(finished_reason="length") == 1
    assert success.total(finished_reason="stop") == 1
    assert len(m.histograms["round_time_seconds"].calls) == 2
    assert m.histograms["e2e_request_latency_seconds"].calls[0][0] == 0.5
    assert m.gauges["kv_cache_usage_perc"].calls[-1][0] == 0.25
    assert m.gauges["drafter_enabled"].calls[-1][0] == 1.0


def test_plain_mode_exports_zero_drafts():
    m = recording_metrics()
    stats = EngineStats()
    stats.observe_round(0.0, 0.02, 0.021, [0, 0], [0, 0])
    m.update(m.snapshot(fake_engine(stats)))
    assert m.counters["spec_decode_num_drafts"].total() == 0
    assert m.gauges["drafter_enabled"].calls[-1][0] == 0.0


def test_series_names_follow_rays_export():
    names = series_names()
    assert "ray_longspark_spec_decode_num_drafts_total" in names
    assert "ray_longspark_spec_decode_num_accepted_tokens_per_pos_total" in names
    assert "ray_longspark_time_to_first_token_seconds_bucket" in names
    assert "ray_longspark_num_requests_running" in names
