"""``bench peers --served --repeats N``: our two modes measured in interleaved pairs.

The HTTP client is replaced by a fake that answers from a script (the real client and
servers run in ``longspark bench peers --served``); what is checked here is the
bookkeeping: who runs when, which repeat a stage reports, and the paired ratios.
"""

from __future__ import annotations

import asyncio

from services.bench import served_peers
from services.bench.http_load import RequestRecord
from services.bench.served_peers import ServedPeersConfig


class _Client:
    def __init__(self, url: str) -> None:
        self.url = url

    async def model(self) -> str:
        return "m"

    async def close(self) -> None:
        pass


def test_pairs_take_turns_and_report_the_median_repeat_and_paired_ratios(monkeypatch):
    # tokens/s by (system, repeat) at every C: spec is faster in repeats 0 and 2 only
    speed = {"spec": [120.0, 60.0, 110.0], "plain": [100.0, 100.0, 100.0]}
    calls: list[tuple[str, int]] = []

    async def run_level(client, model, prompts, c, max_tokens, extra_body=None):
        system = "spec" if client.url.endswith("a") else "plain"
        rep = sum(1 for s, cc in calls if s == system and cc == c)
        calls.append((system, c))
        rec = RequestRecord(
            0, ok=True, ttft_s=0.1, e2e_s=1.0, output_tokens=int(speed[system][rep])
        )
        return [rec], 1.0

    async def send_one(*args, **kwargs):
        return RequestRecord(0, ok=True)

    monkeypatch.setattr(served_peers, "make_client", _Client)
    monkeypatch.setattr(served_peers, "run_level", run_level)
    monkeypatch.setattr(served_peers, "send_one", send_one)
    cfg = ServedPeersConfig(concurrency=[1, 8], num_prompts=2, repeats=3)
    urls = {"longspark": "http://a", "longspark_ar": "http://b"}
    out = asyncio.run(served_peers._drive(urls, cfg, {"ignore_eos": True}, cfg.repeats))

    # stage by stage in turns, the order flipping every repeat
    assert calls == [
        ("spec", 1), ("plain", 1), ("spec", 8), ("plain", 8),
        ("plain", 1), ("spec", 1), ("plain", 8), ("spec", 8),
        ("spec", 1), ("plain", 1), ("spec", 8), ("plain", 8),
    ]  # fmt: skip
    spec_c1 = out["longspark"][0]
    assert spec_c1["stage"] == "C=1" and spec_c1["repeats_tokens_per_s"] == [120.0, 60.0, 110.0]
    assert spec_c1["output_tokens_per_s"] == 110.0  # the median repeat, not the mean or the best
    assert out["paired_spec_over_plain"][0] == {
        "stage": "C=1", "ratios": [1.2, 0.6, 1.1], "median": 1.1,
    }  # fmt: skip


def test_the_stream_interval_reaches_our_servers_and_vllms():
    cfg = ServedPeersConfig(concurrency=[1], stream_interval=8)
    for system in ("longspark", "longspark_ar", "vllm"):
        cmd, _ = served_peers._command(system, cfg, 8123)
        assert cmd[cmd.index("--stream-interval") + 1] == "8", system


def test_where_our_target_computes_reaches_our_servers():
    cfg = ServedPeersConfig(concurrency=[1], target_process="replica")
    for system in ("longspark", "longspark_ar"):
        cmd, _ = served_peers._command(system, cfg, 8123)
        assert cmd[cmd.index("--target-process") + 1] == "replica", system


def test_long_prompts_run_one_at_a_time_after_the_mix_and_widen_the_peers_context(monkeypatch):
    seen: list[tuple[int, int]] = []  # (concurrency, prompts) of each stage run

    async def run_level(client, model, prompts, c, max_tokens, extra_body=None):
        seen.append((c, len(prompts)))
        return [RequestRecord(0, ok=True, ttft_s=0.5, e2e_s=1.0, output_tokens=10)], 1.0

    async def send_one(*args, **kwargs):
        return RequestRecord(0, ok=True)

    long = [[{"role": "user", "content": "x"}]] * 3
    monkeypatch.setattr(served_peers, "make_client", _Client)
    monkeypatch.setattr(served_peers, "run_level", run_level)
    monkeypatch.setattr(served_peers, "send_one", send_one)
    monkeypatch.setattr(served_peers, "_long_stages", lambda cfg: [(5000, long)])
    cfg = ServedPeersConfig(concurrency=[4], num_prompts=4, prompt_lens=[5000], long_prompts=3)
    out = asyncio.run(served_peers._drive({"vllm": "http://v"}, cfg, {}))
    assert seen == [(4, 4), (1, 3)]
    assert [(r["stage"], r["concurrency"], r["value"]) for r in out["vllm"]] == [
        ("C=4", 4, 4),
        ("prompt_len=5000", 1, 5000),
    ]
    for system in ("vllm", "llamacpp"):
        cmd, _ = served_peers._command(system, cfg, 8123)
        flag = "--max-model-len" if system == "vllm" else "--n_ctx"
        assert cmd[cmd.index(flag) + 1] == "8192", system
    assert ServedPeersConfig(concurrency=[1]).context == 4096
