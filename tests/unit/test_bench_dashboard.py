"""deploy/grafana/longspark.json and deploy/prometheus.yml agree with what the replicas export."""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

from services.serving.metrics import series_names

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
NAME = re.compile(r"longspark:[A-Za-z0-9_]+")


def _queries(dashboard: dict) -> list[str]:
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    for var in dashboard.get("templating", {}).get("list", []):
        query = var.get("query")
        exprs.append(query["query"] if isinstance(query, dict) else str(query or ""))
    return exprs


def _relabel(name: str) -> str:
    """deploy/prometheus.yml's metric_relabel_configs applied to one sample name."""
    config = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    (job,) = config["scrape_configs"]
    for rule in job["metric_relabel_configs"]:
        if rule.get("target_label") != "__name__":
            continue
        m = re.fullmatch(rule["regex"], name)  # Prometheus anchors relabel regexes
        if m:  # Prometheus writes groups as $1 or ${1}; Python's expand wants \g<1>
            name = m.expand(re.sub(r"\$\{?(\d)\}?", r"\\g<\1>", rule["replacement"]))
    return name


def test_dashboard_is_valid_grafana_json():
    dashboard = json.loads((DEPLOY / "grafana" / "longspark.json").read_text())
    assert dashboard["title"] and dashboard["uid"] and dashboard["schemaVersion"] >= 30
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for p in dashboard["panels"]:
        assert p["targets"], p["title"]
        assert {"x", "y", "w", "h"} <= p["gridPos"].keys()
        assert all(t["expr"].strip() and t["refId"] for t in p["targets"])


def test_every_queried_metric_is_exported():
    dashboard = json.loads((DEPLOY / "grafana" / "longspark.json").read_text())
    exported = {_relabel(n) for n in series_names()}
    queried = {name for expr in _queries(dashboard) for name in NAME.findall(expr)}
    assert queried, "the dashboard queries no longspark metric"
    assert queried <= exported, sorted(queried - exported)


def test_dashboard_covers_the_issue_panels():
    dashboard = json.loads((DEPLOY / "grafana" / "longspark.json").read_text())
    text = " ".join(_queries(dashboard))
    for needed in (
        "output_tokens_total",
        "spec_decode_num_accepted_tokens_per_pos_total",
        "spec_decode_num_drafts_total",
        "time_to_first_token_seconds_bucket",
        "time_per_output_token_seconds_bucket",
        "num_requests_waiting",
        "drafter_fallbacks_total",
    ):
        assert f"longspark:{needed}" in text, needed


def test_relabel_maps_ray_names_to_vllm_style():
    assert _relabel("ray_longspark_spec_decode_num_drafts_total") == (
        "longspark:spec_decode_num_drafts_total"
    )
    assert _relabel("ray_serve_num_http_requests_total") == "ray_serve_num_http_requests_total"
    config = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    (job,) = config["scrape_configs"]
    files = job["file_sd_configs"][0]["files"]
    assert files == ["/tmp/ray/prom_metrics_service_discovery.json"]
