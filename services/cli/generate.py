"""``longspark generate``: one request through the engine, printed or as one JSON object."""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from services.cli.common import add_engine_args, add_sampling_args, add_target_args, engine_options
from services.engine.core import Engine
from services.engine.params import SamplingParams


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]  # generated tokens only
    num_prompt_tokens: int
    num_generated_tokens: int
    finish_reason: str
    mode: str  # "ar" | "spec"
    elapsed_s: float
    tokens_per_s: float
    rounds: int = 0
    mean_accepted_length: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out.update(out.pop("extra"))
        return out


def generate_one(engine: Engine, prompt_ids: list[int], params: SamplingParams) -> GenerationResult:
    t0 = time.perf_counter()
    out = engine.generate([prompt_ids], params)[0]
    elapsed = time.perf_counter() - t0
    n = len(out.token_ids)
    return GenerationResult(
        text=out.text,
        token_ids=out.token_ids,
        num_prompt_tokens=out.num_prompt_tokens,
        num_generated_tokens=n,
        finish_reason=out.finish_reason,
        mode=engine.mode,
        elapsed_s=elapsed,
        tokens_per_s=n / elapsed if elapsed > 0 else 0.0,
        rounds=out.stats.rounds,
        mean_accepted_length=round(out.stats.mean_accepted_length, 3),
    )


def add_parser(sub) -> None:
    gen = sub.add_parser("generate", help="generate text for one prompt")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--chat", action="store_true", help="apply the tokenizer's chat template")
    gen.add_argument("--json", action="store_true", help="print one JSON object")
    add_target_args(gen)
    add_engine_args(gen)
    add_sampling_args(gen)


def run(args: argparse.Namespace) -> None:
    from services.engine.backends import build_engine

    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        stop=args.stop,
    )
    engine, close = build_engine(engine_options(args), backend=args.backend)
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
        return
    print(result.text)
    print(
        f"[{result.mode}, {result.num_generated_tokens} tokens, {result.tokens_per_s:.1f} tok/s, "
        f"tau {result.mean_accepted_length:.2f}, {result.finish_reason}"
        + (f", drafter {result.extra['drafter']}" if result.extra.get("drafter") else "")
        + "]",
        file=sys.stderr,
    )
