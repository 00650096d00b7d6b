"""Build one engine replica's engine inside the replica's placement group.

Serve reserves one placement group per engine replica (``ServeArgs.bundles``): bundle 0
holds the replica itself (the engine thread), bundles ``1..tp`` the target ranks and
bundle ``tp + 1`` the drafter, ``STRICT_PACK``. The target ranks and the drafter are
started in exactly those bundles, so a replica's resources are reserved all at once and
freed with it. Outside a placement group (tests that build an engine directly), the
target reserves its own, as ``TargetGroup`` does.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from ray.util.placement_group import get_current_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from services.engine.core import Engine, EngineConfig
from services.engine.resilient_drafter import ResilientDrafter
from services.engine.tokenizer import Tokenizer
from services.serving.config import ServeArgs
from target_actor.runner import TargetSpec
from target_actor.worker import TargetGroup


def build_replica_engine(
    args: ServeArgs,
) -> tuple[Engine, Callable[[], None], ResilientDrafter | None]:
    """The engine (target group + fault-tolerant drafter), its closer, and the drafter."""
    from drafter_actor.worker import RayDrafter

    pg = get_current_placement_group()
    resources = args.actor_resources()
    spec = TargetSpec(
        args.target,
        dtype=args.dtype,
        kv_cache_tokens=args.kv_cache_tokens,
        num_threads=args.rank_threads,
    )
    drafter: ResilientDrafter | None = None
    if args.mode == "spec":
        strategy = (
            PlacementGroupSchedulingStrategy(
                placement_group=pg, placement_group_bundle_index=args.tp + 1
            )
            if pg is not None
            else None
        )

        def start_drafter() -> Any:
            return RayDrafter(
                args.target,
                args.drafter,
                num_cpus=resources["CPU"],
                num_gpus=resources.get("GPU", 0.0),
                scheduling_strategy=strategy,
                k=args.k,
                carry=None if args.carry else False,
                context_copy=None if args.context_copy else False,
                seed=args.seed,
            )

        drafter = ResilientDrafter(start_drafter, args.drafter_timeout_s)
        spec = dataclasses.replace(spec, tap_layer_ids=tuple(drafter.cfg.tap_layer_ids))
    window = drafter.window if drafter is not None else 256
    if pg is not None:
        target: TargetGroup = TargetGroup(
            spec,
            args.tp,
            resources["CPU"],
            resources.get("GPU", 0.0),
            window,
            pg=pg,
            first_bundle=1,
        )
    else:
        target = TargetGroup(
            spec, args.tp, resources["CPU"], resources.get("GPU", 0.0), window=window
        )
    k = args.k or (drafter.k if drafter is not None else 15)
    engine = Engine(
        target,
        Tokenizer(args.target),
        drafter,
        EngineConfig(
            k=k,
            max_num_seqs=args.max_num_seqs,
            drafter_name=args.drafter or "",
            adaptive=args.adaptive,
            copy_drafts=args.context_copy,
        ),
    )

    def close() -> None:
        if drafter is not None:
            drafter.shutdown()
        target.shutdown()

    return engine, close, drafter
