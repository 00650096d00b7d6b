"""The load client's bookkeeping, the level summary, long prompts and the plot (no server)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from services.bench import long_prompts as lp
from services.bench.http_load import RequestRecord, run_level, send_one
from services.bench.plot import plot_throughput
from services.bench.summary import percentiles_ms, summarize_level


def chunk(text=None, usage=None, extras=None):
    event = {"choices": [] if text is None else [{"index": 0, "delta": {"content": text}}]}
    if usage:
        event["usage"] = usage
    if extras:
        event["longspark"] = extras
    return event


class FakeClient:
    """``stream_chat`` streaming like our server: role, text deltas, final, usage."""

    def __init__(self, fail_on: str | None = None) -> None:
        self.calls, self.fail_on, self.in_flight, self.most = [], fail_on, 0, 0

    async def stream_chat(self, body):
        self.calls.append(body)
        prompt = body["messages"][0]["content"]
        if prompt == self.fail_on:
            raise RuntimeError("boom")
        n = body["max_tokens"]
        extras = {"mode": "spec", "num_drafts": 2, "num_draft_tokens": 6, "num_accepted_tokens": 3}
        self.in_flight += 1
        self.most = max(self.most, self.in_flight)
        yield chunk("")
        for piece in ("a", "b"):
            await asyncio.sleep(0.01)
            yield chunk(piece)
        yield chunk("c", extras={**extras, "token_ids": list(range(n))})
        yield chunk(None, usage={"prompt_tokens": len(prompt), "completion_tokens": n})
        self.in_flight -= 1


def test_send_one_records_timing_tokens_and_extras():
    client = FakeClient()
    rec = asyncio.run(send_one(client, "m", [{"role": "user", "content": "hey"}], 4))
    assert rec.ok and rec.output_tokens == 4 and rec.prompt_tokens == 3
    assert rec.token_ids == [0, 1, 2, 3] and rec.mode == "spec" and rec.num_drafts == 2
    assert len(rec.chunk_times_s) == 3 and rec.ttft_s == rec.chunk_times_s[0]
    assert rec.tpot_s == pytest.approx((rec.e2e_s - rec.ttft_s) / 3)
    assert len(rec.itl_s) == 2
    sent = client.calls[0]
    assert sent["stream"] and sent["temperature"] == 0 and sent["model"] == "m"
    assert sent["ignore_eos"] and sent["return_token_ids"]


def test_run_level_keeps_concurrency_and_order_and_records_failures():
    client = FakeClient(fail_on="p2")
    prompts = [[{"role": "user", "content": f"p{i}"}] for i in range(6)]
    records, wall = asyncio.run(run_level(client, "m", prompts, 2, 5))
    assert [r.index for r in records] == list(range(6)) and client.most == 2
    assert not records[2].ok and "boom" in records[2].error
    summary = summarize_level(records, wall)
    assert summary["requests"] == 6 and summary["failed"] == 1
    assert summary["output_tokens"] == 25
    assert summary["tau"] == 2.5 and summary["acceptance_rate"] == 0.5
    assert summary["ttft_ms"]["p50"] > 0 and summary["itl_ms"] is not None


def test_percentiles():
    assert percentiles_ms([]) is None
    p = percentiles_ms([0.001 * i for i in range(1, 101)])
    assert p["p50"] == pytest.approx(50.5) and p["p99"] == pytest.approx(99.01)


def test_record_without_tokens_has_no_tpot():
    assert RequestRecord(0, ttft_s=0.1, e2e_s=0.2, output_tokens=1).tpot_s is None


class CharTokenizer:
    """One token per character; chat template = 10 tokens of wrapping."""

    def __init__(self) -> None:
        self.hf = self

    def __call__(self, text, add_special_tokens=False):
        return SimpleNamespace(input_ids=[ord(c) for c in text])

    def decode(self, ids):
        return "".join(map(chr, ids))

    def encode_chat(self, messages):
        return [0] * 10 + self(messages[0]["content"]).input_ids


def test_long_prompts_hit_the_length_from_real_items(monkeypatch):
    items = [SimpleNamespace(text=f"Article {i}. " + "words " * 40) for i in range(5)]
    monkeypatch.setattr(lp, "load_prompts", lambda name: items)
    tok = CharTokenizer()
    prompts = lp.long_prompts(tok, "xsum", 1000, 2)
    assert len(prompts) == 2 and prompts[0] != prompts[1]
    for msgs in prompts:
        assert len(tok.encode_chat(msgs)) == 1000
        assert msgs[0]["content"].endswith("Summarize the last article above in one sentence.")
    with pytest.raises(ValueError):
        lp.long_prompts(tok, "nope", 1000, 1)


def _level(stage, value, tps, tpot, tau=None):
    ms = {"mean": tpot, "p50": tpot, "p99": tpot}
    return dict(stage=stage, value=value, output_tokens_per_s=tps, tpot_ms=ms, ttft_ms=ms, tau=tau)


def test_plot_writes_a_png(tmp_path):
    report = {
        "model": "m",
        "modes": {
            "ar": {"stages": [_level("C=1", 1, 10, 50), _level("prompt_len=512", 512, 9, 55)]},
            "spec": {
                "stages": [_level("C=1", 1, 20, 25, 2.5), _level("prompt_len=512", 512, 18, 27)]
            },
        },
    }
    out = tmp_path / "plot.png"
    plot_throughput(report, out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
