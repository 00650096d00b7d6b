"""``longspark soak``: steady load on a local server, memory and latency watched over time
(``services.bench.soak``)."""

from __future__ import annotations

import argparse
import os

from services.bench.soak import SoakConfig, write
from services.bench.soak import run as run_soak
from services.cli.types import positive_int, require_loopback


def add_parser(sub) -> None:
    """``longspark soak``'s options (defaults: the 30-minute run)."""
    p = sub.add_parser("soak", help="steady load on a local server; RSS and TPOT over time")
    d = SoakConfig()
    p.add_argument("--url", default=d.url, help="the server (loopback only)")
    p.add_argument("--duration", type=float, default=d.duration_s, help="seconds")
    p.add_argument("--warmup", type=float, default=d.warmup_s, help="seconds not judged")
    p.add_argument("--sample", type=float, default=d.sample_s, help="seconds a window")
    p.add_argument("--concurrency", type=positive_int, default=d.concurrency)
    p.add_argument("--max-tokens", type=positive_int, default=d.max_tokens)
    p.add_argument("--max-growth", type=float, default=d.max_growth, help="RSS, after warm-up")
    p.add_argument("--api-key", default=os.environ.get("LONGSPARK_API_KEY"))
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--json", default=None, help="write the report to this file")
    p.add_argument("--plot", default=None, help="write RSS and TPOT over time to this PNG")


def run(args: argparse.Namespace) -> None:
    require_loopback(args.url, "the soak")
    if args.warmup >= args.duration:
        raise ValueError("--warmup must be shorter than --duration")
    cfg = SoakConfig(
        url=args.url,
        duration_s=args.duration,
        warmup_s=args.warmup,
        sample_s=args.sample,
        concurrency=args.concurrency,
        max_tokens=args.max_tokens,
        max_growth=args.max_growth,
        api_key=args.api_key,
        seed=args.seed,
    )
    report = run_soak(cfg)
    text = write(report, args.json, args.plot)
    print(text if len(text) < 4000 else text[:4000] + "\n...")
    if not report.passed:
        raise RuntimeError("the soak failed: see the report")
