"""The drafter handle: what the engine calls, in-process (``LocalDrafter``), over Ray
(``RayDrafter``) or behind the fault-tolerant wrapper
(``services.engine.resilient_drafter.ResilientDrafter``), with one return contract.

``propose`` returns the ``Proposal`` itself, or None when the drafter could not draft this
round (the engine then verifies zero drafts: a plain, still exact, step). ``views`` and
``updates`` are what the target handle returned.
``drafting(seq_id)`` is False for a sequence whose drafter state was lost.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch

from target_actor.messages import DraftRequest, Proposal

from .config import DrafterConfig


@runtime_checkable
class DrafterHandle(Protocol):
    cfg: DrafterConfig
    k: int  # the default block length
    window: int  # W: recent K/V rows the target ships

    def summary_queries(self) -> torch.Tensor: ...

    def prefill(self, views: Any) -> None: ...

    def propose(
        self, requests: list[DraftRequest], k: int, updates: Any = None
    ) -> Proposal | None: ...

    def update(self, updates: Any) -> None: ...

    def free(self, seq_ids: list[int]) -> None: ...

    def drafting(self, seq_id: int) -> bool: ...

    def num_states(self) -> int | None: ...

    def shutdown(self) -> None: ...
