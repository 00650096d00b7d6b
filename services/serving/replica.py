"""Build one engine replica's engine inside the replica's placement group.

Serve reserves one placement group per engine replica (``ServeArgs.bundles``),
``STRICT_PACK``: bundle 0 holds the replica itself (the engine thread), then come the
target ranks that are Ray actors, one bundle each, and last the drafter (on GPUs: a
rank's bundle holds ``gpus_per_rank`` of a GPU, the drafter's ``drafter_gpus``). The
ranks and the drafter are started in exactly those bundles, so a replica's resources are
reserved all at once and freed with it. Outside a placement group (tests that build an
engine directly), the target reserves its own, as ``TargetGroup`` does.

At tp 1 the rank computes in the replica's own process by default (``target_process``
``auto``; as vLLM's uni executor does): bundle 0 then holds the rank's CPUs and GPU too,
and a round costs no hop to another process and no Ray threads beside the forward (the
engine's Python then shares the replica's GIL with the streaming; ``actors`` keeps a Ray
rank). Build this on the engine thread (``AsyncEngine`` takes the builder): the rank's
OpenMP team is made by the thread that first computes, and one team per process is what
keeps libgomp spinning instead of sleeping at each barrier.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from ray.util.placement_group import get_current_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from services.engine.backends import views_window
from services.engine.core import Engine
from services.engine.resilient_drafter import ResilientDrafter
from services.engine.tokenizer import Tokenizer
from services.serving.config import ServeArgs
from target_actor.worker import LocalTarget, TargetGroup


def build_replica_engine(
    args: ServeArgs,
) -> tuple[Engine, Callable[[], None], ResilientDrafter | None]:
    """The engine (target group + fault-tolerant drafter), its closer, and the drafter."""
    from drafter_actor.worker import RayDrafter

    pg = get_current_placement_group()
    rank_res, drafter_res = args.rank_resources(), args.drafter_resources()
    spec = args.target_spec(num_threads=args.rank_threads).resolved(args.tp)
    drafter: ResilientDrafter | None = None
    if args.mode == "spec":
        strategy = (
            PlacementGroupSchedulingStrategy(
                placement_group=pg, placement_group_bundle_index=args.drafter_bundle
            )
            if pg is not None
            else None
        )

        def start_drafter() -> Any:
            return RayDrafter(
                args.target,
                args.drafter,
                num_cpus=drafter_res["CPU"],
                num_gpus=drafter_res.get("GPU", 0.0),
                scheduling_strategy=strategy,
                **args.drafter_kwargs(ray=True),
            )

        drafter = ResilientDrafter(start_drafter, args.drafter_timeout_s)
        spec = dataclasses.replace(spec, tap_layer_ids=tuple(drafter.cfg.tap_layer_ids))
    window = views_window(drafter)
    target: TargetGroup | LocalTarget
    if args.rank_in_replica:
        target = LocalTarget(spec, window)
    elif pg is not None:
        target = TargetGroup(
            spec,
            args.tp,
            rank_res["CPU"],
            rank_res.get("GPU", 0.0),
            window,
            pg=pg,
            first_bundle=1,
            silence_s=args.rank_silence_s,
        )
    else:
        target = TargetGroup(
            spec,
            args.tp,
            rank_res["CPU"],
            rank_res.get("GPU", 0.0),
            window=window,
            silence_s=args.rank_silence_s,
        )
    engine = Engine(target, Tokenizer(args.target), drafter, args.engine_config(drafter, spec))

    def close() -> None:
        if drafter is not None:
            drafter.shutdown()
        target.shutdown()

    return engine, close, drafter
