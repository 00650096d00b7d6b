"""``longspark loadtest``: a bounded, self-checking load test of a running server on loopback.

It sends ``requests`` requests at ``concurrency`` at once, mixing completions and chat,
streaming and not, greedy and sampled; a fraction of the clients disconnect at a random
point, and faults are injected as the run goes (``faults``, each once, spread over the
run): a SIGKILL of the drafter (decoding goes on plainly), of a target rank (the
replica's requests get 503 ``replica_unavailable`` and Serve replaces the replica), and
of the engine replica itself (Serve restarts it). It stops by itself: no new request
after ``time_limit_s``, and every request has its own time-out.

Every request must end in exactly one of: completed (a greedy one token-identical to
plain decoding, computed here with the same target), a deliberate disconnect, or a clear
error (OpenAI error JSON, or an ``error`` event in the stream). At the end the server's
``/debug/engine`` must show nothing running or waiting, no KV blocks and no drafter
states (after a replica fault, on the replica that replaced it). :func:`run` returns the counts; ``passed`` says whether all of that held.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

PROMPTS = [
    "The capital of France is",
    "Once upon a time",
    "The quick brown fox",
    "Water boils at",
    "My favorite color is",
    "Count to five:",
    "Hello world",
    "The best way to learn is",
]


@dataclass
class LoadTestConfig:
    url: str = "http://127.0.0.1:8000"
    requests: int = 300
    concurrency: int = 64
    time_limit_s: float = 600.0  # no new request after this
    request_timeout_s: float = 300.0
    max_tokens: int = 32
    disconnect_fraction: float = 0.15
    sampled_fraction: float = 0.3
    faults: tuple[str, ...] = (
        "drafter",
        "rank",
        "replica",
    )  # of FAULTS, each SIGKILLed once (a local server)
    target: str | None = None  # the served target, for the plain-decoding reference
    api_key: str | None = None
    seed: int = 0


# fault -> the /debug/engine field with its process id
FAULTS = {"drafter": "drafter_pid", "rank": "target_pids", "replica": "replica_pid"}


@dataclass
class Job:
    index: int
    chat: bool
    stream: bool
    greedy: bool
    prompt: str
    disconnect_after: int | None  # events (streams) or tenths of a second (not streamed)


@dataclass
class LoadTestReport:
    tried: int = 0
    outcomes: dict[str, int] = field(default_factory=dict)  # ok / disconnected / error:... / bad
    greedy_checked: int = 0
    greedy_mismatches: int = 0
    faults: dict[str, int] = field(default_factory=dict)  # fault -> pid killed (0: none found)
    leaked: dict[str, Any] = field(default_factory=dict)  # /debug/engine fields not idle
    object_store: dict[str, Any] = field(default_factory=dict)  # before / after the load
    elapsed_s: float = 0.0
    problems: list[str] = field(default_factory=list)  # the first few, for the report

    @property
    def passed(self) -> bool:
        bad = sum(v for k, v in self.outcomes.items() if k in ("bad", "hung"))
        return bad == 0 and self.greedy_mismatches == 0 and not self.leaked

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "passed": self.passed}


def plan(cfg: LoadTestConfig) -> list[Job]:
    rng = random.Random(cfg.seed)
    jobs = []
    for i in range(cfg.requests):
        stream = rng.random() < 0.5
        disconnect = None
        if rng.random() < cfg.disconnect_fraction:
            disconnect = rng.randint(0, 4) if stream else rng.randint(1, 10)
        jobs.append(
            Job(
                i,
                chat=rng.random() < 0.5,
                stream=stream,
                greedy=rng.random() >= cfg.sampled_fraction,
                prompt=rng.choice(PROMPTS),
                disconnect_after=disconnect,
            )
        )
    return jobs


def reference(cfg: LoadTestConfig) -> dict[tuple[bool, str], list[int]]:
    """Plain greedy decoding of every prompt (raw and as chat), in this process."""
    from services.engine.backends import EngineOptions, build_engine
    from services.engine.params import SamplingParams

    engine, close = build_engine(EngineOptions(target=cfg.target, mode="ar"))
    try:
        keys = [(chat, p) for chat in (False, True) for p in PROMPTS]
        prompts = [
            engine.tok.encode_chat([{"role": "user", "content": p}])
            if chat
            else engine.tok.encode(p)
            for chat, p in keys
        ]
        outs = engine.generate(prompts, SamplingParams(max_tokens=cfg.max_tokens))
        return {key: out.token_ids for key, out in zip(keys, outs, strict=True)}
    finally:
        close()


def _body(job: Job, model: str, cfg: LoadTestConfig) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "max_tokens": cfg.max_tokens, "stream": job.stream}
    body["return_token_ids"] = True
    body.update({"temperature": 0} if job.greedy else {"temperature": 0.8, "seed": job.index})
    if job.chat:
        body["messages"] = [{"role": "user", "content": job.prompt}]
    else:
        body["prompt"] = job.prompt
    return body


async def _one(c: httpx.AsyncClient, job: Job, model: str, cfg: LoadTestConfig) -> tuple[str, Any]:
    """(outcome, token ids or None) for one request."""
    path = "/v1/chat/completions" if job.chat else "/v1/completions"
    body = _body(job, model, cfg)
    if not job.stream:
        timeout = cfg.request_timeout_s
        if job.disconnect_after is not None:
            timeout = job.disconnect_after / 10
        try:
            r = await asyncio.wait_for(c.post(path, json=body), timeout)
        except TimeoutError:
            return ("disconnected" if job.disconnect_after is not None else "hung"), None
        if r.status_code != 200:
            return _error(r.status_code, r.text), None
        doc = r.json()
        return "ok", doc["longspark"]["token_ids"]
    async with c.stream("POST", path, json=body) as r:
        if r.status_code != 200:
            return _error(r.status_code, (await r.aread()).decode()), None
        events, last, line = 0, None, ""
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if job.disconnect_after is not None and events >= job.disconnect_after:
                return "disconnected", None  # leaving the block closes the connection
            events += 1
            if line == "data: [DONE]":
                break
            doc = json.loads(line[len("data: ") :])
            if "error" in doc:
                return _error(0, line[len("data: ") :]), None
            last = doc
        if last is None or line != "data: [DONE]":
            return "bad", None
        return "ok", (last.get("longspark") or {}).get("token_ids")


def _error(status: int, text: str) -> str:
    """``error:<status>:<code>`` for OpenAI error JSON, ``bad`` for anything else."""
    try:
        err = json.loads(text)["error"]
        assert err["message"] and "type" in err
    except Exception:  # noqa: BLE001 - not an OpenAI error: the server lied
        return "bad"
    return f"error:{status or 'stream'}:{err.get('code')}"


async def _inject(c: httpx.AsyncClient, fault: str, timeout_s: float = 120.0) -> int:
    """SIGKILL the fault's process (read from ``/debug/engine``, asked until a replica
    answers: one may be starting after an earlier fault); its pid, or 0 if it has none."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            r = await c.get("/debug/engine")
            if r.status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            return 0
        await asyncio.sleep(0.5)
    pid = r.json().get(FAULTS[fault])
    pid = pid[0] if isinstance(pid, list) else pid
    if not pid:
        return 0
    os.kill(pid, signal.SIGKILL)
    return pid


OBJECT_STORE_SLACK = 1 << 20  # bytes Serve's own bookkeeping may hold more at the end


async def _store(c: httpx.AsyncClient) -> dict[str, int] | None:
    r = await c.get("/debug/engine")
    return r.json().get("object_store") if r.status_code == 200 else None


async def _wait_idle(
    c: httpx.AsyncClient, store0: dict[str, int] | None, timeout_s: float = 120.0
) -> dict[str, Any]:
    """The engine fields that are not at their idle value, and object-store bytes over
    what the store held before the load (empty: nothing leaked)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            r = await c.get("/debug/engine")
            s = r.json() if r.status_code == 200 else None
        except httpx.HTTPError:
            s = None
        if s is None:  # a replica still starting after a fault
            if time.monotonic() > deadline:
                return {"debug_engine": "no replica answered"}
            await asyncio.sleep(0.5)
            continue
        leaked = {
            "num_running": s["num_running"],
            "num_waiting": s["num_waiting"],
            "kv_used_blocks": s["kv"]["used_blocks"],
            "kv_num_seqs": s["kv"]["num_seqs"],
            "drafter_states": s.get("drafter_states") or 0,
            "drafter_restarting": bool(s.get("drafter_restarting")),
        }
        store = s.get("object_store")
        if store0 and store and store["bytes_used"] > store0["bytes_used"] + OBJECT_STORE_SLACK:
            leaked["object_store_bytes"] = store["bytes_used"] - store0["bytes_used"]
        leaked = {k: v for k, v in leaked.items() if v}
        if not leaked or time.monotonic() > deadline:
            return leaked
        await asyncio.sleep(0.25)


async def run_async(cfg: LoadTestConfig, ref: dict[tuple[bool, str], list[int]]) -> LoadTestReport:
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    limits = httpx.Limits(max_connections=cfg.concurrency, max_keepalive_connections=0)
    report, outcomes = LoadTestReport(), Counter()
    t0 = time.monotonic()
    jobs = plan(cfg)
    async with httpx.AsyncClient(
        base_url=cfg.url, headers=headers, limits=limits, timeout=cfg.request_timeout_s
    ) as c:
        model = (await c.get("/v1/models")).json()["data"][0]["id"]
        store0 = await _store(c)
        gate, done = asyncio.Semaphore(cfg.concurrency), 0
        unknown = set(cfg.faults) - set(FAULTS)
        if unknown:
            raise ValueError(f"unknown faults {sorted(unknown)}; known: {sorted(FAULTS)}")
        # fault i of n once done passes (i + 1) / (n + 1) of the requests
        due = {f: len(jobs) * (i + 1) // (len(cfg.faults) + 1) for i, f in enumerate(cfg.faults)}

        async def worker(job: Job) -> None:
            nonlocal done
            async with gate:
                if time.monotonic() - t0 > cfg.time_limit_s:
                    return
                report.tried += 1
                try:
                    outcome, ids = await asyncio.wait_for(
                        _one(c, job, model, cfg), cfg.request_timeout_s + 5
                    )
                except TimeoutError:
                    outcome, ids = "hung", None
                except httpx.HTTPError as exc:
                    outcome, ids = "bad", None
                    report.problems.append(f"#{job.index}: {type(exc).__name__}: {exc}")
                outcomes[outcome] += 1
                if outcome == "ok" and job.greedy:
                    report.greedy_checked += 1
                    if ids != ref[(job.chat, job.prompt)]:
                        report.greedy_mismatches += 1
                        report.problems.append(f"#{job.index}: greedy output differs")
                done += 1
                for fault, at in due.items():
                    if fault not in report.faults and done >= at:
                        report.faults[fault] = 0  # once, even if it has no process
                        report.faults[fault] = await _inject(c, fault)

        await asyncio.gather(*(worker(job) for job in jobs))
        report.leaked = await _wait_idle(c, store0)
        report.object_store = {"before": store0, "after": await _store(c)}
    report.outcomes = dict(sorted(outcomes.items()))
    report.problems = report.problems[:10]
    report.elapsed_s = round(time.monotonic() - t0, 1)
    return report


def run(cfg: LoadTestConfig) -> LoadTestReport:
    """Compute the plain-decoding reference, then load the server; the report."""
    return asyncio.run(run_async(cfg, reference(cfg)))
