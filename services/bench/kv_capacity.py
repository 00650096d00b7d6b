"""How many sequences run at once when the KV pool, not ``max_num_seqs``, is the limit.

Queue more long-context requests than the pool holds (real text, chat-encoded, one
``max_tokens`` for all, greedy, EOS honoured), step the engine in this process for a
fixed time and count the running sequences each step, the preemptions, and the tokens
out. Run from the repository root: ``python -m services.bench.kv_capacity --context
1024,4096 --json bench/results/kv_capacity.json``. It uses only the engine's public
calls, so the same file measures an older checkout too (``PYTHONPATH=<checkout>``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any


def measure(
    context: int,
    requests: int,
    max_tokens: int,
    seconds: float,
    kv_tokens: int,
    max_num_seqs: int,
    mode: str,
    target: str | None,
) -> dict[str, Any]:
    from services.bench.long_prompts import long_prompts
    from services.engine.backends import EngineOptions, build_engine
    from services.engine.params import SamplingParams

    engine, close = build_engine(
        EngineOptions(
            target=target, mode=mode, kv_cache_tokens=kv_tokens, max_num_seqs=max_num_seqs
        )
    )
    try:
        chats = long_prompts(engine.tok, "xsum", context, requests)
        params = SamplingParams(max_tokens=max_tokens)
        for chat in chats:
            engine.add_request(engine.tok.encode_chat(chat), params)
        running, tokens0, t0 = [], None, time.perf_counter()
        while engine.has_unfinished() and time.perf_counter() - t0 < seconds:
            engine.step()
            running.append(len(engine.scheduler.running))
            if tokens0 is None and not engine.scheduler.waiting:
                tokens0 = (engine.stats.num_generated_tokens, time.perf_counter())
        wall = time.perf_counter() - t0
        steady = running[len(running) // 2 :] or running
        return {
            "context": context,
            "requests": requests,
            "max_tokens": max_tokens,
            "kv_cache_tokens": kv_tokens,
            "max_num_seqs": max_num_seqs,
            "mode": mode,
            "seconds": round(wall, 1),
            "steps": len(running),
            "peak_running": max(running, default=0),
            "mean_running_second_half": round(statistics.fmean(steady), 2) if steady else 0,
            "finished": engine.stats.finished,
            "generated_tokens": engine.stats.num_generated_tokens,
            "preemptions": getattr(engine.stats, "preemptions", 0),
            "tokens_per_s": round(engine.stats.num_generated_tokens / wall, 1),
        }
    finally:
        close()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m services.bench.kv_capacity", description=__doc__)
    p.add_argument("--context", default="1024,4096", help="comma-separated prompt lengths")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=1024)
    p.add_argument("--seconds", type=float, default=90.0, help="stepping time per context")
    p.add_argument("--kv-cache-tokens", type=int, default=65536)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--mode", choices=("spec", "ar"), default="spec")
    p.add_argument("--target", default=None)
    p.add_argument("--label", default="", help="stored with the results (e.g. a commit)")
    p.add_argument("--json", default=None, help="append the results to this JSON file")
    args = p.parse_args(argv)
    rows = []
    for context in (int(c) for c in args.context.split(",")):
        row = measure(
            context,
            args.requests,
            args.max_tokens,
            args.seconds,
            args.kv_cache_tokens,
            args.max_num_seqs,
            args.mode,
            args.target,
        )
        row["label"] = args.label
        print(json.dumps(row), flush=True)
        rows.append(row)
    if args.json:
        path = Path(args.json)
        old = json.loads(path.read_text())["runs"] if path.exists() else []
        path.write_text(json.dumps({"runs": old + rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
