"""The full-prefix baseline drafter (DFlash-style), for the scaling contrast. Not the default.

It reads the prefix the way DFlash does: the fused tapped hidden states of EVERY committed
position, projected by each drafter layer's K/V into a per-sequence cache that grows with
``t`` (plus the carry rows). Same network, same block pass, same Markov sampling and the
same ``prefill`` / ``propose`` / ``free`` as :class:`Drafter`; only the context differs,
so its drafting time and state grow with the context while LongSpark's stay flat.

It needs the per-position hidden states, which ``messages.py`` does not carry, so its
prefill views and round updates are the two small messages below; like the LongSpark
drafter's, they move to the drafter's device on arrival.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from drafter_actor.drafter import Drafter
from drafter_actor.network import DrafterNetwork, LayerContext
from drafter_actor.state import DrafterStateError

PREFILL_CHUNK = 4096


@dataclass
class FullPrefixViews:
    """A new sequence for the baseline: tapped hidden states at every prompt position."""

    seq_id: int
    length: int  # t
    hidden: torch.Tensor  # [t, L, d]: positions 0..t-1
    seed: int | None = None


@dataclass
class FullPrefixUpdate:
    """One round's result for the baseline (the ``RoundUpdate`` analogue)."""

    seq_id: int
    length: int  # committed rows after the round: t + m + 1
    committed: torch.Tensor  # [m+1, L, d]: tapped hidden states at t..t+m
    rejected: torch.Tensor  # [k-m, L, d]: tapped hidden states at t+m+1..t+k


@dataclass
class FullPrefixState:
    """A cache of the drafter's K/V of every committed position (grows with ``t``)."""

    seq_id: int
    length: int
    k_cache: torch.Tensor  # [L, H_kv, cap, hd]: rows 0..length-1, then the carry rows
    v_cache: torch.Tensor  # [L, H_kv, cap, hd]
    carry: torch.Tensor  # [k_max, L, d]: rejected states at length..length+carry_len-1
    carry_len: int
    generator: torch.Generator
    boundary: torch.Tensor | None = None  # [L, d]: the last committed row's tapped states

    def reserve(self, rows: int) -> None:
        """Grow the caches (doubling) to hold at least ``rows`` rows."""
        cap = self.k_cache.shape[2]
        if rows <= cap:
            return
        new = max(rows, 2 * cap)
        grow = (*self.k_cache.shape[:2], new - cap, self.k_cache.shape[3])
        self.k_cache = torch.cat([self.k_cache, self.k_cache.new_zeros(grow)], 2)
        self.v_cache = torch.cat([self.v_cache, self.v_cache.new_zeros(grow)], 2)

    def append(self, net: DrafterNetwork, hidden: torch.Tensor, chunk: int = PREFILL_CHUNK) -> None:
        """Project hidden states ``[n, L, d]`` at positions ``length..`` into the caches."""
        n, k_max = hidden.shape[0], self.carry.shape[0]
        self.reserve(self.length + n + k_max)
        for s in range(0, n, chunk):
            rows = hidden[s : s + chunk]
            a, b = self.length + s, self.length + s + rows.shape[0]  # positions a..b-1
            pos = torch.arange(a, b, device=hidden.device)
            kv = net.project_context(net.fuse(rows).unsqueeze(0), pos.unsqueeze(0), b - 1)
            for i, (k, v) in enumerate(kv):
                self.k_cache[i, :, a:b] = k[0]
                self.v_cache[i, :, a:b] = v[0]
        self.length += n
        self.boundary = hidden[-1].clone()

    def state_bytes(self) -> int:
        """Bytes of the rows in use (committed + carry capacity), as a paged cache would hold."""
        rows = self.length + self.carry.shape[0]
        row_bytes = 2 * self.k_cache[:, :, 0].numel() * self.k_cache.element_size()
        return rows * row_bytes + self.carry.numel() * self.carry.element_size()


def _pad_rows(views: list[torch.Tensor]) -> torch.Tensor:
    """``[H_kv, T_i, hd]`` each -> ``[n, H_kv, max T_i, hd]`` (no copy for one sequence)."""
    if len(views) == 1:
        return views[0].unsqueeze(0)
    out = views[0].new_zeros(
        len(views), views[0].shape[0], max(v.shape[1] for v in views), views[0].shape[2]
    )
    for i, v in enumerate(views):
        out[i, :, : v.shape[1]] = v
    return out


class FullPrefixDrafter(Drafter):
    """DFlash-style drafter over the whole prefix, with :class:`Drafter`'s interface."""

    copies_context = False  # the network alone: the baseline the views are compared with

    @classmethod
    def sharing(cls, drafter: Drafter, seed: int = 0) -> FullPrefixDrafter:
        """A baseline with the same network (weights) as ``drafter``."""
        return cls(drafter.net, seed)

    @torch.no_grad()
    def prefill(self, views: list[FullPrefixViews]) -> None:  # type: ignore[override]
        t, L, dtype, dev = self.cfg.target, self.cfg.num_layers, self.dtype, self.device
        for v in views:
            if v.length < 1 or v.hidden.shape != (v.length, L, t.hidden_size):
                raise DrafterStateError(f"baseline views: hidden {tuple(v.hidden.shape)}")
            empty = torch.zeros(L, t.num_kv_heads, 0, t.head_dim, dtype=dtype, device=dev)
            state = FullPrefixState(
                seq_id=v.seq_id,
                length=0,
                k_cache=empty,
                v_cache=empty.clone(),
                carry=torch.zeros(self.cfg.block_size, L, t.hidden_size, dtype=dtype, device=dev),
                carry_len=0,
                generator=self._generator(v.seed),
            )
            state.append(self.net, v.hidden.to(dev, dtype))
            self.states[v.seq_id] = state  # type: ignore[assignment]

    def _apply(self, state: FullPrefixState, u: FullPrefixUpdate) -> None:  # type: ignore[override]
        if not isinstance(u, FullPrefixUpdate) or u.length != state.length + u.committed.shape[0]:
            raise DrafterStateError(f"sequence {state.seq_id}: update does not follow its state")
        state.append(self.net, u.committed.to(self.device, state.carry.dtype))
        state.carry_len = u.rejected.shape[0] if self.cfg.carry else 0
        state.carry[: state.carry_len] = u.rejected[: state.carry_len].to(self.device)

    def _contexts(self, states: list[FullPrefixState]) -> list[LayerContext]:  # type: ignore[override]
        """Every prefix row, then the carry rows written right after them in the cache."""
        net, k_max, dev = self.net, self.cfg.block_size if self.cfg.carry else 0, self.device
        lengths = [s.length for s in states]
        if k_max:
            feats = net.carry_features(torch.stack([s.carry for s in states]))  # [n, k_max, d]
            length = torch.tensor(lengths, device=dev)  # [n]
            pos = length.unsqueeze(1) + torch.arange(k_max, device=dev)
            top = max(lengths) + k_max - 1
            for i, (k, v) in enumerate(net.project_context(feats, pos, top)):
                for j, s in enumerate(states):
                    s.k_cache[i, :, s.length : s.length + k_max] = k[j]
                    s.v_cache[i, :, s.length : s.length + k_max] = v[j]
        rows = [s.length + k_max for s in states]
        present = torch.tensor([s.length + s.carry_len for s in states], device=dev)  # [n]
        mask = torch.arange(max(rows), device=dev).unsqueeze(0) < present.unsqueeze(1)  # [n, C]
        return [
            LayerContext(
                k=_pad_rows([s.k_cache[i, :, :n] for s, n in zip(states, rows, strict=True)]),
                v=_pad_rows([s.v_cache[i, :, :n] for s, n in zip(states, rows, strict=True)]),
                mask=mask,
            )
            for i in range(self.cfg.num_layers)
        ]
