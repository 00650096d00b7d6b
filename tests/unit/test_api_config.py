"""Serve settings, deploy configs, the CLI's defaults, error mapping and proposal scatter."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from api.errors import to_api_error
from services.engine.async_engine import EngineDeadError
from services.engine.params import InvalidRequest
from services.serving.config import API_KEY_ENV, ServeArgs
from services.serving.launch import DEFAULT_CONFIG, settings_from
from target_actor.messages import Proposal, scatter_proposal

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


def app_args(doc: dict) -> ServeArgs:
    from ray.serve.schema import ServeDeploySchema

    schema = ServeDeploySchema.model_validate(doc)
    (app,) = schema.applications
    assert app.import_path == "services.serving.app:build_app"
    return ServeArgs.model_validate(app.args)


def serve_configs() -> dict[str, dict]:
    """Every Serve config under deploy/: the files with applications, and the serveConfigV2
    a KubeRay manifest embeds."""
    found = {}
    for path in sorted(DEPLOY.rglob("*.yaml")):
        for i, doc in enumerate(yaml.safe_load_all(path.read_text())):
            if isinstance(doc, dict) and doc.get("kind") == "RayService":
                doc = yaml.safe_load(doc["spec"]["serveConfigV2"])
            if isinstance(doc, dict) and "applications" in doc:
                found[f"{path.name}#{i}" if i else path.name] = doc
    return found


def test_every_deploy_yaml_with_serve_args_is_checked():
    assert {"local-cpu.yaml", "gpu-node.yaml", "gpu-single.yaml", "cluster.yaml"} <= set(
        serve_configs()
    )
    assert "kuberay-rayservice.yaml" in serve_configs()


@pytest.mark.parametrize("name", sorted(serve_configs()))
def test_serve_configs_validate(name):
    from services.serving.app import engine_deployment_options

    args = app_args(serve_configs()[name])
    options = engine_deployment_options(args)  # what build_app hands Serve, Ray not started
    bundles = options["placement_group_bundles"]
    assert options["placement_group_strategy"] == "STRICT_PACK"
    actors = 0 if args.rank_in_replica else args.tp  # a rank in the replica: bundle 0 holds it
    assert len(bundles) == 1 + actors + (args.mode == "spec")
    replica = options["ray_actor_options"]
    assert bundles[0] == {
        "CPU": replica["num_cpus"],
        **({"GPU": replica["num_gpus"]} if "num_gpus" in replica else {}),
    }
    if args.device == "cuda":
        ranks = [bundles[0]] if args.rank_in_replica else bundles[1 : 1 + actors]
        drafter = bundles[1 + actors :]
        assert all(b["GPU"] == args.gpus_per_rank for b in ranks)
        assert all(b["GPU"] == args.drafter_gpus for b in drafter)
        assert args.tp == 1 or args.gpus_per_rank > 0.5  # no two NCCL ranks on one GPU
    else:
        assert all("GPU" not in b for b in bundles)


def test_single_gpu_config_fits_one_gpu():
    args = app_args(serve_configs()["gpu-single.yaml"])
    assert args.device == "cuda" and args.tp == 1 and args.mode == "spec"
    assert sum(b.get("GPU", 0) for b in args.bundles()) == 1


def test_local_cpu_config_fits_a_two_cpu_ray_and_listens_on_localhost():
    doc = yaml.safe_load((DEPLOY / "local-cpu.yaml").read_text())
    args = app_args(doc)
    assert sum(b["CPU"] for b in args.bundles()) <= 2
    assert doc["http_options"] == {"host": "127.0.0.1", "port": 8000}


def test_kuberay_service_embeds_a_valid_serve_config():
    doc = yaml.safe_load((DEPLOY / "kuberay-rayservice.yaml").read_text())
    assert doc["kind"] == "RayService"
    args = app_args(yaml.safe_load(doc["spec"]["serveConfigV2"]))
    assert args.device == "cuda" and args.max_replicas > args.min_replicas
    cluster = doc["spec"]["rayClusterConfig"]
    (worker,) = cluster["workerGroupSpecs"]
    gpus = worker["template"]["spec"]["containers"][0]["resources"]
    per_replica = sum(b.get("GPU", 0) for b in args.bundles())
    assert int(gpus["limits"]["nvidia.com/gpu"]) >= per_replica  # one replica fits a worker
    assert gpus["requests"]["nvidia.com/gpu"] == gpus["limits"]["nvidia.com/gpu"]
    head = cluster["headGroupSpec"]["template"]["spec"]["containers"][0]["resources"]
    assert "nvidia.com/gpu" not in head["limits"]  # replicas land on the GPU workers


def test_cli_defaults_come_from_local_cpu_yaml_and_options_override():
    from services.cli.main import build_parser

    args = build_parser().parse_args(["serve"])
    app, host, port = settings_from(args)
    assert (host, port) == ("127.0.0.1", 8000) and app["cpus_per_actor"] == 0.5
    assert DEFAULT_CONFIG == DEPLOY / "local-cpu.yaml"
    args = build_parser().parse_args(
        ["serve", "--port", "9001", "--tp", "3", "--drafter", "random", "--max-replicas", "2"]
        + ["--stream-interval", "4"]
    )
    app, host, port = settings_from(args)
    assert port == 9001 and app["tp"] == 3 and app["drafter"] == "random"
    assert app["max_replicas"] == 2 and app["mode"] == "spec" and app["stream_interval"] == 4
    assert ServeArgs.model_validate(app).stream_interval == 4
    assert not ServeArgs.model_validate(app).rank_in_replica  # tp 3: a Ray actor per rank
    assert ServeArgs.model_validate({**app, "tp": 1}).rank_in_replica  # auto at tp 1
    args = build_parser().parse_args(["serve", "--target-process", "actors"])
    app, _, _ = settings_from(args)
    assert app["target_process"] == "actors" and not ServeArgs.model_validate(app).rank_in_replica
    with pytest.raises(ValueError, match="target_process replica holds one rank"):
        ServeArgs(tp=2, target_process="replica")


def test_direct_ingress_with_one_replica_holding_the_api_only():
    from services.cli.main import build_parser
    from services.serving.launch import direct_ingress

    def direct(*options: str) -> bool:
        args = build_parser().parse_args(["serve", *options])
        return direct_ingress(ServeArgs.model_validate(settings_from(args)[0]), args)

    assert direct()  # the defaults: one replica, the API inside it
    assert not direct("--max-replicas", "2")  # the proxy balances over replicas
    assert not direct("--ingress", "separate")
    assert not direct("--no-direct-ingress")


def test_serve_args_resolution(tiny_checkpoints, monkeypatch):
    path = str(tiny_checkpoints["qwen3"])
    monkeypatch.setenv(API_KEY_ENV, "from-env")
    plain = ServeArgs(target=path).resolved()  # no drafter ships for it: plain decoding
    assert plain.mode == "ar" and plain.drafter is None and plain.model_name == "qwen3"
    assert plain.api_key == "from-env" and plain.bundles() == [{"CPU": 2.0}]  # rank in replica
    actors = ServeArgs(target=path, target_process="actors").resolved()
    assert actors.bundles() == [{"CPU": 1.0}, {"CPU": 1.0}] and not actors.rank_in_replica
    spec = ServeArgs(target=path, drafter="random", tp=2, api_key="given").resolved()
    assert spec.mode == "spec" and spec.api_key == "given" and len(spec.bundles()) == 4
    with pytest.raises(ValueError, match="max_replicas"):
        ServeArgs(min_replicas=3, max_replicas=2)
    with pytest.raises(ValueError):
        ServeArgs(bogus=1)


def test_error_mapping_for_wrapped_and_serve_errors():
    from ray.exceptions import RayTaskError
    from ray.serve.exceptions import BackPressureError

    import services.serving.errors  # noqa: F401 - Serve's exceptions are mapped there

    wrapped = RayTaskError("generate", "tb", InvalidRequest("top_p must lie in (0, 1]", "top_p"))
    err = to_api_error(wrapped.as_instanceof_cause())
    assert (err.status, err.param) == (400, "top_p")
    assert (
        to_api_error(BackPressureError(num_queued_requests=9, max_queued_requests=8)).status == 429
    )
    assert to_api_error(EngineDeadError("rank died")).status == 503
    assert to_api_error(KeyError("x")).status == 500


def test_scatter_proposal_puts_rows_in_place_and_pads_the_rest():
    part = Proposal(
        tokens=torch.tensor([[5, 6], [7, 8]]),
        q_ids=torch.tensor([[[5, 1], [6, 1]], [[7, 1], [8, 1]]]),
        q_probs=torch.tensor([[[0.9, 0.1], [1.0, 0.0]], [[0.5, 0.5], [1.0, 0.0]]]),
    )
    full = scatter_proposal(part, [0, 2], 3)
    assert full.tokens.tolist() == [[5, 6], [-1, -1], [7, 8]]
    assert torch.equal(full.q_probs[2], part.q_probs[1]) and torch.equal(
        full.q_ids[0], part.q_ids[0]
    )
    assert torch.allclose(full.q_probs.sum(-1), torch.ones(3, 2))


def test_quiet_ray_env_sets_serve_defaults_and_keeps_the_users(monkeypatch):
    import os

    from services.serving.config import SERVE_ENV, quiet_ray_env

    for name in SERVE_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("RAY_SERVE_CONTROL_LOOP_INTERVAL_S", "2")  # the user's own
    quiet_ray_env()
    assert os.environ["RAY_SERVE_CONTROL_LOOP_INTERVAL_S"] == "2"
    assert os.environ["RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD"] == "0"
