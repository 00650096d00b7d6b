"""GPU settings without a GPU: the options, the placement bundles, the one-line errors the
CLI gives before any actor starts, and deploy/gpu-check.sh's dry run."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from services.cli.main import main
from services.engine.backends import DeviceError, EngineOptions, check_devices
from services.serving.config import ServeArgs

ROOT = Path(__file__).resolve().parents[2]
NO_GPU = (0, False)  # visible_gpus() on a machine without CUDA


@pytest.fixture
def no_ray():
    """No Ray running in this process (an earlier test may have left one): the CLI then
    counts the GPUs torch sees, as on a fresh start."""
    import ray

    if ray.is_initialized():
        ray.shutdown()


@pytest.fixture
def no_cuda(monkeypatch, no_ray):
    """This machine has no CUDA, whatever it really has."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)


@pytest.fixture
def one_gpu(monkeypatch, no_ray):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)


def test_device_reaches_the_target_and_the_drafter():
    opts = EngineOptions(target="/m", device="cuda", drafter_device="cuda:1")
    assert opts.target_spec().device == "cuda"
    assert opts.drafter_kwargs()["device"] == "cuda:1"  # in-process: the drafter's own GPU
    assert opts.drafter_kwargs(ray=True)["device"] == "cuda"  # an actor: the GPU Ray gave it
    plain = EngineOptions(target="/m")
    assert plain.target_spec().device == "cpu" and plain.drafter_kwargs()["device"] == "cpu"
    assert EngineOptions(device="cuda").drafter_kwargs()["device"] == "cuda"


def test_bad_device_settings_fail_validation():
    with pytest.raises(ValidationError, match="cpu, cuda or cuda:N"):
        EngineOptions(drafter_device="gpu1")
    with pytest.raises(ValidationError):
        EngineOptions(device="gpu")  # the old spelling is ServeArgs' alone (configs)
    with pytest.raises(ValidationError, match="NCCL"):
        EngineOptions(device="cuda", tp=2, gpus_per_rank=0.5)  # two ranks on one GPU
    with pytest.raises(ValidationError):
        EngineOptions(drafter_gpus=0)
    EngineOptions(device="cuda", tp=2, gpus_per_rank=0.75)


def test_serve_args_take_the_old_gpu_spelling_and_place_gpus_per_bundle():
    args = ServeArgs(device="gpu", tp=2, drafter="random")
    assert args.device == "cuda"
    assert args.bundles() == [
        {"CPU": 1.0},
        {"CPU": 1.0, "GPU": 1.0},
        {"CPU": 1.0, "GPU": 1.0},
        {"CPU": 1.0, "GPU": 1.0},
    ]
    shared = ServeArgs(device="cuda", gpus_per_rank=0.5, drafter_gpus=0.5, cpus_per_actor=2)
    assert shared.rank_resources() == shared.drafter_resources() == {"CPU": 2.0, "GPU": 0.5}
    # TP=1: the rank computes in the replica, whose bundle holds its GPU share; + drafter
    assert shared.bundles() == [{"CPU": 4.0, "GPU": 0.5}, {"CPU": 2.0, "GPU": 0.5}]
    plain = ServeArgs(device="cuda", mode="ar")
    assert plain.bundles() == [{"CPU": 2.0, "GPU": 1.0}]  # no drafter bundle
    actors = ServeArgs(device="cuda", mode="ar", target_process="actors")
    assert actors.bundles() == [{"CPU": 1.0}, {"CPU": 1.0, "GPU": 1.0}]
    assert all("GPU" not in b for b in ServeArgs(gpus_per_rank=0.5).bundles())  # cpu
    with pytest.raises(ValidationError, match="drafter_device"):
        ServeArgs(device="cuda", drafter_device="cuda:1")  # replicas run a Ray drafter


def test_device_checks_name_what_is_missing():
    cuda = EngineOptions(device="cuda")
    check_devices(EngineOptions(), use_ray=True, gpus=NO_GPU)  # cpu needs nothing
    with pytest.raises(DeviceError) as err:
        check_devices(cuda, use_ray=False, gpus=NO_GPU)
    assert str(err.value) == (
        "--device cuda: no CUDA device is visible (torch.cuda.is_available() is False)"
    )
    with pytest.raises(DeviceError, match="the running Ray has no GPU"):
        check_devices(cuda, use_ray=True, gpus=(0.0, True))
    with pytest.raises(
        DeviceError, match=r"^--tp 4 needs 4 GPUs \(one per rank, NCCL\): 2 visible"
    ):
        check_devices(EngineOptions(device="cuda", tp=4), use_ray=True, gpus=(2, False))
    with pytest.raises(DeviceError, match="on one node of the running Ray"):
        check_devices(EngineOptions(device="cuda", tp=4), use_ray=True, gpus=(2.0, True))
    # the ranks fit, the drafter's GPU does not; half a GPU each does
    with pytest.raises(DeviceError, match="= 2 GPUs per engine: 1 visible"):
        check_devices(cuda, use_ray=True, gpus=(1, False))
    check_devices(cuda.model_copy(update={"mode": "ar"}), use_ray=True, gpus=(1, False))
    half = EngineOptions(device="cuda", gpus_per_rank=0.5, drafter_gpus=0.5)
    check_devices(half, use_ray=True, gpus=(1, False))
    check_devices(EngineOptions(device="cuda", tp=2), use_ray=True, gpus=(3, False))
    check_devices(cuda, use_ray=False, gpus=(1, False))  # in-process: target and drafter


def test_drafter_device_checks():
    other = EngineOptions(device="cuda", drafter_device="cuda:1")
    check_devices(other, use_ray=False, gpus=(2, False))
    with pytest.raises(DeviceError, match=r"^--drafter-device cuda:1: 1 GPU\(s\) visible"):
        check_devices(other, use_ray=False, gpus=(1, False))
    with pytest.raises(DeviceError, match="in-process engines only"):
        check_devices(other, use_ray=True, gpus=(2, False))
    with pytest.raises(DeviceError, match="^--drafter-device cuda: no CUDA device"):
        check_devices(EngineOptions(drafter_device="cuda"), use_ray=False, gpus=NO_GPU)


def run_cli(argv: list[str], capsys) -> tuple[int, list[str]]:
    code = main(argv)
    return code, capsys.readouterr().err.strip().splitlines()


@pytest.mark.parametrize("verb", ["serve", "generate", "bench"])
def test_cli_device_cuda_without_cuda_is_one_line_before_ray(
    verb, no_cuda, tiny_checkpoints, capsys
):
    import ray

    tiny = str(tiny_checkpoints["qwen3"])
    argv = {
        "serve": ["serve", "--target", tiny, "--drafter", "random", "--device", "cuda"],
        "generate": ["generate", "--prompt", "hi", "--target", tiny, "--device", "cuda"],
        "bench": ["bench", "throughput", "--target", tiny, "--drafter", "random"],
    }[verb] + (["--device", "cuda"] if verb == "bench" else [])
    code, err = run_cli(argv, capsys)
    assert code == 2 and err == [
        "longspark: error: --device cuda: no CUDA device is visible"
        " (torch.cuda.is_available() is False)"
    ]
    assert not ray.is_initialized()


def test_cli_tp_over_the_gpus_is_one_line_before_ray(one_gpu, tiny_checkpoints, capsys):
    import ray

    tiny = str(tiny_checkpoints["qwen3"])
    argv = ["serve", "--target", tiny, "--device", "cuda", "--tp", "2", "--mode", "ar"]
    code, err = run_cli(argv, capsys)
    assert code == 2 and err == [
        "longspark: error: --tp 2 needs 2 GPUs (one per rank, NCCL): 1 visible"
    ]
    code, err = run_cli(
        ["serve", "--target", tiny, "--device", "cuda", "--drafter", "random"], capsys
    )
    assert code == 2 and len(err) == 1 and "drafter_gpus 1 = 2 GPUs per engine" in err[0]
    assert not ray.is_initialized()


def test_cli_gpu_options_parse_and_reach_the_serve_args():
    from services.cli.main import build_parser
    from services.serving.launch import settings_from

    args = build_parser().parse_args(
        ["serve", "--device", "cuda", "--gpus-per-rank", "0.5", "--drafter-gpus", "0.5"]
    )
    app, _, _ = settings_from(args)
    assert (app["device"], app["gpus_per_rank"], app["drafter_gpus"]) == ("cuda", 0.5, 0.5)
    gen = build_parser().parse_args(["generate", "--prompt", "x", "--drafter-device", "cuda:1"])
    assert gen.drafter_device == "cuda:1" and gen.device == "cpu"


@pytest.mark.parametrize(
    "argv",
    [
        ["serve", "--gpus-per-rank", "1.5"],
        ["serve", "--drafter-gpus", "0"],
        ["serve", "--device", "gpu"],
        ["generate", "--prompt", "x", "--drafter-device", "cuda1"],
    ],
)
def test_cli_bad_gpu_options_are_one_line(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert exc.value.code == 2 and len(err) == 1 and err[0].startswith("longspark: error: ")


def gpu_check(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(ROOT / "deploy" / "gpu-check.sh"), *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )


def test_gpu_check_dry_run_validates_the_configs_and_prints_the_plan(tmp_path):
    out = tmp_path / "report"
    run = gpu_check("--dry-run", "--out", str(out))
    assert run.returncode == 0, run.stderr
    assert "gpu-check plan" in run.stdout and f"out:       {out}" in run.stdout
    assert "pytest -q -m gpu tests/gpu" in run.stdout
    assert "bench throughput --device cuda --concurrency 1,8,32" in run.stdout
    assert "deploy/gpu-node.yaml: device cuda, tp 4, mode spec, 5 GPU(s)" in run.stdout
    assert "deploy/gpu-single.yaml: device cuda, tp 1, mode spec, 1 GPU(s)" in run.stdout
    assert not out.exists()  # nothing written


@pytest.mark.parametrize("args", [["--bogus"], ["--out"], ["--dry-run", "extra"]])
def test_gpu_check_bad_arguments_exit_2_in_one_line(args):
    run = gpu_check(*args)
    assert run.returncode == 2 and run.stdout == ""
    assert len(run.stderr.splitlines()) == 1 and run.stderr.startswith("gpu-check: error: ")
