"""Per-sequence KV cache for one rank's KV heads, accounted in fixed-size blocks.

Each sequence owns one contiguous tensor ``[layers, 2, kv_heads, capacity, head_dim]``
so attention reads its keys as a strided view (no gather per layer, unlike a paged pool
on CPU). Capacity grows in whole blocks of ``block_size`` tokens, by at least a quarter
of the current size, and every reserved block counts against the pool's budget, so a
scheduler can admit by ``free_blocks`` honestly; or exactly to a size the engine's
scheduler granted (``reserve(..., exact=True)``), so the engine's books and the pool's
agree block for block. Roll-back only moves the length.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .errors import LongSparkError


class KVCacheFull(LongSparkError, RuntimeError):
    """The pool has no room for the requested tokens."""


@dataclass
class _SeqKV:
    data: torch.Tensor  # [layers, 2, kv_heads, capacity, head_dim]
    length: int = 0

    @property
    def capacity(self) -> int:
        return self.data.shape[3]


class KVCache:
    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        max_tokens: int,
        block_size: int = 16,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        self.shape = (num_layers, 2, num_kv_heads, head_dim)
        self.block_size = block_size
        self.total_blocks = max(1, max_tokens // block_size)
        self.used_blocks = 0
        self.dtype, self.device = dtype, torch.device(device)
        self.seqs: dict[int, _SeqKV] = {}

    # -- accounting -------------------------------------------------------------
    @property
    def free_blocks(self) -> int:
        return self.total_blocks - self.used_blocks

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def can_fit(self, extra_tokens: int) -> bool:
        return self.blocks_for(extra_tokens) <= self.free_blocks

    @property
    def bytes_per_block(self) -> int:
        layers, two, heads, hd = self.shape
        return layers * two * heads * hd * self.block_size * torch.finfo(self.dtype).bits // 8

    # -- lifecycle ----------------------------------------------------------------
    def length(self, seq_id: int) -> int:
        seq = self.seqs.get(seq_id)
        return 0 if seq is None else seq.length

    def reserve(self, seq_id: int, length: int, exact: bool = False) -> None:
        """Make room for ``length`` tokens of ``seq_id`` (creating it if new): a quarter
        more, for fewer copies, unless ``exact`` or the pool is tight."""
        seq = self.seqs.get(seq_id)
        have = 0 if seq is None else seq.capacity
        if length <= have:
            return
        want = self.blocks_for(length if exact else max(length, have + have // 4))
        want *= self.block_size
        need = self.blocks_for(want) - self.blocks_for(have)
        if need > self.free_blocks:
            want = self.blocks_for(length) * self.block_size  # no headroom when tight
            need = self.blocks_for(want) - self.blocks_for(have)
            if need > self.free_blocks:
                raise KVCacheFull(
                    f"KV cache full: sequence {seq_id} needs {need} more blocks, {self.free_blocks} free"
                )
        layers, two, heads, hd = self.shape
        data = torch.zeros(layers, two, heads, want, hd, dtype=self.dtype, device=self.device)
        if seq is None:
            self.seqs[seq_id] = _SeqKV(data)
        else:
            data[:, :, :, : seq.length] = seq.data[:, :, :, : seq.length]
            seq.data = data
        self.used_blocks += need

    def rollback(self, seq_id: int, length: int) -> None:
        """Forget every row at or after ``length`` (kept capacity stays reserved)."""
        seq = self.seqs[seq_id]
        if length > seq.length:
            raise ValueError(f"cannot roll sequence {seq_id} forward from {seq.length} to {length}")
        seq.length = length

    def fork(self, src: int, dst: int, capacity: int | None = None) -> None:
        """``dst`` starts as a copy of ``src``'s rows (a prompt shared by n choices), in a
        cache of ``capacity`` rows if given."""
        length = self.seqs[src].length
        self.free(dst)
        self.reserve(dst, max(length, capacity or 0), exact=True)
        self.seqs[dst].data[:, :, :, :length] = self.seqs[src].data[:, :, :, :length]
        self.seqs[dst].length = length

    def free(self, seq_id: int) -> None:
        seq = self.seqs.pop(seq_id, None)
        if seq is not None:
            self.used_blocks -= self.blocks_for(seq.capacity)

    # -- the hot path -------------------------------------------------------------
    def write(self, layer: int, seq_id: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store ``k``/``v`` ``[n, kv_heads, head_dim]`` at positions ``start..start+n``."""
        seq = self.seqs[seq_id]
        n = k.shape[0]
        seq.data[layer, 0, :, start : start + n] = k.transpose(0, 1)
        seq.data[layer, 1, :, start : start + n] = v.transpose(0, 1)

    def view(
        self, layer: int, seq_id: int, length: int, dtype: torch.dtype | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V ``[kv_heads, length, head_dim]``: views into the cache, or copies in
        ``dtype`` when the cache holds another (a bf16 cache read by fp32 queries)."""
        data = self.seqs[seq_id].data
        k, v = data[layer, 0, :, :length], data[layer, 1, :, :length]
        if dtype is not None and dtype != data.dtype:
            return k.to(dtype), v.to(dtype)
        return k, v

    def set_length(self, seq_id: int, length: int) -> None:
        self.seqs[seq_id].length = length
