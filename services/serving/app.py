"""The Ray Serve app: the OpenAI API (FastAPI) and autoscaled engine replicas.

* :class:`EngineReplica`: one replica = one engine = one target TP group + one drafter,
  in the replica's own placement group (``ServeArgs.bundles``: engine, ``tp`` ranks,
  drafter; ``STRICT_PACK``). An :class:`~services.engine.async_engine.AsyncEngine` thread runs
  the rounds; ``@serve.batch`` gathers requests arriving together into one admission
  (tokenize + ``add_request`` in one engine-thread call, so they prefill together).
  Autoscaled on ongoing requests. ``check_health`` fails once a target rank died, so
  Serve replaces the replica.
* Two layouts (``ServeArgs.ingress``):
  - ``replica`` (default): :class:`EngineIngressReplica`, the API of :mod:`api` inside each
    engine replica over a :class:`LocalEngineClient`. Serve's proxy sends HTTP straight to
    a replica, and a token's delta goes from the engine thread to the SSE stream in one
    process. The replica caps what it takes (429 past ``max_ongoing_requests +
    max_queued_requests``).
  - ``separate``: :class:`IngressReplica` deployments in front, calling the engine
    deployment's handle (``generate`` streams slimmed deltas); Serve's queue limits push
    back and the ingress answers 429.
  Either way the API drains when the launcher says so (``services.serving.drain``): 503 for
  new requests, in-flight ones finish.

``build_app(args)`` is the app builder for ``serve run deploy/local-cpu.yaml`` (import
path ``services.serving.app:build_app``) and for ``longspark serve``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from ray import serve
from ray.serve import Application
from ray.serve.handle import DeploymentHandle

from api.app import create_app
from api.lifecycle import Lifecycle
from api.serving import OpenAIServing, ServingSettings
from services.engine.async_engine import AsyncEngine, EngineLimits, GenerateRequest, RequestStream
from services.engine.core import Engine
from services.engine.sequence import RequestOutput
from services.serving import errors as _serve_errors  # noqa: F401 - adds the translator
from services.serving.config import ServeArgs
from services.serving.drain import find_signal
from services.serving.metrics import EngineMetrics
from services.serving.replica import build_replica_engine
from target_actor.priority import raise_process_priority
from target_actor.worker import TargetGroup

log = logging.getLogger("longspark.serve")

ENGINE_DEPLOYMENT = "LongSparkEngine"
INGRESS_DEPLOYMENT = "OpenAIIngress"


def _slim(out: RequestOutput) -> RequestOutput:
    """Deltas cross the wire without the whole-output-so-far copies (kept on the last)."""
    return out if out.finished else dataclasses.replace(out, text="", token_ids=[])


def _object_store() -> dict[str, int] | None:
    """Bytes and objects in Ray's object store (asked of the raylet), or None."""
    import ray
    from ray._private.internal_api import get_memory_info_reply, get_state_from_address

    try:
        state = get_state_from_address(ray.get_runtime_context().gcs_address)
        stats = get_memory_info_reply(state, timeout_seconds=5.0).store_stats
    except Exception:  # noqa: BLE001 - a debug figure must never fail the endpoint
        log.debug("object store stats unavailable", exc_info=True)
        return None
    return {
        "bytes_used": int(stats.object_store_bytes_used),
        "objects": int(stats.num_local_objects),
    }


class EngineReplica:
    """One engine (target TP group + drafter) and its request streams."""

    def __init__(self, args: dict[str, Any]) -> None:
        self.args = ServeArgs.model_validate(args)
        # Ray nices its workers; the engine thread shares this process's GIL with Serve's
        # loops, so they all take one priority (target_actor.priority)
        raise_process_priority()

        def build() -> Engine:  # on the engine thread: a rank in this process computes there
            engine, self._close, self.drafter = build_replica_engine(self.args)
            return engine

        limits = EngineLimits(
            max_prompt_tokens=self.args.max_prompt_tokens,
            max_waiting=self.args.max_waiting_seqs,
            queue_timeout_s=self.args.queue_timeout_s,
        )
        self.engine = AsyncEngine(
            build,
            extra_stats=self._replica_stats,
            limits=limits,
            stream_interval=self.args.stream_interval,
        )
        self._admit.set_max_batch_size(self.args.admit_batch_size)
        self._admit.set_batch_wait_timeout_s(self.args.admit_batch_wait_s)
        self.metrics = EngineMetrics(self.args.model_name or "")
        self._metrics_task: asyncio.Task | None = None
        self.admissions = {"batches": 0, "requests": 0, "largest": 0}  # @serve.batch at work

    async def generate(self, request: GenerateRequest) -> AsyncIterator[RequestOutput]:
        """The deployment-handle call of the split layout: deltas slimmed for the wire."""
        async for out in self.outputs(request):
            yield _slim(out)

    async def outputs(self, request: GenerateRequest) -> AsyncIterator[RequestOutput]:
        """Admit (batched with concurrent arrivals), then stream the request's deltas."""
        self._start_metrics()
        t0, first = time.monotonic(), None
        try:
            stream = await self._admit(request)
        except asyncio.CancelledError:  # the client left while its batch was admitted
            self.engine.abort(request.request_id)
            raise
        if isinstance(stream, BaseException):
            raise stream
        async for out in self.engine.stream(stream):
            if first is None and out.new_token_ids:
                first = time.monotonic()
            if out.finished and first is not None:
                n = len(out.token_ids)
                tpot = (time.monotonic() - first) / (n - 1) if n > 1 else None
                self.metrics.observe_request(first - t0, tpot)
            yield out

    @serve.batch(max_batch_size=16, batch_wait_timeout_s=0.002)
    async def _admit(self, requests: list[GenerateRequest]) -> list[RequestStream | BaseException]:
        a = self.admissions
        a["batches"], a["requests"] = a["batches"] + 1, a["requests"] + len(requests)
        a["largest"] = max(a["largest"], len(requests))
        return await self.engine.admit(requests)

    async def stats(self) -> dict[str, Any]:
        """The engine's accounting (for /debug/engine and tests), and the node's object
        store (the load test checks it returns to idle)."""
        out = await self.engine.stats()
        out["object_store"] = await asyncio.to_thread(_object_store)
        return out

    async def health(self) -> None:
        self.engine.check_health()

    async def tokenize(
        self, request: GenerateRequest, add_special_tokens: bool = True
    ) -> list[int]:
        return await self.engine.tokenize(request, add_special_tokens)

    async def detokenize(self, token_ids: list[int]) -> str:
        return await self.engine.detokenize(token_ids)

    async def model_info(self) -> dict[str, Any]:
        return await self.engine.model_info()

    async def metrics_text(self) -> str:
        """This replica's metrics, Prometheus text (``/metrics`` on the API port)."""
        snap = await self.engine.call(lambda engine: EngineMetrics.snapshot(engine, drain=False))
        return self.metrics.prometheus_text(snap)

    def check_health(self) -> None:
        """Serve's periodic health check: fails once a target rank died."""
        self.engine.check_health()

    def _replica_stats(self) -> dict[str, Any]:  # runs on the engine thread
        out: dict[str, Any] = {
            "replica": serve.get_replica_context().replica_tag,
            "replica_pid": os.getpid(),
            "admissions": dict(self.admissions),
            # HTTP served by this replica itself (``longspark serve`` with one replica)
            "direct_ingress": os.environ.get("RAY_SERVE_ENABLE_DIRECT_INGRESS") == "1",
        }
        target = self.engine.engine.target
        # a rank computing in the replica has the replica's process
        out["target_pids"] = target.pids() if isinstance(target, TargetGroup) else [os.getpid()]
        if self.drafter is not None:
            out.update(self.drafter.counters())
            out["drafter_pid"] = self.drafter.pid()
        return out

    def _start_metrics(self) -> None:
        if self._metrics_task is None:
            self._metrics_task = asyncio.get_running_loop().create_task(self._export_metrics())

    async def _export_metrics(self) -> None:
        while True:
            try:
                self.metrics.update(await self.engine.call(self.metrics.snapshot))
            except Exception:  # noqa: BLE001 - metrics must never break serving
                log.debug("metrics export failed", exc_info=True)
            await asyncio.sleep(2.0)

    def __del__(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()
            self._close()


class ServeEngineClient:
    """The API's engine client over the engine deployment's handle (streaming)."""

    def __init__(self, handle: DeploymentHandle) -> None:
        self.handle = handle

    def generate(self, request: GenerateRequest) -> AsyncIterator[RequestOutput]:
        return self.handle.options(stream=True).generate.remote(request)

    async def stats(self) -> dict[str, Any]:
        return await self.handle.stats.remote()

    async def health(self) -> None:
        await self.handle.health.remote()

    async def tokenize(
        self, request: GenerateRequest, add_special_tokens: bool = True
    ) -> list[int]:
        return await self.handle.tokenize.remote(request, add_special_tokens)

    async def detokenize(self, token_ids: list[int]) -> str:
        return await self.handle.detokenize.remote(token_ids)

    async def model_info(self) -> dict[str, Any]:
        return await self.handle.model_info.remote()

    async def metrics_text(self) -> str:
        return await self.handle.metrics_text.remote()


class LocalEngineClient:
    """The API's engine client inside the engine replica itself: no hop per delta."""

    def __init__(self, replica: EngineReplica) -> None:
        self.replica = replica

    def generate(self, request: GenerateRequest) -> AsyncIterator[RequestOutput]:
        return self.replica.outputs(request)

    async def stats(self) -> dict[str, Any]:
        return await self.replica.stats()

    async def health(self) -> None:
        await self.replica.health()

    async def tokenize(
        self, request: GenerateRequest, add_special_tokens: bool = True
    ) -> list[int]:
        return await self.replica.tokenize(request, add_special_tokens)

    async def detokenize(self, token_ids: list[int]) -> str:
        return await self.replica.detokenize(token_ids)

    async def model_info(self) -> dict[str, Any]:
        return await self.replica.model_info()

    async def metrics_text(self) -> str:
        return await self.replica.metrics_text()


class OpenAIFront:
    """The FastAPI app of :mod:`api` over an engine client, and its drain on SIGTERM."""

    def _init_front(self, client: Any, a: ServeArgs, max_in_flight: int | None = None) -> None:
        settings = ServingSettings(
            model_name=a.model_name or "",
            mode=a.mode,
            api_keys=tuple(a.api_keys),
            max_request_bytes=a.max_request_bytes,
            max_tokens_limit=a.max_tokens_limit,
            cors_origins=tuple(a.cors_origins),
            debug_routes=a.debug_routes,
            sampling_defaults=dict(a.sampling_defaults),
        )
        self.serving = OpenAIServing(client, settings)
        self.lifecycle = Lifecycle(max_in_flight)

    def __serve_build_asgi_app__(self) -> Any:
        @asynccontextmanager
        async def lifespan(app: Any) -> AsyncIterator[None]:
            watcher = asyncio.get_running_loop().create_task(self._drain_when_told())
            yield
            watcher.cancel()

        # Serve's proxy already echoes X-Request-Id (the same id this app logs and returns)
        return create_app(self.serving, self.lifecycle, lifespan, echo_request_id=False)

    async def _drain_when_told(self) -> None:
        context = serve.get_replica_context()
        signal = find_signal(context.app_name)
        if signal is None:
            return
        grace_s = await signal.wait.remote()
        self.lifecycle.drain()
        log.warning(
            "draining: %d requests in flight, %gs to finish", self.lifecycle.in_flight, grace_s
        )
        idle = await self.lifecycle.wait_idle(grace_s)
        log.warning(
            "drained: %s", "idle" if idle else f"{self.lifecycle.in_flight} still in flight"
        )
        await signal.report.remote(context.replica_tag, idle)


class IngressReplica(OpenAIFront):
    """The split layout's ingress: the API over the engine deployment's handle."""

    def __init__(self, engine: DeploymentHandle, args: dict[str, Any]) -> None:
        self._init_front(ServeEngineClient(engine), ServeArgs.model_validate(args))


class EngineIngressReplica(EngineReplica, OpenAIFront):
    """The one-process layout: the API and the engine in one replica. Serve's proxy sends
    HTTP straight here, so a delta crosses no Ray hop between engine and API. Serve's own
    queue limits would answer a bare 503, so the replica takes up to
    ``max_ongoing_requests + max_queued_requests`` itself and answers 429 past that."""

    def __init__(self, args: dict[str, Any]) -> None:
        EngineReplica.__init__(self, args)
        a = self.args
        cap = None if a.max_queued_requests < 0 else a.max_ongoing_requests + a.max_queued_requests
        self._init_front(LocalEngineClient(self), a, cap)


EngineDeployment = serve.deployment(name=ENGINE_DEPLOYMENT)(EngineReplica)
IngressDeployment = serve.deployment(name=INGRESS_DEPLOYMENT)(serve.ingress()(IngressReplica))
EngineIngressDeployment = serve.deployment(name=ENGINE_DEPLOYMENT)(
    serve.ingress()(EngineIngressReplica)
)


def build_app(args: dict[str, Any] | None = None) -> Application:
    """The app for ``serve run`` / ``serve.run``: validate and resolve ``args`` once.

    No hardware check here: on a cluster the app is built where Serve runs (a CPU-only
    head, say) and an autoscaler may add the GPU nodes later; ``longspark serve`` checks
    this machine's GPUs before it starts Ray."""
    cfg = ServeArgs.model_validate(args or {}).resolved()
    engine_options = engine_deployment_options(cfg)
    resolved = cfg.model_dump()
    if cfg.ingress == "replica":
        return EngineIngressDeployment.options(**engine_options).bind(resolved)
    engine = EngineDeployment.options(**engine_options).bind(resolved)
    ingress = IngressDeployment.options(
        num_replicas=cfg.ingress_replicas,
        ray_actor_options={"num_cpus": 0},
        max_ongoing_requests=max(1000, 2 * cfg.max_replicas * cfg.max_ongoing_requests),
    )
    return ingress.bind(engine, resolved)


def replica_actor_options(cfg: ServeArgs) -> dict[str, Any]:
    """The engine replica's resources: all of bundle 0 (Serve places it there)."""
    res = cfg.replica_resources()
    return {"num_cpus": res["CPU"], **({"num_gpus": res["GPU"]} if "GPU" in res else {})}


def engine_deployment_options(cfg: ServeArgs) -> dict[str, Any]:
    """The engine deployment's Serve options: one ``STRICT_PACK`` placement group per
    replica (``ServeArgs.bundles``), its scaling and its queue limits."""
    engine_options: dict[str, Any] = dict(
        placement_group_bundles=cfg.bundles(),
        placement_group_strategy="STRICT_PACK",
        ray_actor_options=replica_actor_options(cfg),
        max_ongoing_requests=cfg.max_ongoing_requests,
        max_queued_requests=cfg.max_queued_requests,
        health_check_period_s=5.0,
        health_check_timeout_s=60.0,
        graceful_shutdown_timeout_s=max(120.0, cfg.shutdown_grace_s + 10.0),
    )
    if cfg.max_replicas > cfg.min_replicas:
        engine_options["autoscaling_config"] = cfg.autoscaling()
    else:
        engine_options["num_replicas"] = cfg.min_replicas
    if cfg.ingress == "replica":
        # Serve must not push back before the replica does (its 503 is not OpenAI JSON)
        engine_options["max_ongoing_requests"] = max(
            1000, 2 * (cfg.max_ongoing_requests + max(cfg.max_queued_requests, 0))
        )
        engine_options["max_queued_requests"] = -1
    return engine_options
