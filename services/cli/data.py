"""``longspark data fetch``: the prompt sets, fetched and normalised once."""

from __future__ import annotations

import argparse

from services.cli.types import Parser


def add_parser(sub) -> None:
    data = sub.add_parser("data", help="prompt sets (ShareGPT for training, benchmark categories)")
    data_sub = data.add_subparsers(dest="data_command", required=True, parser_class=Parser)
    data_fetch = data_sub.add_parser(
        "fetch", help="fetch and normalise every prompt set (idempotent)"
    )
    data_fetch.add_argument("--force", action="store_true")


def run(args: argparse.Namespace) -> None:
    from services.data.prompts import fetch_all

    for name, count in fetch_all(force=args.force).items():
        print(f"{name}\t{count}")
