"""The Serve app's settings: one pydantic model, validated once, shared by every deployment.

``build_app(args)`` validates the ``args`` of a Serve config file (or of ``longspark
serve``) into :class:`ServeArgs`, resolves what depends on the machine (model folder,
shipped drafter, API key from the environment) with :meth:`ServeArgs.resolved`, and hands
the resolved settings to the deployments, so replicas never guess.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, Literal

from pydantic import ConfigDict, Field, field_validator, model_validator

from services.engine.backends import EngineOptions

log = logging.getLogger("longspark.serve")

API_KEY_ENV = "LONGSPARK_API_KEY"
API_KEY_FILE_ENV = "LONGSPARK_API_KEY_FILE"
# Ray settings for the Ray this project starts. The GCS keeps ~3 KB of task events per
# actor call for the dashboard's task list, up to this many tasks (Ray's default, 100k,
# is ~300 MB of GCS memory on a long-running service); the per-round actors turn theirs off.
# The rest slow Ray's background polling, which shares the cores with the forward: by
# default the raylet reports its resources every 0.1 s and reads every worker's memory
# every 0.25 s, and each worker sends its task events every second. Nothing on a serving
# node needs those faster than a second (the OOM killer still runs, once a second).
RAY_SYSTEM_CONFIG = {
    "task_events_max_num_task_in_gcs": 10_000,
    "task_events_report_interval_ms": 5_000,
    "raylet_report_resources_period_milliseconds": 1_000,
    "memory_monitor_refresh_ms": 1_000,
}
# Ray Serve's settings, read by its processes from the environment:
# - the controller's loop (Ray's default 0.1 s; it polls every deployment's state each
#   time), the largest share of an idle service's CPU. Health checks run every 10 s and
#   autoscaling looks back 30 s, so a 0.5 s loop changes no decision, only its CPU;
# - the app's code on the replica's own event loop rather than a second one (Serve's
#   "throughput-optimized" setting): a streamed chunk no longer crosses between two loops'
#   threads. Our handlers never block; the engine computes in its own thread.
SERVE_ENV = {
    "RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.5",
    "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0",
}


def quiet_ray_env() -> None:
    """Set :data:`SERVE_ENV` for the Ray processes started after this (they inherit the
    environment), where the user has not set them."""
    for name, value in SERVE_ENV.items():
        os.environ.setdefault(name, value)


def split_keys(text: str | None) -> list[str]:
    """Keys from a comma-separated string or a key file (one per line, ``#`` comments)."""
    keys = []
    for line in (text or "").replace(",", "\n").splitlines():
        key = line.split("#", 1)[0].strip()
        if key:
            keys.append(key)
    return keys


class ServeArgs(EngineOptions):
    """Everything a deployment of the service needs; field names match ``longspark serve``.

    The engine's own settings (target, tp, dtype, quant, kv_dtype, mode, drafter, k,
    adaptive, carry, context_copy, max_num_seqs, kv_cache_tokens, seed, and the devices:
    device, gpus_per_rank, drafter_gpus) are ``EngineOptions``' fields, inherited as they
    are; the rest is serving's. ``device: gpu`` (the old spelling) reads as ``cuda``.
    """

    model_config = ConfigDict(extra="forbid")

    model_name: str | None = Field(
        None, description="model id served by /v1/models (default: the target folder's name)"
    )
    drafter_timeout_s: float = Field(
        30.0, gt=0, description="a proposal slower than this counts as a drafter failure"
    )
    rank_silence_s: float = Field(
        10.0,
        gt=0,
        description="a target rank silent this long (no answer, no heartbeat) is taken for"
        " hung: its requests fail with 503 and the replica is replaced",
    )

    # placement: one bundle for the engine, one per target rank, one for the drafter; with
    # device cuda a rank's bundle holds gpus_per_rank GPU and the drafter's drafter_gpus
    cpus_per_actor: float = Field(
        1.0, gt=0, description="logical CPUs per bundle (engine, each rank, the drafter)"
    )
    threads_per_rank: int | None = Field(
        None, ge=1, description="torch threads per target rank (default: its CPUs, at least 1)"
    )
    target_process: Literal["auto", "replica", "actors"] = Field(
        "auto",
        description="where the target computes: the engine replica's own process (one rank,"
        " as vLLM's uni executor: no hop a round), Ray actors (one per rank), or auto (the"
        " replica at tp 1, actors above)",
    )

    # scaling and back-pressure
    min_replicas: int = Field(1, ge=1, description="engine replicas at least")
    max_replicas: int = Field(1, ge=1, description="engine replicas at most (autoscaling)")
    target_ongoing_requests: float = Field(
        16.0, gt=0, description="autoscaling target: ongoing requests per engine replica"
    )
    upscale_delay_s: float = Field(30.0, ge=0, description="load must last this long to scale up")
    downscale_delay_s: float = Field(300.0, ge=0, description="idle this long to scale down")
    metrics_interval_s: float = Field(
        2.0, gt=0, description="how often replicas report load to the autoscaler"
    )
    look_back_period_s: float = Field(
        10.0, gt=0, description="window the autoscaler averages load over"
    )
    max_ongoing_requests: int = Field(
        64, ge=1, description="requests one engine replica takes at once (more wait in queue)"
    )
    max_queued_requests: int = Field(
        256, description="requests queued per caller before 429 (-1: no limit)"
    )
    ingress: Literal["replica", "separate"] = Field(
        "replica",
        description="where the OpenAI API runs: in each engine replica (one process, no hop"
        " per token) or in its own deployment of ingress_replicas",
    )
    ingress_replicas: int = Field(1, ge=1, description="FastAPI ingress replicas (separate)")
    stream_interval: int = Field(
        1,
        ge=1,
        description="stream every N tokens (vLLM's --stream-interval): 1 sends each token as"
        " it comes; more cost the server fewer messages (the first token goes at once)",
    )
    admit_batch_size: int = Field(16, ge=1, description="@serve.batch: requests per admission")
    admit_batch_wait_s: float = Field(
        0.002, ge=0, description="@serve.batch: how long an admission batch waits to fill"
    )

    # limits (requests over them get a 4xx/5xx at once, never an unbounded queue)
    max_tokens_limit: int | None = Field(
        4096, ge=1, description="max_tokens a request may ask for (more: 400); None = no cap"
    )
    max_prompt_tokens: int | None = Field(
        None, ge=1, description="longer prompts get 400 (None: the model's context)"
    )
    max_waiting_seqs: int | None = Field(
        128, ge=1, description="requests waiting in one engine for a running slot (more: 429)"
    )
    queue_timeout_s: float | None = Field(
        60.0, gt=0, description="a request not running this long after arrival gets 503"
    )
    shutdown_grace_s: float = Field(
        30.0, ge=0, description="on SIGTERM: how long in-flight requests may take to finish"
    )

    # HTTP
    api_key: str | None = Field(
        None,
        repr=False,
        description=f"bearer token(s) required on /v1, comma-separated (default: ${API_KEY_ENV};"
        " none = open)",
    )
    api_key_file: str | None = Field(
        None, description=f"file of accepted keys, one per line (default: ${API_KEY_FILE_ENV})"
    )
    api_keys: list[str] = Field(
        default_factory=list, repr=False, description="every accepted key (set by resolved())"
    )
    cors_origins: list[str] = Field(
        default_factory=list, description="origins allowed by CORS (empty: CORS off)"
    )
    max_request_bytes: int = Field(4 << 20, ge=1024, description="bigger bodies get 413")
    debug_routes: bool = Field(True, description="GET /debug/engine: engine accounting")
    generation_config: str = Field(
        "auto",
        description="sampling defaults: auto (the model folder's generation_config.json),"
        " vllm (none: OpenAI's) or a folder holding one",
    )
    sampling_defaults: dict[str, float] = Field(
        default_factory=dict, description="what requests get unset (set by resolved())"
    )

    @field_validator("device", mode="before")
    @classmethod
    def _old_gpu_spelling(cls, v: Any) -> Any:
        return "cuda" if v == "gpu" else v

    @model_validator(mode="after")
    def _check(self) -> ServeArgs:
        if self.max_replicas < self.min_replicas:
            raise ValueError(
                f"max_replicas ({self.max_replicas}) < min_replicas ({self.min_replicas})"
            )
        if self.drafter_device is not None:
            raise ValueError(
                "drafter_device is for in-process engines: a replica's drafter is a Ray actor"
                " with drafter_gpus of a GPU of its own"
            )
        if self.target_process == "replica" and self.tp > 1:
            raise ValueError(
                f"target_process replica holds one rank; tp {self.tp} needs actors (or auto)"
            )
        return self

    @property
    def rank_in_replica(self) -> bool:
        """Whether the (single) target rank computes in the engine replica's process."""
        return self.target_process == "replica" or (self.target_process == "auto" and self.tp == 1)

    # -- resolution (once, where build_app runs) ------------------------------------
    def resolved(self) -> ServeArgs:
        """Model folder, served name, drafter choice and API key fixed for the replicas."""
        from services.engine.backends import shipped_drafter
        from services.engine.generation_config import sampling_defaults
        from target_actor.checkpoint import resolve_target
        from target_actor.config import ModelConfig

        path = resolve_target(self.target)
        ModelConfig.from_pretrained(path).check_tp(self.tp)
        api_key = self.api_key or os.environ.get(API_KEY_ENV) or None
        key_file = self.api_key_file or os.environ.get(API_KEY_FILE_ENV) or None
        keys = [*self.api_keys, *split_keys(api_key)]
        if key_file is not None:
            keys += split_keys(Path(key_file).read_text())
        update: dict[str, Any] = {
            "target": str(path),
            "model_name": self.model_name or path.name,
            "api_key": api_key,
            "api_key_file": key_file,
            "api_keys": list(dict.fromkeys(keys)),
            "sampling_defaults": sampling_defaults(path, self.generation_config),
        }
        if self.mode == "spec" and self.drafter is None:
            shipped = shipped_drafter(path)
            if shipped is None:
                log.warning("no trained drafter ships for %s: serving plain decoding", path.name)
                update["mode"] = "ar"
            else:
                update["drafter"] = str(shipped)
        if self.mode == "ar" or update.get("mode") == "ar":
            update["drafter"] = None
        return self.model_copy(update=update)

    @property
    def drafter_label(self) -> str:
        if self.mode == "ar":
            return "none (plain decoding)"
        return self.drafter if self.drafter in (None, "random") else Path(self.drafter).name

    # -- what Serve needs -----------------------------------------------------------
    def rank_resources(self) -> dict[str, float]:
        """One target rank's bundle."""
        return self._bundle(self.gpus_per_rank)

    def drafter_resources(self) -> dict[str, float]:
        """The drafter's bundle."""
        return self._bundle(self.drafter_gpus)

    def _bundle(self, gpus: float) -> dict[str, float]:
        if self.device == "cuda":
            return {"CPU": self.cpus_per_actor, "GPU": gpus}
        return {"CPU": self.cpus_per_actor}

    def replica_resources(self) -> dict[str, float]:
        """The engine replica's bundle (bundle 0): its own CPUs, and a rank's CPUs and GPU
        share when the rank computes in it."""
        if not self.rank_in_replica:
            return {"CPU": self.cpus_per_actor}
        rank = self.rank_resources()
        return {**rank, "CPU": self.cpus_per_actor + rank["CPU"]}

    def bundles(self) -> list[dict[str, float]]:
        """Engine replica first (it runs in bundle 0), then the ranks that are actors (``tp``
        of them, or none when the rank computes in the replica), then the drafter (spec
        mode)."""
        ranks = [] if self.rank_in_replica else [self.rank_resources() for _ in range(self.tp)]
        drafter = [self.drafter_resources()] if self.mode == "spec" else []
        return [self.replica_resources(), *ranks, *drafter]

    @property
    def drafter_bundle(self) -> int:
        """The drafter's bundle index in ``bundles()``."""
        return 1 if self.rank_in_replica else self.tp + 1

    def autoscaling(self) -> dict[str, Any]:
        return {
            "min_replicas": self.min_replicas,
            "max_replicas": self.max_replicas,
            "target_ongoing_requests": self.target_ongoing_requests,
            "upscale_delay_s": self.upscale_delay_s,
            "downscale_delay_s": self.downscale_delay_s,
            "metrics_interval_s": self.metrics_interval_s,
            "look_back_period_s": self.look_back_period_s,
        }

    @property
    def rank_threads(self) -> int:
        return self.threads_per_rank or max(1, int(self.cpus_per_actor))
