"""``longspark eval acceptance | offline``: a drafter's acceptance length (tau)."""

from __future__ import annotations

import argparse
import json

from services.cli.types import Parser
from services.cli.types import positive_int as _positive_int


def add_parser(sub) -> None:
    ev = sub.add_parser("eval", help="evaluate a drafter")
    ev_sub = ev.add_subparsers(dest="eval_command", required=True, parser_class=Parser)
    acc = ev_sub.add_parser("acceptance", help="tau per benchmark category, through the engine")
    acc.add_argument("--drafter", default=None, help="drafter folder (default: shipped)")
    acc.add_argument("--k", type=_positive_int, default=None)
    acc.add_argument("--no-carry", action="store_true")
    acc.add_argument("--no-copy", action="store_true", help="the network's drafts only")
    acc.add_argument(
        "--per-category",
        type=_positive_int,
        default=24,
        help="held-out prompts per category (each tau comes with its standard error)",
    )
    acc.add_argument("--max-tokens", type=_positive_int, default=128)
    acc.add_argument("--temperatures", default="0,1", help="comma-separated, e.g. 0,1")
    acc.add_argument("--json", action="store_true", help="print JSON only")
    acc.add_argument("--target", default=None)

    off = ev_sub.add_parser(
        "offline", help="greedy tau on recorded target answers (training data), no engine"
    )
    off.add_argument("--drafter", default=None, help="drafter folder (default: shipped)")
    off.add_argument("--data", required=True, help="data folder(s), comma-separated")
    off.add_argument("--num-seqs", type=_positive_int, default=32, help="held-out records")
    off.add_argument("--k", type=_positive_int, default=None)
    off.add_argument("--cache-dir", default=None, help="tap cache (default: the run's)")
    off.add_argument("--target", default=None)


def run(args: argparse.Namespace) -> None:
    if args.eval_command == "offline":
        return _offline(args)
    from services.bench.eval_acceptance import eval_acceptance

    temps = tuple(float(t) for t in args.temperatures.split(",") if t.strip())
    report = eval_acceptance(
        args.drafter,
        args.k,
        not args.no_carry,
        args.per_category,
        args.max_tokens,
        temps,
        target=args.target,
        context_copy=not args.no_copy,
    )
    print(json.dumps(report, indent=None if args.json else 2))


def _offline(args: argparse.Namespace) -> None:
    from drafter_actor.training import evaluate_tau
    from services.engine.backends import shipped_drafter
    from target_actor.checkpoint import resolve_target

    drafter = args.drafter or shipped_drafter(resolve_target(args.target))
    if drafter is None:
        raise ValueError("no drafter is shipped for this target: pass --drafter")
    report = evaluate_tau(drafter, args.data, args.num_seqs, args.k, args.target, args.cache_dir)
    print(json.dumps(report))
