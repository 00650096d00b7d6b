"""``longspark`` command line: one module per verb, each with ``add_parser`` and ``run``.

Every expected failure (bad flag, missing model, unsupported checkpoint, bad request
setting) ends in one line on stderr and exit status 2; set ``LONGSPARK_DEBUG=1`` for
tracebacks.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from services.cli import bench, data, evaluate, generate, loadtest, model, serve, soak, train
from services.cli.types import Parser
from services.engine.errors import user_error_message

VERBS = {
    "model": model,
    "generate": generate,
    "serve": serve,
    "loadtest": loadtest,
    "soak": soak,
    "data": data,
    "train": train,
    "eval": evaluate,
    "bench": bench,
}


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="longspark", description="Speculative-decoding LLM service.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    for verb in VERBS.values():
        verb.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=os.environ.get("LONGSPARK_LOG", "WARNING"),
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    try:
        VERBS[args.command].run(args)
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # noqa: BLE001 - the CLI's one boundary
        if os.environ.get("LONGSPARK_DEBUG"):
            raise
        print(f"longspark: error: {user_error_message(exc)}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
