"""``longspark loadtest``: the bounded, self-checking load test (``services.bench.loadtest``)."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from services.bench.loadtest import FAULTS, LoadTestConfig
from services.bench.loadtest import run as run_loadtest
from services.cli.types import positive_int, require_loopback


def add_parser(sub) -> None:
    """``longspark loadtest``'s options (defaults: the full-size run)."""
    p = sub.add_parser("loadtest", help="bounded, self-checking load test of a local server")
    d = LoadTestConfig()
    p.add_argument("--url", default=d.url, help="the server (loopback only)")
    p.add_argument("--requests", type=positive_int, default=d.requests)
    p.add_argument("--concurrency", type=positive_int, default=d.concurrency)
    p.add_argument("--time-limit", type=float, default=d.time_limit_s, help="seconds")
    p.add_argument("--max-tokens", type=positive_int, default=d.max_tokens)
    p.add_argument("--disconnect-fraction", type=float, default=d.disconnect_fraction)
    p.add_argument(
        "--faults",
        default=",".join(d.faults),
        help=f"comma-separated processes to SIGKILL once each, spread over the run: "
        f"{', '.join(FAULTS)} (default: %(default)s; '' for none)",
    )
    p.add_argument("--target", default=None, help="the served target (default: SmolLM2)")
    p.add_argument("--api-key", default=os.environ.get("LONGSPARK_API_KEY"))
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--json", default=None, help="also write the report to this file")


def run(args: argparse.Namespace) -> None:
    require_loopback(args.url, "the load test")
    cfg = LoadTestConfig(
        url=args.url,
        requests=args.requests,
        concurrency=args.concurrency,
        time_limit_s=args.time_limit,
        max_tokens=args.max_tokens,
        disconnect_fraction=args.disconnect_fraction,
        faults=tuple(f for f in args.faults.split(",") if f),
        target=args.target,
        api_key=args.api_key,
        seed=args.seed,
    )
    report = run_loadtest(cfg)
    text = json.dumps(report.to_dict(), indent=2)
    if args.json:
        Path(args.json).write_text(text + "\n")
    print(text)
    if not report.passed:
        raise RuntimeError("the load test failed: see the report above")
