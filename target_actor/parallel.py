"""Tensor parallelism for the target: rank bookkeeping and the two collectives it needs.

Megatron-style split: QKV and gate/up are column-parallel (each rank owns a slice of
heads / MLP channels), o_proj and down_proj are row-parallel (partial sums, all-reduced),
the embedding and LM head are vocab-parallel (masked lookup + all-reduce; local logits +
all-gather). The model code calls ``tp.all_reduce`` / ``tp.all_gather_last`` and never
looks at ``torch.distributed`` itself; at TP=1 both are no-ops.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TPContext:
    """This process's place in a tensor-parallel group."""

    rank: int = 0
    world: int = 1

    @property
    def enabled(self) -> bool:
        return self.world > 1

    def shard(self, n: int) -> tuple[int, int]:
        """Start and size of this rank's slice of ``n`` (``n`` divisible by ``world``)."""
        size = n // self.world
        return self.rank * size, size

    def vocab_shard(self, vocab: int) -> tuple[int, int]:
        """Vocab slice; the last rank's may be short (padding is added at gather time)."""
        per = -(-vocab // self.world)
        start = min(self.rank * per, vocab)
        return start, max(0, min(per, vocab - start))

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.enabled:
            dist.all_reduce(x)
        return x

    def all_gather_last(self, x: torch.Tensor, full: int) -> torch.Tensor:
        """Concatenate every rank's ``x`` along the last dim, trimmed to ``full`` columns.

        Slices may be uneven (vocab), so each is padded to the largest first.
        """
        if not self.enabled:
            return x
        per = -(-full // self.world)
        if x.shape[-1] < per:
            x = torch.nn.functional.pad(x, (0, per - x.shape[-1]))
        parts = [torch.empty_like(x) for _ in range(self.world)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=-1)[..., :full]


def init_distributed(
    rank: int, world: int, master_addr: str, master_port: int, device_type: str = "cpu"
) -> TPContext:
    """Join the process group: ``nccl`` for ranks on CUDA, ``gloo`` on CPU."""
    if world == 1:
        return TPContext()
    backend = "nccl" if device_type == "cuda" else "gloo"
    if master_addr.startswith("127."):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # single-node group on loopback
    dist.init_process_group(
        backend,
        init_method=f"tcp://{master_addr}:{master_port}",
        rank=rank,
        world_size=world,
    )
    return TPContext(rank=rank, world=world)
