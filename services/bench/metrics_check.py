"""Do the service's Prometheus counters agree with what the benchmark client saw?

The client counts, from the responses, the requests it completed, the tokens it
received and sent (``usage``) and the drafts, draft tokens and accepted tokens
the server reported per request (the ``longspark`` extras). The replica's counters must
move by exactly as much between a scrape before the run and one after it. Counters
reach the metrics endpoint a few seconds late (the replica exports every couple of
seconds, Ray's agent on its own interval), so :meth:`MetricsWatch.settle` scrapes until
they agree or a timeout passes; a disagreement that outlives the timeout is a failure.
"""

from __future__ import annotations

import time
import urllib.error
from dataclasses import asdict, dataclass, field
from typing import Any

from services.bench import prom
from target_actor.errors import LongSparkError

# observed field -> the counter (bare Prometheus sample name) that must match it
MATCHES = {
    "requests": "request_success_total",
    "prompt_tokens": "prompt_tokens_total",
    "output_tokens": "output_tokens_total",
    "drafts": "spec_decode_num_drafts_total",
    "draft_tokens": "spec_decode_num_draft_tokens_total",
    "accepted_tokens": "spec_decode_num_accepted_tokens_total",
}
PER_POS = "spec_decode_num_accepted_tokens_per_pos_total"


class MetricsMismatch(LongSparkError, RuntimeError):
    """The scraped counters disagree with what the benchmark observed."""


@dataclass
class Observed:
    """What the client saw, summed over the requests of one deployment."""

    requests: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0
    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0

    def add(
        self,
        prompt_tokens: int,
        output_tokens: int,
        drafts: int = 0,
        draft_tokens: int = 0,
        accepted_tokens: int = 0,
    ) -> None:
        self.requests += 1
        self.prompt_tokens += prompt_tokens
        self.output_tokens += output_tokens
        self.drafts += drafts
        self.draft_tokens += draft_tokens
        self.accepted_tokens += accepted_tokens


def compare(observed: Observed, deltas: prom.Samples) -> list[str]:
    """One line per disagreement between ``observed`` and the scraped ``deltas``."""
    problems = []
    for attr, name in MATCHES.items():
        want, got = getattr(observed, attr), prom.total(deltas, name)
        if got != want:
            problems.append(f"{name}: scraped +{got:g}, observed {want}")
    per_pos = sum(prom.by_label(deltas, PER_POS, "position").values())
    accepted = prom.total(deltas, MATCHES["accepted_tokens"])
    if per_pos != accepted:
        problems.append(f"{PER_POS}: sums to +{per_pos:g}, accepted tokens +{accepted:g}")
    return problems


@dataclass
class CheckResult:
    ok: bool
    problems: list[str]
    observed: dict[str, int]
    scraped: dict[str, float]
    waited_s: float
    urls: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def reachable(urls: list[str]) -> list[str]:
    """The URLs among ``urls`` that answer a scrape now."""
    ok = []
    for url in urls:
        try:
            prom.scrape([url], timeout_s=3.0)
            ok.append(url)
        except (OSError, urllib.error.URLError):
            continue
    return ok


class MetricsWatch:
    """Scrapes before (at construction) and after; settles on agreement or times out."""

    def __init__(self, urls: list[str], timeout_s: float = 60.0, poll_s: float = 0.5) -> None:
        if not urls:
            raise ValueError("no metrics endpoint to scrape")
        self.urls, self.timeout_s, self.poll_s = urls, timeout_s, poll_s
        self.baseline = prom.scrape(urls)

    def settle(self, observed: Observed) -> CheckResult:
        t0 = time.monotonic()
        while True:
            deltas = prom.delta(self.baseline, prom.scrape(self.urls))
            problems = compare(observed, deltas)
            waited = time.monotonic() - t0
            if not problems or waited >= self.timeout_s:
                scraped = {name: prom.total(deltas, name) for name in MATCHES.values()}
                return CheckResult(
                    not problems, problems, asdict(observed), scraped, round(waited, 2), self.urls
                )
            time.sleep(self.poll_s)
