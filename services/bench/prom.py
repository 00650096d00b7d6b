"""Prometheus scrapes: fetch an exposition, keep our series, and subtract two scrapes.

Ray's metrics agent serves every Ray and application metric of a node on the node's
metrics export port (``ray start --metrics-export-port``, or ``_metrics_export_port``
in ``ray.init``); the head writes the agents' addresses to
``/tmp/ray/prom_metrics_service_discovery.json`` when its dashboard runs. Our metrics
appear there as ``ray_longspark_<name>``, or as ``longspark:<name>`` after the rename
in ``deploy/prometheus.yml``; both spellings map to the bare ``<name>`` here.
"""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

SD_FILE = Path("/tmp/ray/prom_metrics_service_discovery.json")
OUR_PREFIXES = ("ray_longspark_", "longspark:")

Labels = tuple[tuple[str, str], ...]
Samples = dict[tuple[str, Labels], float]  # (bare name, sorted labels) -> value


def parse(text: str, source: str = "") -> Samples:
    """Our samples of one exposition; ``source`` (the URL) is kept as a label."""
    from prometheus_client.parser import text_string_to_metric_families

    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            name = next((s.name[len(p) :] for p in OUR_PREFIXES if s.name.startswith(p)), None)
            if name is None:
                continue
            labels = dict(s.labels, __source__=source) if source else dict(s.labels)
            key = (name, tuple(sorted(labels.items())))
            out[key] = out.get(key, 0.0) + float(s.value)
    return out


def scrape(urls: list[str], timeout_s: float = 10.0) -> Samples:
    """Our samples from every endpoint (one that does not answer raises)."""
    out: Samples = {}
    for url in urls:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            out.update(parse(resp.read().decode("utf-8", "replace"), source=url))
    return out


def discover(sd_file: Path = SD_FILE) -> list[str]:
    """The ``/metrics`` URLs Ray's service-discovery file lists (empty if there is none)."""
    try:
        groups = json.loads(sd_file.read_text())
    except (OSError, ValueError):
        return []
    return [f"http://{t}/metrics" for g in groups for t in g.get("targets", [])]


def delta(before: Samples, after: Samples) -> Samples:
    """Per series, ``after - before``; a series new since ``before`` counts from zero.

    A series that vanished (a replica that went away) is left out: its increments
    happened before ``before`` was taken, or are lost with it.
    """
    return {key: value - before.get(key, 0.0) for key, value in after.items()}


def total(samples: Samples, name: str, **labels: str) -> float:
    """Sum of the series called ``name`` whose labels include ``labels``."""
    want = set(labels.items())
    return sum(v for (n, lab), v in samples.items() if n == name and want <= set(lab))


def by_label(samples: Samples, name: str, label: str) -> dict[str, float]:
    """Sum of the series called ``name``, per value of ``label``."""
    out: dict[str, float] = {}
    for (n, lab), v in samples.items():
        value = dict(lab).get(label)
        if n == name and value is not None:
            out[value] = out.get(value, 0.0) + v
    return out
