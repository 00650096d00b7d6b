"""``longspark model fetch | path``: the default target model."""

from __future__ import annotations

import argparse

from services.cli.types import Parser


def add_parser(sub) -> None:
    model = sub.add_parser("model", help="the default target model")
    model_sub = model.add_subparsers(dest="model_command", required=True, parser_class=Parser)
    fetch = model_sub.add_parser(
        "fetch", help="fetch and convert SmolLM2-135M-Instruct (idempotent)"
    )
    fetch.add_argument("--force", action="store_true", help="convert again even if present")
    model_sub.add_parser("path", help="print the converted default model's folder")


def run(args: argparse.Namespace) -> None:
    from target_actor.checkpoint import fetch_default_model

    print(fetch_default_model(force=getattr(args, "force", False)))
