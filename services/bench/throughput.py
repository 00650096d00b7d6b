"""``longspark bench throughput``: plain vs speculative serving over HTTP, per concurrency.

For each service (started here, one deployment per mode on one local Ray, or given by
URL) the benchmark sends the prompt mix over the OpenAI API at every concurrency level
(closed loop, streaming, greedy, EOS ignored), then long prompts at C=1 if asked. After
each stage it reads the replica's Prometheus counters back from Ray's metrics export and
checks them against what the client saw (:mod:`.metrics_check`). The report has output
tokens/s, TTFT / TPOT / ITL / e2e percentiles, tau, spec/plain ratios, and whether greedy
outputs were identical across modes. ``problems`` lists failed requests, disagreeing
metrics and a service in the wrong mode; the command exits nonzero when it is not empty.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from services.bench.bench_mix import mix_prompts, repeat_to
from services.bench.http_load import Messages, make_client, run_client, run_level, send_one
from services.bench.machine import machine_info
from services.bench.metrics_check import MetricsWatch, Observed, reachable
from services.bench.summary import summarize_level

WARMUP_TOKENS = 8


@dataclass
class ThroughputConfig:
    concurrency: list[int]
    max_tokens: int = 256
    num_prompts: int = 32
    seed: int = 0
    prompt_lens: list[int] = field(default_factory=list)
    long_source: str = "xsum"
    long_prompts: int = 2
    url: str | None = None  # a running service (its own mode), instead of starting one
    plain_url: str | None = None  # a running plain-mode service to compare with
    api_key: str | None = None
    metrics_urls: list[str] = field(default_factory=list)
    check_metrics: bool = True
    metrics_timeout_s: float = 60.0
    serve_args: dict[str, Any] = field(default_factory=dict)  # ServeArgs for a local service


@dataclass
class Service:
    mode: str  # "ar", "spec", or "as served" (a given URL: whatever it reports)
    url: str
    metrics_urls: list[str]
    api_key: str | None = None


@dataclass
class Stage:
    name: str  # "C=4" or "prompt_len=2048"
    prompts: list[Messages]
    concurrency: int
    value: int  # the concurrency or the prompt length


def _stages(cfg: ThroughputConfig, tok: Any, max_len: int) -> list[Stage]:
    from services.bench.long_prompts import long_prompts

    mix = [[{"role": "user", "content": p}] for p in mix_prompts(cfg.num_prompts, cfg.seed)]
    stages = [
        Stage(f"C={c}", repeat_to(mix, max(cfg.num_prompts, c)), c, c) for c in cfg.concurrency
    ]
    for n in cfg.prompt_lens:
        n = min(n, max_len - cfg.max_tokens - 1)  # leave room for the answer
        msgs = long_prompts(tok, cfg.long_source, n, cfg.long_prompts)
        stages.append(Stage(f"prompt_len={n}", msgs, 1, n))
    return stages


async def _bench_service(
    svc: Service, cfg: ThroughputConfig, stages: list[Stage], watch: MetricsWatch | None
) -> dict[str, Any]:
    client = make_client(svc.url, svc.api_key)
    model = await client.model()
    observed = Observed()

    def count(records: list) -> None:
        for r in records:
            if r.ok:
                observed.add(
                    r.prompt_tokens,
                    r.output_tokens,
                    r.num_drafts,
                    r.num_draft_tokens,
                    r.num_accepted_tokens,
                )

    warm = await send_one(client, model, stages[0].prompts[0], min(WARMUP_TOKENS, cfg.max_tokens))
    count([warm])
    out: dict[str, Any] = {"model": model, "mode": warm.mode, "stages": []}
    for stage in stages:
        records, wall = await run_level(
            client, model, stage.prompts, stage.concurrency, cfg.max_tokens
        )
        count(records)
        row = {"stage": stage.name, "concurrency": stage.concurrency, "value": stage.value}
        row.update(summarize_level(records, wall))
        row["modes_seen"] = sorted({r.mode for r in records if r.mode})
        if watch is not None:
            row["metrics_check"] = (await asyncio.to_thread(watch.settle, observed)).to_json()
        row["_token_ids"] = [r.token_ids for r in records]
        out["stages"].append(row)
    await client.close()
    return out


def _problems(mode: str, result: dict[str, Any]) -> list[str]:
    probs = []
    for row in result["stages"]:
        where = f"{mode} {row['stage']}"
        if row["failed"]:
            probs.append(f"{where}: {row['failed']} failed requests ({row['errors'][0]})")
        if row["modes_seen"] not in ([mode], []) and mode in ("ar", "spec"):
            probs.append(f"{where}: the service decoded in mode {row['modes_seen']}, not {mode}")
        check = row.get("metrics_check")
        if check and not check["ok"]:
            probs.append(f"{where}: metrics disagree: {'; '.join(check['problems'])}")
    return probs


def _compare(modes: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Spec vs plain per stage, where both ran."""
    if not {"ar", "spec"} <= modes.keys():
        return []
    rows = []
    for a, s in zip(modes["ar"]["stages"], modes["spec"]["stages"], strict=True):
        same = sum(
            x == y and x is not None for x, y in zip(a["_token_ids"], s["_token_ids"], strict=True)
        )
        ratio = None
        if a["output_tokens_per_s"] and s["output_tokens_per_s"]:
            ratio = round(s["output_tokens_per_s"] / a["output_tokens_per_s"], 3)
        tpot = {m: (r["tpot_ms"] or {}).get("p50") for m, r in (("ar", a), ("spec", s))}
        rows.append(
            {
                "stage": a["stage"],
                "plain_tokens_per_s": a["output_tokens_per_s"],
                "spec_tokens_per_s": s["output_tokens_per_s"],
                "spec_over_plain_tokens_per_s": ratio,
                "plain_tpot_p50_ms": tpot["ar"],
                "spec_tpot_p50_ms": tpot["spec"],
                "spec_over_plain_tpot": round(tpot["spec"] / tpot["ar"], 3)
                if tpot["ar"] and tpot["spec"]
                else None,
                "tau": s["tau"],
                "greedy_identical": f"{same}/{len(a['_token_ids'])}",
            }
        )
    return rows


@contextlib.contextmanager
def _services(cfg: ThroughputConfig) -> Iterator[Iterator[Service]]:
    """The services to bench, in order; a local one lives as long as this context."""
    from services.bench.prom import discover

    if cfg.url is not None:
        metrics = cfg.metrics_urls or reachable(discover())
        given = ([("ar", cfg.plain_url)] if cfg.plain_url else []) + [("as served", cfg.url)]
        yield (Service(mode, url, metrics, cfg.api_key) for mode, url in given)
        return
    from services.serving.config import ServeArgs
    from services.serving.local import LocalService

    args = {mode: _local_args(cfg, mode) for mode in ("ar", "spec")}
    cpus = sum(b.get("CPU", 0) for b in ServeArgs.model_validate(args["spec"]).bundles()) + 1
    with LocalService(cpus) as service:
        metrics = cfg.metrics_urls or [service.metrics_url]

        def each() -> Iterator[Service]:
            for mode in ("ar", "spec"):
                keys = args[mode].get("api_keys") or [args[mode].get("api_key")]
                yield Service(mode, service.deploy(args[mode]), metrics, cfg.api_key or keys[0])
                service.undeploy()

        yield each()


def _local_args(cfg: ThroughputConfig, mode: str) -> dict[str, Any]:
    from services.serving.config import ServeArgs

    args = {"max_num_seqs": max(32, *cfg.concurrency), **cfg.serve_args, "mode": mode}
    if mode == "ar":
        args["drafter"] = None
    resolved = ServeArgs.model_validate(args).resolved()
    if resolved.mode != mode:
        raise ValueError(
            f"no trained drafter ships for {resolved.model_name}: pass --drafter FOLDER, "
            "or --drafter random for an untrained (exact, slow) one"
        )
    return resolved.model_dump()


def run_throughput_bench(cfg: ThroughputConfig) -> dict[str, Any]:
    from services.engine.tokenizer import Tokenizer
    from target_actor.checkpoint import resolve_target
    from target_actor.config import ModelConfig

    target = resolve_target(cfg.serve_args.get("target"))
    stages = _stages(
        cfg, Tokenizer(target), ModelConfig.from_pretrained(target).max_position_embeddings
    )
    modes: dict[str, dict[str, Any]] = {}
    metrics_used: list[str] = []
    problems: list[str] = []
    with _services(cfg) as services:
        for svc in services:
            if cfg.check_metrics and not svc.metrics_urls:
                raise ValueError(
                    "no metrics endpoint found: pass --metrics-url (Ray's metrics export, "
                    "http://HOST:PORT/metrics) or --no-metrics-check"
                )
            watch = (
                MetricsWatch(svc.metrics_urls, cfg.metrics_timeout_s) if cfg.check_metrics else None
            )
            result = run_client(_bench_service(svc, cfg, stages, watch))
            mode = result["mode"] if svc.mode == "as served" else svc.mode
            if mode in modes:
                problems.append(f"two services decode in mode {mode}: nothing to compare")
                mode = f"{mode} ({svc.url})"
            problems += _problems(mode, result)
            modes[mode] = result
            metrics_used = svc.metrics_urls
    comparison = _compare(modes)
    for result in modes.values():
        for row in result["stages"]:
            row.pop("_token_ids")
    return {
        "benchmark": "throughput over HTTP (OpenAI streaming API), plain vs speculative",
        "ok": not problems,
        "problems": problems,
        "machine": machine_info(),
        "model": next(iter(modes.values()))["model"] if modes else None,
        "service": "given: " + ", ".join(u for u in (cfg.plain_url, cfg.url) if u)
        if cfg.url
        else {"started": "in-process Ray Serve", "serve_args": cfg.serve_args},
        "settings": {
            "concurrency": cfg.concurrency,
            "max_tokens": cfg.max_tokens,
            "num_prompts": cfg.num_prompts,
            "seed": cfg.seed,
            "prompt_lens": cfg.prompt_lens,
            "long_source": cfg.long_source if cfg.prompt_lens else None,
            "sampling": "greedy, ignore_eos (every answer is max_tokens long), streaming",
        },
        "metrics_source": {
            "kind": "Ray metrics export (Prometheus text), ray_longspark_* series",
            "urls": metrics_used,
            "checked": cfg.check_metrics,
        },
        "modes": modes,
        "comparison": comparison,
    }
