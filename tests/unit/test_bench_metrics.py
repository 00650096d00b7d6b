"""The benchmark's metrics check: Prometheus text in, deltas, agreement with what was observed."""

from __future__ import annotations

import argparse
import json

import pytest

from services.bench import metrics_check, prom
from services.bench.metrics_check import MetricsWatch, Observed, compare
from services.cli import bench as bench_cli

RAY_LABELS = (
    'Component="core_worker",NodeAddress="10.0.0.1",SessionName="s",Version="2.60.0",'
    'WorkerId="{worker}",model_name="m",otel_scope_name="x",otel_scope_schema_url="",'
    'otel_scope_version=""'
)


def exposition(worker: str = "w1", **values: float) -> str:
    """Text as Ray 2.60's metrics agent serves it (counters get ``_total``)."""
    lines = ["# HELP ray_tasks tasks", "# TYPE ray_tasks gauge", 'ray_tasks{State="x"} 3.0']
    labels = RAY_LABELS.format(worker=worker)
    for name, value in values.items():
        extra = ""
        if name.startswith("pos"):
            name, extra = "spec_decode_num_accepted_tokens_per_pos", f',position="{name[3:]}"'
        if name.startswith("reason_"):
            name, extra = "request_success", f',finished_reason="{name[7:]}"'
        lines += [
            f"# TYPE ray_longspark_{name}_total counter",
            f"ray_longspark_{name}_total{{{labels}{extra}}} {float(value)}",
        ]
    return "\n".join(lines) + "\n"


AGREEING = dict(
    reason_length=3,
    prompt_tokens=90,
    output_tokens=48,
    spec_decode_num_drafts=10,
    spec_decode_num_draft_tokens=40,
    spec_decode_num_accepted_tokens=15,
    pos0=8,
    pos1=5,
    pos2=2,
)


def observed() -> Observed:
    o = Observed()
    o.add(30, 16, 4, 16, 5)
    o.add(30, 16, 3, 12, 5)
    o.add(30, 16, 3, 12, 5)
    return o


def test_parse_keeps_our_series_under_both_spellings():
    samples = prom.parse(exposition(output_tokens=5))
    assert prom.total(samples, "output_tokens_total") == 5
    assert all(name != "tasks" for name, _ in samples)
    relabelled = prom.parse('longspark:output_tokens_total{model_name="m"} 7\n')
    assert prom.total(relabelled, "output_tokens_total") == 7


def test_agreeing_scrape_passes():
    deltas = prom.delta({}, prom.parse(exposition(**AGREEING)))
    assert compare(observed(), deltas) == []


@pytest.mark.parametrize(
    "change, complaint",
    [
        ({"output_tokens": 47}, "output_tokens_total"),
        ({"spec_decode_num_accepted_tokens": 16}, "spec_decode_num_accepted_tokens_total"),
        ({"pos2": 3}, "per_pos"),
        ({"reason_length": 2}, "request_success_total"),
        ({"prompt_tokens": 0}, "prompt_tokens_total"),
    ],
)
def test_disagreeing_scrape_fails(change, complaint):
    deltas = prom.delta({}, prom.parse(exposition(**{**AGREEING, **change})))
    problems = compare(observed(), deltas)
    assert problems and any(complaint in p for p in problems), problems


def test_delta_subtracts_per_series_and_ignores_vanished_ones():
    before = prom.parse(exposition("old", output_tokens=100)) | prom.parse(
        exposition("new", output_tokens=10)
    )
    after = prom.parse(exposition("new", output_tokens=58))  # "old" replica went away
    assert prom.total(prom.delta(before, after), "output_tokens_total") == 48


def test_watch_times_out_on_disagreement(monkeypatch):
    scrapes = iter(
        [exposition(output_tokens=0)] + [exposition(**{**AGREEING, "prompt_tokens": 1})] * 50
    )
    monkeypatch.setattr(prom, "scrape", lambda urls, timeout_s=10.0: prom.parse(next(scrapes)))
    watch = MetricsWatch(["http://x/metrics"], timeout_s=0.2, poll_s=0.05)
    result = watch.settle(observed())
    assert not result.ok and any("prompt_tokens_total" in p for p in result.problems)
    assert result.scraped["output_tokens_total"] == 48


def test_watch_waits_for_late_counters(monkeypatch):
    late = [exposition()] * 3 + [exposition(**AGREEING)] * 50
    scrapes = iter([exposition()] + late)
    monkeypatch.setattr(prom, "scrape", lambda urls, timeout_s=10.0: prom.parse(next(scrapes)))
    result = MetricsWatch(["http://x/metrics"], timeout_s=5.0, poll_s=0.01).settle(observed())
    assert result.ok and result.problems == []


def test_discover_reads_rays_service_discovery_file(tmp_path):
    sd = tmp_path / "sd.json"
    sd.write_text(json.dumps([{"labels": {"job": "ray"}, "targets": ["10.0.0.1:8080", "h:1"]}]))
    assert prom.discover(sd) == ["http://10.0.0.1:8080/metrics", "http://h:1/metrics"]
    assert prom.discover(tmp_path / "missing.json") == []


def test_a_failed_check_makes_the_command_exit_nonzero(monkeypatch, tmp_path, capsys):
    from services.cli.main import main

    report = {"ok": False, "problems": ["spec C=1: metrics disagree: output_tokens_total"]}
    monkeypatch.setattr(bench_cli, "_throughput", lambda args: report)
    out = tmp_path / "r.json"
    assert main(["bench", "throughput", "--concurrency", "1", "--json", str(out)]) == 2
    assert json.loads(out.read_text()) == report  # the report is written before failing
    assert "metrics disagree" in capsys.readouterr().err
    with pytest.raises(bench_cli.BenchFailed):
        bench_cli.run(argparse.Namespace(bench_command="throughput", json=None, plot=None))


def test_matches_cover_every_client_side_count():
    assert set(metrics_check.MATCHES) == set(vars(Observed()))
