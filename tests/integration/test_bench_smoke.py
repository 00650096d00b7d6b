"""Smoke runs of ``longspark bench throughput``, ``bench peers`` and ``bench drafter`` at a
tiny size.

Behaviour only, never timing: the throughput run starts the service itself (Ray Serve,
plain then speculative with a random drafter), streams over real HTTP, and must find the
replica's Prometheus counters in agreement with what the client saw (else it exits
nonzero). The peers run covers the transformers systems; vLLM must skip cleanly.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def run_cli(args: list[str], timeout_s: float) -> subprocess.CompletedProcess:
    """``longspark ARGS`` in a child process group (killed whole if it overruns)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.cli.main", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        env={**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"},
    )
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the child's own group: its Ray processes too
        out, err = proc.communicate()
        pytest.fail(f"timed out after {timeout_s}s: {err[-2000:]}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


@pytest.mark.ray
def test_bench_throughput_smoke(smollm2_path, tmp_path):
    report_path, png = tmp_path / "t.json", tmp_path / "t.png"
    done = run_cli(
        [
            "bench", "throughput",
            "--concurrency", "1,2",
            "--max-tokens", "8",
            "--num-prompts", "2",
            "--prompt-len", "256",
            "--long-prompts", "1",
            "--drafter", "random",
            "--k", "3",
            "--serve-arg", "cpus_per_actor=0.5",
            "--json", str(report_path),
            "--plot", str(png),
        ],
        timeout_s=400,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(report_path.read_text())
    assert report["ok"] and report["problems"] == []
    assert set(report["modes"]) == {"ar", "spec"}
    for mode, result in report["modes"].items():
        assert [s["stage"] for s in result["stages"]] == ["C=1", "C=2", "prompt_len=256"]
        for stage in result["stages"]:
            assert stage["failed"] == 0 and stage["modes_seen"] == [mode]
            assert stage["output_tokens"] == 8 * stage["requests"]  # EOS ignored
            assert stage["metrics_check"]["ok"], stage["metrics_check"]
            assert stage["output_tokens_per_s"] > 0 and stage["tpot_ms"]["p50"] > 0
    long_stage = report["modes"]["ar"]["stages"][-1]
    assert 240 <= long_stage["prompt_tokens_mean"] <= 272
    for row in report["comparison"]:  # a random drafter is still exact
        assert row["greedy_identical"] in ("2/2", "1/1"), row
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_bench_peers_smoke_transformers_only(smollm2_path, tmp_path):
    report_path = tmp_path / "p.json"
    done = run_cli(
        [
            "bench", "peers",
            "--systems", "transformers,transformers_prompt_lookup,vllm",
            "--concurrency", "1,2",
            "--max-tokens", "4",
            "--num-prompts", "2",
            "--vllm-venv", str(tmp_path / "no-venv"),
            "--dtype", "float32", "--quant", "none",  # the form transformers runs
            "--json", str(report_path),
        ],
        timeout_s=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "vllm skipped: no vLLM venv" in done.stderr
    results = json.loads(report_path.read_text())["results"]
    assert set(results) == {"longspark_plain", "transformers", "transformers_prompt_lookup", "vllm"}
    assert "docs/BENCHMARKS.md" in results["vllm"]["skipped"]
    assert set(results["transformers"]["levels"]) == {"1", "2"}
    assert set(results["transformers_prompt_lookup"]["levels"]) == {"1"}
    for level in results["transformers"]["levels"].values():
        assert level["output_tokens"] == 4 * 2 and level["tokens_per_s"] > 0
    # fp32 greedy: transformers one sequence at a time decodes exactly what we do
    assert results["transformers"]["levels"]["1"]["greedy_identical_to_ours"] == "2/2"


def test_bench_drafter_smoke(smollm2_path, tmp_path):
    """Both drafters (LongSpark and the full-prefix baseline) at two short contexts."""
    report_path, png = tmp_path / "d.json", tmp_path / "d.png"
    args = ["bench", "drafter", "--contexts", "384,768", "--k", "4", "--repeats", "1"]
    done = run_cli([*args, "--json", str(report_path), "--plot", str(png)], timeout_s=600)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(report_path.read_text())
    assert set(report["results"]) == {"longspark", "full_prefix"}
    for by_context in report["results"].values():
        assert set(by_context) == {"384", "768"}
    # LongSpark's state is fixed-size; the baseline's grows with the context
    assert report["summary"]["longspark_state_ratio"] == 1.0
    assert report["summary"]["full_prefix_state_ratio"] > 1.0
    assert png.stat().st_size > 0


def test_bench_spec_smoke(smollm2_path, tmp_path):
    """Plain, fixed-k and adaptive spec, two interleaved repeats, the shipped drafter."""
    report_path = tmp_path / "s.json"
    args = ["bench", "spec", "--max-tokens", "8", "--repeats", "2", "--json", str(report_path)]
    done = run_cli(args, timeout_s=600)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(report_path.read_text())
    assert report["outputs_identical"] and report["repeats"] == 2
    (run,) = report["runs"]
    assert run["concurrency"] == 1 and run["prompts"] == 6
    for mode in ("plain", "spec_fixed_k", "spec_adaptive"):
        assert len(run[mode]["tokens_per_s_repeats"]) == 2
        assert 0 < run[mode]["tokens"] == run["plain"]["tokens"] <= 6 * 8
        assert "token_ids" not in run[mode]
    assert run["spec_fixed_k"]["num_draft_tokens"] > 0  # it did speculate
    assert len(run["speedup_adaptive_repeats"]) == 2 and run["speedup_fixed_k"] > 0


def test_bench_peers_served_smoke(smollm2_path, tmp_path):
    """`bench peers --served`: our plain server started as a user starts it, driven over
    HTTP by the shared client; a peer without its venv is skipped with a pointer."""
    report_path, png = tmp_path / "s.json", tmp_path / "s.png"
    done = run_cli(
        [
            "bench", "peers", "--served",
            "--systems", "longspark_ar,vllm",
            "--concurrency", "1,2",
            "--max-tokens", "4",
            "--num-prompts", "2",
            "--vllm-venv", str(tmp_path / "no-venv"),
            "--json", str(report_path), "--plot", str(png),
        ],
        timeout_s=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(report_path.read_text())
    assert set(report["systems"]) == {"longspark_ar"} and "vllm" in report["skipped"]
    assert "docs/BENCHMARKS.md" in report["skipped"]["vllm"]
    stages = report["systems"]["longspark_ar"]["stages"]
    assert [s["stage"] for s in stages] == ["C=1", "C=2"]
    assert all(s["failed"] == 0 and s["output_tokens"] == 4 * 2 for s in stages)
    (ratio,) = report["served_over_in_process_tpot"]
    assert ratio["system"] == "longspark_ar" and ratio["requests"] == 2 and ratio["ratio"] > 0
    assert len(ratio["served_tpot_ms"]) == len(ratio["in_process_tpot_ms"]) == 1
    assert png.stat().st_size > 0
