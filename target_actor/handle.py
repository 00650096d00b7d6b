"""The target handle: what the engine calls, in-process (``LocalTarget``) or over Ray
(``TargetGroup``), with one return contract.

``prefill`` and ``verify`` return the small ``StepResult`` the engine reads, and the
drafter's messages (``PrefillViews`` / ``RoundUpdate`` lists, None when the batch did
not ask for them), which go to the drafter handle unopened. ``preempt`` drops sequences'
KV caches and keeps their sampling state; ``resume`` recomputes the caches (and, if
asked, the drafter's views) without sampling.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch

from .batch import ForwardBatch, ForwardOutput, PrefillBatch, ResumeBatch, StepResult, VerifyBatch
from .config import ModelConfig
from .messages import Proposal


@runtime_checkable
class TargetHandle(Protocol):
    cfg: ModelConfig

    def prefill(self, batch: PrefillBatch) -> tuple[StepResult, Any]: ...

    def verify(self, batch: VerifyBatch, proposal: Proposal | None) -> tuple[StepResult, Any]: ...

    def preempt(self, seq_ids: list[int]) -> None: ...

    def resume(self, batch: ResumeBatch) -> Any: ...

    def forward(self, batch: ForwardBatch) -> ForwardOutput: ...

    def set_summary_queries(self, g: torch.Tensor | None) -> None: ...

    def free(self, seq_ids: list[int]) -> None: ...

    def kv_stats(self) -> dict[str, int]: ...

    def kv_capacity_tokens(self) -> int: ...  # the pool: total blocks x block size

    def shutdown(self) -> None: ...
