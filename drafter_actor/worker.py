"""The drafter as a Ray actor, and the two handles the engine drives it through.

``DrafterWorker`` is a plain class holding one :class:`Drafter` (or the full-prefix
baseline) and every sequence's views; ``RayDrafter`` runs it as a Ray actor,
``LocalDrafter`` in this process, with the same interface (mirroring ``TargetGroup`` /
``LocalTarget``). The engine makes one call per round with the whole batch, carrying the
views and round updates the target returned.

The drafter runs on ``DrafterSpec.device`` (``cpu``, ``cuda``, ``cuda:1``); its answers
(proposals, summary queries) come back in host memory whatever that device, which is
what Ray serialises.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from drafter_actor.baseline import FullPrefixDrafter
from drafter_actor.config import DrafterConfig, DrafterConfigError
from drafter_actor.drafter import Drafter
from target_actor.channel import dumps, loads
from target_actor.config import ModelConfig
from target_actor.messages import DraftRequest, PrefillViews, Proposal, RoundUpdate
from target_actor.priority import raise_thread_priority


@dataclass(frozen=True)
class DrafterSpec:
    """How to build the drafter actor."""

    target_path: str
    drafter_path: str | None = None  # None or "random": a random drafter (still lossless)
    k: int | None = None  # block size; default: the checkpoint's (random: 15)
    seed: int = 0
    carry: bool | None = None  # override the checkpoint's carryover flag (ablations)
    context_copy: bool | None = None  # override the checkpoint's context-copy flag
    baseline: bool = False  # the full-prefix (DFlash-style) drafter instead of LongSpark
    num_threads: int | None = None
    # float32 | bfloat16 | int8 (Q8_0 GEMM weights, VNNI) | auto: int8 where the host's
    # VNNI kernels take every GEMM, else bf16 on a GPU or where this CPU's bf16 GEMMs win
    dtype: str = "auto"
    device: str = "cpu"  # cpu | cuda | cuda:N (in a Ray actor, "cuda" is its assigned GPU)
    overrides: dict[str, Any] | None = None  # DrafterConfig fields for a random drafter
    init_std: float = 0.02  # a random drafter's weight scale


def drafter_dtype(name: str, cfg: DrafterConfig, device: str | torch.device = "cpu") -> torch.dtype:
    """``name`` as a dtype. ``auto``: on a CUDA device bfloat16 (no timing: the probe times
    CPU GEMMs); on the host the dense form the target's timing picks on this machine
    (cached per machine) for the drafter's MLP shape; fp32 on any other device."""
    from target_actor.weight_choice import choose

    kind = torch.device(device).type
    if name == "auto" and kind != "cpu":
        return torch.bfloat16 if kind == "cuda" else torch.float32
    try:
        return choose(name, "none", (2 * cfg.mlp_width, cfg.target.hidden_size)).dtype
    except ValueError as exc:
        raise DrafterConfigError(str(exc)) from None


def drafter_device(name: str) -> torch.device:
    """``name`` as a device, a GPU with its index. ``cuda`` is the current GPU, made so: in
    a Ray actor, the one Ray assigned it (its ``CUDA_VISIBLE_DEVICES`` shows it alone, as
    ``cuda:0``). ``cuda:N`` leaves the process's current GPU alone: in-process, the target
    beside the drafter may rely on it."""
    try:
        device = torch.device(name)
    except RuntimeError as exc:
        raise DrafterConfigError(f"unknown device {name!r}: {exc}") from None
    if device.type != "cuda":
        return device
    if not torch.cuda.is_available():
        raise DrafterConfigError(
            f"device {name!r}, but CUDA is not available here "
            "(no GPU, or none assigned to this actor: give it num_gpus)"
        )
    if device.index is not None:
        if device.index >= torch.cuda.device_count():
            raise DrafterConfigError(f"device {name!r}: {torch.cuda.device_count()} GPU(s) here")
        return device
    index = torch.cuda.current_device()
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


class DrafterWorker:
    """The drafter actor. Wrapped with ``ray.remote`` by ``RayDrafter``."""

    def __init__(self, spec: DrafterSpec) -> None:
        raise_thread_priority()  # the actor's calls run on this thread (target_actor.priority)
        if spec.num_threads:
            torch.set_num_threads(spec.num_threads)
        self.spec = spec
        device = drafter_device(spec.device)
        cls = FullPrefixDrafter if spec.baseline else Drafter
        if spec.drafter_path and spec.drafter_path != "random":
            self.drafter = cls.from_pretrained(
                spec.drafter_path,
                spec.target_path,
                carry=spec.carry,
                seed=spec.seed,
                context_copy=spec.context_copy,
                device=device,
            )
        else:
            overrides: dict[str, Any] = {"block_size": spec.k or 15, **(spec.overrides or {})}
            if spec.carry is not None:
                overrides["carry"] = spec.carry
            if spec.context_copy is not None:
                overrides["context_copy"] = spec.context_copy
            target = ModelConfig.from_pretrained(spec.target_path)
            config = DrafterConfig.for_target(target, **overrides)
            self.drafter = cls.random(
                spec.target_path, config, seed=spec.seed, init_std=spec.init_std, device=device
            )
        int8 = spec.dtype == "int8" or (spec.dtype == "auto" and self.drafter.net.int8_gemms_fit())
        if int8:  # the smallest GEMM weights, through the fastest host kernel
            self.drafter.quantize_int8()
        else:
            self.drafter.cast(drafter_dtype(spec.dtype, self.drafter.cfg, device))
        if spec.k is not None and not 1 <= spec.k <= self.drafter.cfg.block_size:
            raise DrafterConfigError(
                f"k={spec.k} outside 1..{self.drafter.cfg.block_size} (the drafter's block size)"
            )

    def config(self) -> DrafterConfig:
        return self.drafter.cfg

    def call_packed(self, method: str, payload: bytes) -> bytes:
        """``method(*args)`` with the arguments and the result each packed in one buffer
        (``target_actor.channel``'s pickling: a tensor is its raw bytes) rather than Ray's
        per-tensor pickling, which moved a round's updates at C=8 (40 small tensors) in
        ~9.7 ms against ~3.2 packed."""
        return dumps(getattr(self, method)(*loads(payload)))

    def summary_queries(self) -> torch.Tensor:
        return self.drafter.summary_queries().to("cpu")  # itself on the host

    def prefill(self, views: list[PrefillViews]) -> None:
        self.drafter.prefill(views)

    def propose(
        self, requests: list[DraftRequest], k: int, updates: list[RoundUpdate] | None = None
    ) -> Proposal:
        """The drafter's proposal, in host memory (itself when the drafter is on the host)."""
        return self.drafter.propose(requests, k, updates).to("cpu")

    def update(self, updates: list[RoundUpdate]) -> None:
        """Take a round's updates without drafting (the engine ran a plain round)."""
        self.drafter.apply_updates(updates)

    def free(self, seq_ids: list[int]) -> None:
        self.drafter.free(seq_ids)

    def num_states(self) -> int:
        return self.drafter.num_states()

    def call(self, method: str, *args: Any) -> Any:
        """Run one method by name (mirrors ``TargetWorker.call``)."""
        return getattr(self, method)(*args)


class LocalDrafter:
    """The drafter in this process, with ``RayDrafter``'s interface."""

    def __init__(self, target_path: str, drafter_path: str | None = None, **spec: Any) -> None:
        self.worker = DrafterWorker(DrafterSpec(target_path, drafter_path, **spec))
        self.cfg = self.worker.config()
        self.k = self.worker.spec.k or self.cfg.block_size
        self.window = self.cfg.window

    def summary_queries(self) -> torch.Tensor:
        return self.worker.summary_queries()

    def prefill(self, views: list[PrefillViews]) -> None:
        self.worker.prefill(views)

    def propose(
        self, requests: list[DraftRequest], k: int, updates: list[RoundUpdate] | None = None
    ) -> Proposal:
        return self.worker.propose(requests, k, updates)

    def update(self, updates: list[RoundUpdate]) -> None:
        self.worker.update(updates)

    def free(self, seq_ids: list[int]) -> None:
        self.worker.free(seq_ids)

    def num_states(self) -> int:
        return self.worker.num_states()

    def drafting(self, seq_id: int) -> bool:
        return True

    def shutdown(self) -> None:
        pass


class RayDrafter:
    """The drafter as one Ray actor (``{"CPU": 1}`` by default; with ``device="cuda"``,
    ``num_gpus`` > 0, a fraction to share a GPU).

    Every call waits for its result except ``free`` (fire and forget: the actor runs calls
    in order); ``prefill`` waits so that a bad view fails at admission rather than at the
    next round. ``services.engine.resilient_drafter`` adds time-outs and restarts around
    the same actor.

    A plain round's updates wait here and go with the next ``propose`` (or, past
    ``FLUSH_AT`` of them, in one ``update`` call): the drafter then works while the target
    waits for its proposal, never beside a forward pass. On a host with as many cores as
    the target has threads, a drafter running beside the target's forward stalls each of
    its OpenMP barriers.

    The actor is made with Ray's task events off: each call would otherwise leave ~3 KB
    in the GCS (for the dashboard's task list), and a round makes one or two calls.
    """

    FLUSH_AT = 256  # round updates held at most before they go on their own

    def __init__(
        self,
        target_path: str,
        drafter_path: str | None = None,
        num_cpus: float = 1.0,
        num_gpus: float = 0.0,
        scheduling_strategy: Any = None,
        **spec: Any,
    ) -> None:
        if str(spec.get("device", "cpu")).startswith("cuda") and num_gpus <= 0:
            # Ray hides every GPU from an actor that asked for none
            raise DrafterConfigError(f"drafter device {spec['device']!r} needs num_gpus > 0")
        import ray

        self._ray = ray
        threads = max(1, int(num_cpus))
        spec.setdefault("num_threads", threads)
        actor_cls = ray.remote(DrafterWorker)
        self.actor = actor_cls.options(
            num_cpus=num_cpus,
            num_gpus=num_gpus,
            scheduling_strategy=scheduling_strategy,
            runtime_env={"env_vars": {"OMP_NUM_THREADS": str(threads)}},
            enable_task_events=False,  # Ray's task events grow the GCS per call
        ).remote(DrafterSpec(target_path, drafter_path, **spec))
        self.cfg: DrafterConfig = ray.get(self.actor.config.remote())
        self.k = spec.get("k") or self.cfg.block_size
        self.window = self.cfg.window
        self.pending: list[RoundUpdate] = []

    def remote(self, method: str, *args: Any) -> Any:
        """Start ``method(*args)`` on the actor, its tensors packed (``call_packed``); the
        result comes back through ``unpack(ray.get(ref))``."""
        return self.actor.call_packed.remote(method, dumps(args))

    @staticmethod
    def unpack(payload: bytes) -> Any:
        return loads(payload)

    def _call(self, method: str, *args: Any) -> Any:
        return self.unpack(self._ray.get(self.remote(method, *args)))

    def summary_queries(self) -> torch.Tensor:
        return self._call("summary_queries")

    def prefill(self, views: list[PrefillViews]) -> None:
        self.drop_pending([v.seq_id for v in views])
        self._call("prefill", views)

    def propose(
        self, requests: list[DraftRequest], k: int, updates: list[RoundUpdate] | None = None
    ) -> Proposal:
        return self._call("propose", requests, k, self.take_pending(updates))

    def update(self, updates: list[RoundUpdate]) -> None:
        """Hold a plain round's updates for the next call (see the class docstring)."""
        self.pending.extend(updates)
        if len(self.pending) >= self.FLUSH_AT:
            self.remote("update", self.take_pending())  # fire and forget: actor order

    def take_pending(self, updates: list[RoundUpdate] | None = None) -> list[RoundUpdate]:
        """The held updates, then ``updates``, in round order; the buffer empties."""
        out, self.pending = self.pending, []
        return out + list(updates or [])

    def drop_pending(self, seq_ids: list[int]) -> None:
        """Forget held updates of sequences that end or restart (prefill makes them anew)."""
        ids = set(seq_ids)
        if self.pending and ids:
            self.pending = [u for u in self.pending if u.seq_id not in ids]

    def free(self, seq_ids: list[int]) -> None:
        self.drop_pending(seq_ids)
        self.actor.free.remote(seq_ids)

    def num_states(self) -> int:
        return self._ray.get(self.actor.num_states.remote())

    def drafting(self, seq_id: int) -> bool:
        return True

    def shutdown(self) -> None:
        self._ray.kill(self.actor)
