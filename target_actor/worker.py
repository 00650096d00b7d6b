"""The target as Ray actors: one ``TargetWorker`` per TP rank, driven as one ``TargetGroup``.

The group reserves one placement group (one bundle per rank, ``STRICT_PACK``), starts the
ranks, joins them into a ``torch.distributed`` group (gloo on CPU, nccl on CUDA) and then
sends every rank the same call, returning rank 0's result. ``LocalTarget`` offers the same
interface in-process at TP=1, without Ray.

Every step's calls go over a direct, authenticated socket per rank that the group sets up
through Ray (``target_actor.channel``: a Ray task costs ~2 ms around a 9 ms step on two
cores, and Ray's compiled graphs busy-wait); set-up, placement, ids and kills stay Ray's.
"""

from __future__ import annotations

import os
import socket
from typing import Any

import ray
import torch
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from target_actor.batch import (
    ForwardBatch,
    ForwardOutput,
    PrefillBatch,
    ResumeBatch,
    StepResult,
    VerifyBatch,
)
from target_actor.channel import ChannelGroup, new_key, serve
from target_actor.config import ModelConfig
from target_actor.parallel import init_distributed
from target_actor.priority import raise_thread_priority
from target_actor.runner import TargetRunner, TargetSpec, resolve_device
from target_actor.verifier import Verifier

RANK_SILENCE_S = 10.0  # the watchdog's default: heartbeats come every 0.5 s while a rank works


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


class TargetWorker:
    """One TP rank. Wrapped with ``ray.remote`` by ``TargetGroup``."""

    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world = rank, world
        self.verifier: Verifier | None = None

    def rendezvous(self) -> tuple[str, int]:
        """Rank 0's node address and a free port on it, for the process group."""
        return ray.util.get_node_ip_address(), _free_port()

    def setup(
        self, spec: TargetSpec, master_addr: str, master_port: int, window: int
    ) -> ModelConfig:
        # on a GPU, "cuda" is the one Ray assigned this actor (CUDA_VISIBLE_DEVICES holds
        # only it): fixed before the process group, which NCCL binds to the current device
        device = resolve_device(spec.device)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        tp = init_distributed(self.rank, self.world, master_addr, master_port, device.type)
        self.verifier = Verifier(TargetRunner(spec, tp), window)
        return self.verifier.cfg

    def open_channel(self, key: bytes) -> tuple[str, int]:
        """Serve the engine's calls on a socket (see ``target_actor.channel``), set-up
        included: every torch op of this rank runs on the channel's thread, so the process
        has one OpenMP team. (A second team, made by ops on Ray's task thread, makes libgomp
        see more threads than cores, and it then sleeps at each barrier instead of spinning
        briefly: on 2 cores that took a 1-row step from 9 to 16 ms.)"""
        return serve(ray.util.get_node_ip_address(), key, self._run)

    def _run(self, method: str, args: tuple[Any, ...]) -> Any:
        """``setup`` or one verifier method (``verify``, ``prefill``, ``free``, ``kv_stats``...);
        rank 0's result (the others return None)."""
        if method == "setup":
            raise_thread_priority()  # this thread and the OpenMP team it makes compute
            result = self.setup(*args)
        else:
            result = getattr(self.verifier, method)(*args)
        return result if self.rank == 0 else None


class TargetGroup:
    """N target ranks on Ray; ``call`` runs a runner method on all, returns rank 0's result."""

    def __init__(
        self,
        spec: TargetSpec,
        tp: int,
        cpus_per_rank: float = 1.0,
        gpus_per_rank: float = 0.0,
        window: int = 256,
        pg: PlacementGroup | None = None,
        first_bundle: int = 0,
        silence_s: float | None = RANK_SILENCE_S,
    ) -> None:
        """Start ``tp`` ranks in a new ``STRICT_PACK`` placement group, or, when ``pg`` is
        given (a Serve replica's), in its bundles ``first_bundle..first_bundle+tp-1``.
        ``silence_s``: a rank silent this long (no answer, no heartbeat) is taken for hung
        and the group fails with ``TargetLostError`` (None: wait forever)."""
        ModelConfig.from_pretrained(spec.path, spec.num_taps).check_tp(tp)  # fail before Ray work
        spec = spec.resolved(tp)  # every rank the same weight form
        self.owns_pg = pg is None
        if pg is None:
            bundle = {"CPU": cpus_per_rank, **({"GPU": gpus_per_rank} if gpus_per_rank else {})}
            pg = placement_group([dict(bundle) for _ in range(tp)], strategy="STRICT_PACK")
            ray.get(pg.ready(), timeout=120)
        self.pg: PlacementGroup = pg
        threads = str(spec.num_threads or max(1, int(cpus_per_rank)))
        actor_cls = ray.remote(TargetWorker)
        self.workers = [
            actor_cls.options(
                num_cpus=cpus_per_rank,
                num_gpus=gpus_per_rank,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=pg, placement_group_bundle_index=first_bundle + rank
                ),
                runtime_env={"env_vars": {"OMP_NUM_THREADS": threads}},
                enable_task_events=False,  # Ray's task events grow the GCS per call
            ).remote(rank, tp)
            for rank in range(tp)
        ]
        key = new_key()
        addresses = ray.get([w.open_channel.remote(key) for w in self.workers])
        self.channel = ChannelGroup(addresses, key, silence_s)
        addr, port = ray.get(self.workers[0].rendezvous.remote())
        self.cfg: ModelConfig = self.call("setup", spec, addr, port, window)

    def pids(self) -> list[int]:
        """The ranks' process ids (fault-injection tests kill them)."""
        return ray.get([w.__ray_call__.remote(lambda _: os.getpid()) for w in self.workers])

    def call(self, method: str, *args: Any) -> Any:
        """Run one verifier method on every rank; rank 0's result. A rank's exception is
        raised as it was; a dead rank raises ``TargetLostError`` (the group is unusable)."""
        return self.channel.call(method, args)

    def prefill(self, batch: PrefillBatch) -> tuple[StepResult, Any]:
        return self.call("prefill", batch)

    def verify(self, batch: VerifyBatch, proposal: Any) -> tuple[StepResult, Any]:
        return self.call("verify", batch, proposal)

    def preempt(self, seq_ids: list[int]) -> None:
        self.call("preempt", seq_ids)

    def resume(self, batch: ResumeBatch) -> Any:
        return self.call("resume", batch)

    def set_summary_queries(self, g: Any) -> None:
        self.call("set_summary_queries", g)

    def kv_capacity_tokens(self) -> int:
        stats = self.kv_stats()
        return stats["total_blocks"] * stats["block_size"]

    def forward(self, batch: ForwardBatch) -> ForwardOutput:
        return self.call("forward", batch)

    def free(self, seq_ids: list[int]) -> None:
        self.call("free", seq_ids)

    def kv_stats(self) -> dict[str, int]:
        return self.call("kv_stats")

    def shutdown(self) -> None:
        self.channel.close()
        for w in self.workers:
            ray.kill(w)
        if self.owns_pg:
            remove_placement_group(self.pg)


class LocalTarget:
    """TP=1 in this process, with ``TargetGroup``'s interface."""

    def __init__(self, spec: TargetSpec, window: int = 256) -> None:
        self.verifier = Verifier(TargetRunner(spec), window)
        self.runner, self.cfg = self.verifier.runner, self.verifier.cfg

    def call(self, method: str, *args: Any) -> Any:
        return getattr(self.verifier, method)(*args)

    def forward(self, batch: ForwardBatch) -> ForwardOutput:
        return self.runner.forward(batch)

    def prefill(self, batch: PrefillBatch) -> tuple[StepResult, Any]:
        return self.verifier.prefill(batch)

    def verify(self, batch: VerifyBatch, proposal: Any) -> tuple[StepResult, Any]:
        return self.verifier.verify(batch, proposal)

    def preempt(self, seq_ids: list[int]) -> None:
        self.verifier.preempt(seq_ids)

    def resume(self, batch: ResumeBatch) -> Any:
        return self.verifier.resume(batch)

    def set_summary_queries(self, g: Any) -> None:
        self.verifier.set_summary_queries(g)

    def free(self, seq_ids: list[int]) -> None:
        self.verifier.free(seq_ids)

    def kv_stats(self) -> dict[str, int]:
        return self.runner.kv_stats()

    def kv_capacity_tokens(self) -> int:
        return self.runner.cache.total_blocks * self.runner.cache.block_size

    def shutdown(self) -> None:
        pass
