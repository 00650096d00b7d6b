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


@pytest.mark.parametrize("name", ["local-cpu.yaml", "gpu-node.yaml", "cluster.yaml"])
def test_serve_configs_validate(name):
    args = app_args(yaml.safe_load((DEPLOY / name).read_text()))
    bundles = args.bundles()
    assert len(bundles) == 1 + args.tp + (args.mode == "spec")
    if args.device == "gpu":
        assert all(b["GPU"] == 1 for b in bundles[1:]) and "GPU" not in bundles[0]


def test_local_cpu_config_fits_a_two_cpu_ray_and_listens_on_localhost():
    doc = yaml.safe_load((DEPLOY / "local-cpu.yaml").read_text())
    args = app_args(doc)
    assert sum(b["CPU"] for b in args.bundles()) <= 2
    assert doc["http_options"] == {"host": "127.0.0.1", "port": 8000}


def test_kuberay_service_embeds_a_valid_serve_config():
    doc = yaml.safe_load((DEPLOY / "kuberay-rayservice.yaml").read_text())
    assert doc["kind"] == "RayService"
    args = app_args(yaml.safe_load(doc["spec"]["serveConfigV2"]))
    assert args.device == "gpu" and args.max_replicas > args.min_replicas
    cluster = doc["spec"]["rayClusterConfig"]
    gpus = cluster["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]["resources"]
    assert int(gpus["limits"]["nvidia.com/gpu"]) >= len(args.bundles()) - 1


def test_cli_defaults_come_from_local_cpu_yaml_and_options_override():
    from services.cli.main import build_parser

    args = build_parser().parse_args(["serve"])
    app, host, port = settings_from(args)
    assert (host, port) == ("127.0.0.1", 8000) and app["cpus_per_actor"] == 0.5
    assert DEFAULT_CONFIG == DEPLOY / "local-cpu.yaml"
    args = build_parser().parse_args(
        ["serve", "--port", "9001", "--tp", "3", "--drafter", "random", "--max-replicas", "2"]
    )
    app, host, port = settings_from(args)
    assert port == 9001 and app["tp"] == 3 and app["drafter"] == "random"
    assert app["max_replicas"] == 2 and app["mode"] == "spec"


def test_serve_args_resolution(tiny_checkpoints, monkeypatch):
    path = str(tiny_checkpoints["qwen3"])
    monkeypatch.setenv(API_KEY_ENV, "from-env")
    plain = ServeArgs(target=path).resolved()  # no drafter ships for it: plain decoding
    assert plain.mode == "ar" and plain.drafter is None and plain.model_name == "qwen3"
    assert plain.api_key == "from-env" and len(plain.bundles()) == 2
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
