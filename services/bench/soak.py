"""``longspark soak``: steady mixed load on a local server, watching for slow leaks.

``concurrency`` clients send requests back to back for ``duration_s`` (completions and
chat, streamed and not, greedy and seeded sampling; no faults, no disconnects). Every
``sample_s`` it records the resident memory of each of the service's processes (Ray's
actors and daemons on this machine), the bytes in Ray's object store, and the window's
requests: how many finished, failed, and their TPOT and latency percentiles.

After ``warmup_s`` the memory should stay flat: :attr:`SoakReport.passed` needs zero
failed requests, every process's RSS at the end within ``max_growth`` of its value at the
end of warm-up, and the object store back within a small slack of where it started once
the load has stopped (it is read until it settles, for up to ``settle_s``: the last
requests' objects are freed a moment after their answers arrive).
Processes that start or end during the run (Ray's pooled workers) are not judged.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from services.bench.loadtest import OBJECT_STORE_SLACK, PROMPTS

DAEMONS = ("raylet", "gcs_server")  # Ray's own processes, besides its ray:: workers


@dataclass
class SoakConfig:
    url: str = "http://127.0.0.1:8000"
    duration_s: float = 1800.0
    warmup_s: float = 120.0
    sample_s: float = 10.0
    concurrency: int = 8
    max_tokens: int = 64
    sampled_fraction: float = 0.3
    max_growth: float = 0.05  # RSS after warm-up may grow this fraction at most
    request_timeout_s: float = 300.0
    settle_s: float = 30.0  # after the load: how long the object store may take to drain
    api_key: str | None = None
    seed: int = 0


@dataclass
class SoakReport:
    requests: int = 0
    failed: int = 0
    samples: list[dict[str, Any]] = field(default_factory=list)  # one per window
    rss_growth: dict[str, float] = field(default_factory=dict)  # process -> after warm-up
    object_store_growth: int = 0  # bytes, end vs start
    max_growth: float = 0.05
    problems: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        grown = any(g > self.max_growth for g in self.rss_growth.values())
        store = self.object_store_growth > OBJECT_STORE_SLACK
        return self.requests > 0 and self.failed == 0 and not grown and not store

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "passed": self.passed}


def service_processes() -> dict[str, int]:
    """``name[pid]`` -> RSS bytes of every Ray actor, worker and daemon on this machine."""
    out: dict[str, int] = {}
    page = os.sysconf("SC_PAGE_SIZE")
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            cmd = Path(entry.path, "cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
            rss = int(Path(entry.path, "statm").read_text().split()[1]) * page
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile
        name = cmd.split()[0] if cmd.startswith("ray::") else os.path.basename(cmd)
        if name.startswith("ray::") or name in DAEMONS:
            out[f"{name.split('.')[0]}[{entry.name}]"] = rss
    return out


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return round(values[min(len(values) - 1, int(q * len(values)))], 2)


async def _request(c: httpx.AsyncClient, rng: random.Random, model: str, cfg: SoakConfig):
    """(latency s, TPOT ms or None); raises on anything but a full answer."""
    chat, stream = rng.random() < 0.5, rng.random() < 0.5
    body: dict[str, Any] = {"model": model, "max_tokens": cfg.max_tokens, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    if rng.random() < cfg.sampled_fraction:
        body.update(temperature=0.8, seed=rng.randrange(1 << 30))
    else:
        body["temperature"] = 0
    prompt = rng.choice(PROMPTS)
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    path = "/v1/chat/completions" if chat else "/v1/completions"
    t0 = time.monotonic()
    if not stream:
        r = await c.post(path, json=body)
        if r.status_code != 200:
            raise RuntimeError(f"{r.status_code}: {r.text[:200]}")
        return time.monotonic() - t0, None
    first = last = None
    tokens, done = 0, False
    async with c.stream("POST", path, json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{r.status_code}: {(await r.aread())[:200]!r}")
        async for line in r.aiter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                doc = json.loads(line[len("data: ") :])
                if "error" in doc:
                    raise RuntimeError(line[:200])
                if doc.get("usage"):
                    tokens = doc["usage"]["completion_tokens"]
                elif any(_text(ch) for ch in doc.get("choices", [])):
                    last = time.monotonic()
                    first = first or last
    if not done:
        raise RuntimeError("the stream ended without [DONE]")
    tpot = (last - first) / (tokens - 1) * 1e3 if first and last and tokens > 1 else None
    return time.monotonic() - t0, tpot


def _text(choice: dict[str, Any]) -> str:
    return choice.get("text") or (choice.get("delta") or {}).get("content") or ""


async def _object_store(c: httpx.AsyncClient) -> int | None:
    r = await c.get("/debug/engine")
    store = r.json().get("object_store") if r.status_code == 200 else None
    return store["bytes_used"] if store else None


async def _settled_store(c: httpx.AsyncClient, start: int | None, settle_s: float) -> int | None:
    """The object store's bytes once back within the slack of ``start``, or its last value
    after ``settle_s``."""
    deadline = time.monotonic() + settle_s
    while True:
        store = await _object_store(c)
        if start is None or store is None or store <= start + OBJECT_STORE_SLACK:
            return store
        if time.monotonic() >= deadline:
            return store
        await asyncio.sleep(0.5)


async def run_async(cfg: SoakConfig) -> SoakReport:
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    report = SoakReport(max_growth=cfg.max_growth)
    window: dict[str, list] = {"latency": [], "tpot": [], "failed": []}
    async with httpx.AsyncClient(
        base_url=cfg.url, headers=headers, timeout=cfg.request_timeout_s
    ) as c:
        model = (await c.get("/v1/models")).json()["data"][0]["id"]
        store0 = await _object_store(c)
        t0 = time.monotonic()
        end = t0 + cfg.duration_s

        async def client(i: int) -> None:
            rng = random.Random(cfg.seed * 1000 + i)
            while time.monotonic() < end:
                try:
                    latency, tpot = await _request(c, rng, model, cfg)
                except Exception as exc:  # noqa: BLE001 - counted, the soak goes on
                    window["failed"].append(f"{type(exc).__name__}: {exc}")
                    continue
                window["latency"].append(latency)
                if tpot is not None:
                    window["tpot"].append(tpot)

        async def sample() -> None:
            done = {k: v[:] for k, v in window.items()}
            for v in window.values():
                v.clear()
            report.requests += len(done["latency"]) + len(done["failed"])
            report.failed += len(done["failed"])
            report.problems.extend(done["failed"][: 10 - len(report.problems)])
            report.samples.append(
                {
                    "t_s": round(time.monotonic() - t0, 1),
                    "completed": len(done["latency"]),
                    "failed": len(done["failed"]),
                    "tpot_ms_p50": _pct(done["tpot"], 0.5),
                    "tpot_ms_p99": _pct(done["tpot"], 0.99),
                    "latency_s_p50": _pct(done["latency"], 0.5),
                    "rss": service_processes(),
                    "object_store_bytes": await _object_store(c),
                }
            )

        async def sampler() -> None:
            while True:
                await asyncio.sleep(cfg.sample_s)
                await sample()

        sampling = asyncio.create_task(sampler())
        await asyncio.gather(*(client(i) for i in range(cfg.concurrency)))
        sampling.cancel()
        await sample()  # the last, partial window
        storeN = await _settled_store(c, store0, cfg.settle_s)
    report.object_store_growth = (storeN or 0) - (store0 or 0) if store0 is not None else 0
    report.rss_growth = rss_growth(report.samples, cfg.warmup_s)
    return report


def rss_growth(samples: list[dict[str, Any]], warmup_s: float) -> dict[str, float]:
    """Per process alive from the end of warm-up to the last sample: its RSS growth."""
    after = [s for s in samples if s["t_s"] >= warmup_s]
    if len(after) < 2:
        return {}
    first, last = after[0]["rss"], after[-1]["rss"]
    return {p: round(last[p] / first[p] - 1.0, 4) for p in first if p in last and first[p]}


def plot(report: SoakReport, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [s["t_s"] for s in report.samples]
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(9, 7), sharex=True)
    names = sorted({p for s in report.samples for p in s["rss"]})
    for p in names:
        ys = [s["rss"].get(p, float("nan")) / 2**20 for s in report.samples]
        if max((y for y in ys if y == y), default=0) > 100:  # the big ones
            ax1.plot(t, ys, label=p)
    ax1.set_ylabel("RSS (MiB)")
    ax1.legend(fontsize=7)
    ax1.set_title("soak: service processes' memory (those over 100 MiB) and TPOT")
    ax2.plot(t, [s["tpot_ms_p50"] for s in report.samples], label="TPOT p50")
    ax2.plot(t, [s["tpot_ms_p99"] for s in report.samples], label="TPOT p99")
    ax2.set_ylabel("ms")
    ax2.set_xlabel("s")
    ax2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def run(cfg: SoakConfig) -> SoakReport:
    return asyncio.run(run_async(cfg))


def write(report: SoakReport, json_path: str | None, png_path: str | None) -> str:
    text = json.dumps(report.to_dict(), indent=1)
    if json_path:
        Path(json_path).write_text(text + "\n")
    if png_path:
        plot(report, png_path)
    return text
