"""``longspark serve``: start a local Ray, deploy the app, serve until Ctrl-C / SIGTERM.

With one engine replica and the API inside it (the default), the replica serves the port
itself (Ray Serve's direct ingress): a streamed chunk then goes from the replica to the
socket, not through Serve's proxy process as well (``direct_ingress``). With autoscaling
or a separate API deployment, Serve's proxy takes the port and routes.

SIGTERM drains first: new requests get 503 (``Retry-After``), in-flight ones finish within
``--grace-period`` seconds, then Serve and Ray shut down and the process exits. A second
SIGTERM, or Ctrl-C, stops at once.

The defaults are the app ``args`` and ``http_options`` of ``deploy/local-cpu.yaml`` (the
file ``serve run deploy/local-cpu.yaml`` deploys), so ``make serve`` and ``serve run``
start the same service; command-line options override them. Without a trained drafter
for the target (and no ``--drafter``), the service decodes plainly and says so.
"""

from __future__ import annotations

import argparse
import math
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

DEFAULT_CONFIG = Path(__file__).resolve().parents[2] / "deploy" / "local-cpu.yaml"
APP_NAME = "longspark"
DASHBOARD_PORT = 8265

# command-line option -> ServeArgs field
OVERRIDES = {
    "target": "target",
    "tp": "tp",
    "mode": "mode",
    "drafter": "drafter",
    "k": "k",
    "adaptive": "adaptive",
    "max_num_seqs": "max_num_seqs",
    "dtype": "dtype",
    "quant": "quant",
    "kv_dtype": "kv_dtype",
    "device": "device",
    "gpus_per_rank": "gpus_per_rank",
    "drafter_gpus": "drafter_gpus",
    "target_process": "target_process",
    "min_replicas": "min_replicas",
    "max_replicas": "max_replicas",
    "ingress": "ingress",
    "api_key": "api_key",
    "api_key_file": "api_key_file",
    "cors_origin": "cors_origins",
    "grace_period": "shutdown_grace_s",
    "max_tokens_limit": "max_tokens_limit",
    "stream_interval": "stream_interval",
    "generation_config": "generation_config",
}


def load_config(path: Path | None) -> tuple[dict[str, Any], dict[str, Any]]:
    """(app args, http_options) of the first application in a Serve config file."""
    import yaml

    path = path or DEFAULT_CONFIG
    if not path.is_file():
        if path == DEFAULT_CONFIG:
            return {}, {}
        raise FileNotFoundError(f"no Serve config at {path}")
    raw = yaml.safe_load(path.read_text()) or {}
    apps = raw.get("applications") or [{}]
    return dict(apps[0].get("args") or {}), dict(raw.get("http_options") or {})


def _dashboard_available() -> bool:
    import ray._private.utils as ray_utils

    check = getattr(ray_utils, "get_dashboard_dependency_error", None)
    return check is None or check() is None


def settings_from(args: argparse.Namespace) -> tuple[dict[str, Any], str, int]:
    """(app args, host, port): the config file's, overridden by the options given."""
    app_args, http = load_config(Path(args.config) if args.config else None)
    for option, field in OVERRIDES.items():
        value = getattr(args, option, None)
        if value is not None:
            app_args[field] = value
    if args.drafter is not None and args.mode is None:
        app_args["mode"] = "spec"
    host = args.host or http.get("host") or "127.0.0.1"
    port = args.port or http.get("port") or 8000
    return app_args, host, int(port)


def direct_ingress(cfg: Any, args: argparse.Namespace) -> bool:
    """Whether the replica serves the port itself: one fixed replica, API inside it."""
    one = cfg.min_replicas == cfg.max_replicas == 1
    return one and cfg.ingress == "replica" and not getattr(args, "no_direct_ingress", False)


def enable_direct_ingress(port: int) -> None:
    """Have the Ray processes started after this serve HTTP from the ingress replica on
    ``port`` (they inherit the environment). Serve hands replicas ports from
    ``[MIN, MAX)``: exactly ``port`` here. A replica that replaces a dead one takes the
    port at once (no quarantine: the old process and its socket are gone). Serve's proxy
    still starts (with the HTTP server off there would be none on the replica either), on
    a port of its own that nothing uses."""
    os.environ["RAY_SERVE_ENABLE_DIRECT_INGRESS"] = "1"
    os.environ["RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT"] = str(port)
    os.environ["RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT"] = str(port + 1)
    os.environ["RAY_SERVE_PORT_QUARANTINE_S"] = "0"


def run_server(args: argparse.Namespace) -> None:
    import ray
    from pydantic import ValidationError
    from ray import serve

    from api import proxy_guard
    from services.engine.backends import check_devices
    from services.serving.app import build_app
    from services.serving.config import RAY_SYSTEM_CONFIG, ServeArgs, quiet_ray_env
    from services.serving.drain import create_signal

    app_args, host, port = settings_from(args)
    if app_args.get("target") is None:
        print("Checking the default model (fetched once on first use)...", flush=True)
    try:
        cfg = ServeArgs.model_validate(app_args).resolved()  # fails here, before Ray starts
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise ValueError(f"{where + ': ' if where else ''}{first['msg']}") from None
    check_devices(cfg, use_ray=True)  # this machine's GPUs: the Ray started below sees them
    if cfg.mode == "ar" and app_args.get("mode", "spec") == "spec":
        print(
            f"No trained drafter ships for {Path(cfg.target).name}: serving PLAIN decoding. "
            "(Pass --drafter FOLDER, or --drafter random for an untrained, still exact one.)",
            flush=True,
        )
    app_args = cfg.model_dump()
    bundle_cpus = sum(b.get("CPU", 0) for b in cfg.bundles())
    num_cpus = max(os.cpu_count() or 1, math.ceil(bundle_cpus * cfg.max_replicas) + 1)
    dashboard = _dashboard_available() and not getattr(args, "no_dashboard", False)
    # Serve's proxy answers header values that are not UTF-8 with a bare 500 before the app
    # runs; this guard (inherited by the proxy through Ray's processes) answers a 400
    proxy_guard.install()
    proxy_port = port
    if direct_ingress(cfg, args):
        from services.serving.local import free_port

        enable_direct_ingress(port)
        proxy_port = free_port()
    quiet_ray_env()
    ray.init(
        num_cpus=num_cpus,
        include_dashboard=dashboard,
        dashboard_host="127.0.0.1",
        dashboard_port=DASHBOARD_PORT,
        namespace="serve",
        _system_config=RAY_SYSTEM_CONFIG,
    )
    stop, force = threading.Event(), threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: (force if stop.is_set() else stop).set())
    try:
        serve.start(
            http_options={"host": host, "port": proxy_port},
            logging_config={"log_level": "WARNING"},
        )
        drain_signal = create_signal(APP_NAME)
        print(f"Deploying {cfg.model_name} (this loads the model in each replica)...", flush=True)
        serve.run(
            build_app(app_args),
            name=APP_NAME,
            route_prefix="/",
            logging_config={"log_level": "WARNING"},
        )
        _print_banner(cfg, host, port, dashboard)
        while not stop.wait(1.0):
            pass
        _drain(drain_signal, cfg.shutdown_grace_s, _api_replicas(cfg), force)
    except KeyboardInterrupt:
        pass
    finally:
        print("Shutting down...", flush=True)
        serve.shutdown()
        ray.shutdown()


def _api_replicas(cfg: Any) -> int:
    """How many replicas serve the API (each reports its drain): the ingress deployment's,
    or, with the API inside the engine replicas, those running now."""
    from ray import serve

    from services.serving.app import ENGINE_DEPLOYMENT

    if cfg.ingress == "separate":
        return cfg.ingress_replicas
    try:
        status = serve.status().applications[APP_NAME].deployments[ENGINE_DEPLOYMENT]
        return max(1, status.replica_states.get("RUNNING", 0))
    except (KeyError, AttributeError):
        return cfg.min_replicas


def _drain(drain_signal: Any, grace_s: float, replicas: int, force: threading.Event) -> None:
    """Stop admitting and wait (at most ``grace_s``) for in-flight requests to finish."""
    import ray

    print(f"SIGTERM: draining (in-flight requests get up to {grace_s:g}s)...", flush=True)
    ray.get(drain_signal.drain.remote(grace_s))
    t0 = time.monotonic()
    while time.monotonic() < t0 + grace_s + 5.0 and not force.is_set():
        reports = ray.get(drain_signal.num_reports.remote())
        if reports >= replicas:
            print(f"Drained in {time.monotonic() - t0:.1f}s.", flush=True)
            return
        force.wait(0.2)
    print("Stopping with requests still in flight (grace period over, or SIGTERM again).")


def _print_banner(cfg: Any, host: str, port: int, dashboard: bool) -> None:
    url = f"http://{host}:{port}"
    auth = " -H 'Authorization: Bearer <your key>'" if cfg.api_key else ""
    replicas = (
        f"{cfg.min_replicas}" if cfg.min_replicas == cfg.max_replicas
        else f"{cfg.min_replicas}..{cfg.max_replicas} (autoscaling)"
    )  # fmt: skip
    lines = [
        f"longspark serving {cfg.model_name} at {url}/v1 (OpenAI API)",
        f"  mode: {cfg.mode}, drafter: {cfg.drafter_label}, TP={cfg.tp}, device: {cfg.device},"
        f" replicas: {replicas}",
        f"  auth: {'bearer token required' if cfg.api_key else 'off'}",
    ]
    if dashboard:
        lines.append(f"  Ray dashboard: http://127.0.0.1:{DASHBOARD_PORT}")
    lines += [
        "Try:",
        f"  curl {url}/v1/chat/completions{auth} -H 'Content-Type: application/json' \\",
        f'    -d \'{{"model": "{cfg.model_name}", "max_tokens": 64, '
        '"messages": [{"role": "user", "content": "Tell me about Paris."}]}\'',
        "Ctrl-C stops it.",
    ]
    print("\n".join(lines), flush=True)
