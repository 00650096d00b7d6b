"""One sequence's drafter state: its boundary, window, summary and carry views.

Every tensor here has a size fixed by the config, never by the context length ``t``:
``state_bytes()`` is the same at 1K and at 32K tokens. The round update is ``O(k)``:
append the committed K/V rows to the window ring, merge them into the summary, replace
the boundary, replace the carry rows with the rejected positions' hidden states.

The views live on the drafter's device (copied there from the messages, wherever those
come from); only the token history stays in host memory, where context copy searches it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from drafter_actor.config import DrafterConfig
from target_actor.errors import LongSparkError
from target_actor.messages import HISTORY_TOKENS, PrefillViews, RoundUpdate
from target_actor.summary import update_summary


class DrafterStateError(LongSparkError, ValueError):
    """A request does not fit the drafter's state (unknown sequence, wrong position)."""


def _bytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


@dataclass
class SequenceState:
    """The views of one sequence with ``length`` committed tokens (positions 0..length-1)."""

    seq_id: int
    length: int
    # the layers' context buffers [L, H_kv, W + extra, hd]: the window ring in the first W
    # rows (position p in slot p % W, post-RoPE), then room for the round's own context
    # rows (boundary, carry), written in place so a block pass reads the buffer as it is
    context_k: torch.Tensor
    context_v: torch.Tensor
    ring_rows: int  # W
    summary_m: torch.Tensor  # [L, H, R, hd] fp32
    summary_lam: torch.Tensor  # [L, H, R] fp32
    boundary: torch.Tensor  # [L, d]: tapped hidden states at position length-1
    carry: torch.Tensor  # [k_max, L, d]: rejected states at length..length+carry_len-1
    carry_len: int
    generator: torch.Generator  # the sequence's own sampler, on the drafter's device
    # the last ``history_len`` committed ids, right-aligned in a fixed buffer (context
    # copy), in host memory: ``find_copy`` scans it into Python lists every round
    history: torch.Tensor  # [HISTORY_TOKENS] int64
    history_len: int = 0

    @classmethod
    def from_prefill(
        cls,
        views: PrefillViews,
        cfg: DrafterConfig,
        generator: torch.Generator,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> SequenceState:
        """A state on ``device`` from ``views`` on any device: each view is copied once into
        the state's own tensors there, its token ids into the host history."""
        t, L = cfg.target, cfg.num_layers
        w = views.window_k.shape[1]
        expect = {
            "window_k": (L, w, t.num_kv_heads, t.head_dim),
            "window_v": (L, w, t.num_kv_heads, t.head_dim),
            "summary_m": (L, t.num_heads, cfg.summary_slots, t.head_dim),
            "summary_lam": (L, t.num_heads, cfg.summary_slots),
            "boundary": (L, t.hidden_size),
        }
        for name, shape in expect.items():
            got = tuple(getattr(views, name).shape)
            if got != shape:
                raise DrafterStateError(f"prefill views {name} has shape {got}, expected {shape}")
        if not 1 <= views.length or w != min(cfg.window, views.length):
            raise DrafterStateError(
                f"prefill views of length {views.length} carry {w} window rows, "
                f"expected {min(cfg.window, views.length)}"
            )
        extra = 1 + (cfg.block_size if cfg.carry else 0)
        rows = cfg.window + extra
        buf = torch.zeros(L, t.num_kv_heads, rows, t.head_dim, dtype=dtype, device=device)
        state = cls(
            seq_id=views.seq_id,
            length=views.length - w,
            context_k=buf,
            context_v=buf.clone(),
            ring_rows=cfg.window,
            summary_m=views.summary_m.to(device, torch.float32, copy=True),
            summary_lam=views.summary_lam.to(device, torch.float32, copy=True),
            boundary=views.boundary.to(device, dtype, copy=True),
            carry=torch.zeros(cfg.block_size, L, t.hidden_size, dtype=dtype, device=device),
            carry_len=0,
            generator=generator,
            history=torch.zeros(HISTORY_TOKENS, dtype=torch.long, device="cpu"),  # host: above
        )
        state._write_window(views.window_k, views.window_v)
        if views.tokens is not None:
            state._append_history(views.tokens)
        return state

    @property
    def device(self) -> torch.device:
        return self.context_k.device

    @property
    def dtype(self) -> torch.dtype:
        return self.context_k.dtype

    @property
    def window_k(self) -> torch.Tensor:
        """``[L, H_kv, W, hd]``: the ring part of ``context_k``."""
        return self.context_k[:, :, : self.ring_rows]

    @property
    def window_v(self) -> torch.Tensor:
        return self.context_v[:, :, : self.ring_rows]

    def _append_history(self, tokens: torch.Tensor | None) -> None:
        """Append committed ids; without them the history restarts empty (no copy)."""
        if tokens is None:
            self.history_len = 0
            return
        tokens = tokens[-HISTORY_TOKENS:].to("cpu", torch.long)  # a no-op for host ids
        n = tokens.shape[0]
        self.history = torch.cat([self.history[n:], tokens])
        self.history_len = min(HISTORY_TOKENS, self.history_len + n)

    def recent_tokens(self) -> torch.Tensor:
        """The committed ids the history holds (the last ``history_len``), oldest first."""
        return self.history[HISTORY_TOKENS - self.history_len :]

    def _write_window(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Append rows ``[L, n, H_kv, hd]`` at positions ``length..length+n-1`` to the ring."""
        W, n = self.window_k.shape[2], k.shape[1]
        start = self.length + max(0, n - W)
        k, v = k[:, -W:], v[:, -W:]  # rows older than the last W would be overwritten anyway
        slots = torch.arange(start, start + k.shape[1], device=self.device) % W
        self.window_k.index_copy_(2, slots, k.transpose(1, 2).to(self.device, self.dtype))
        self.window_v.index_copy_(2, slots, v.transpose(1, 2).to(self.device, self.dtype))
        self.length += n

    def apply(self, update: RoundUpdate, g: torch.Tensor, scale: float, carry: bool) -> None:
        """Apply one verification round's result (committed rows, boundary, rejected);
        ``update``'s tensors on this state's device (the drafter moves them on arrival)."""
        n = update.committed_k.shape[1]
        if update.seq_id != self.seq_id or update.length != self.length + n:
            raise DrafterStateError(
                f"sequence {self.seq_id}: update for {update.seq_id} with {n} committed rows "
                f"to length {update.length} does not follow length {self.length}"
            )
        if update.rejected.shape[0] > self.carry.shape[0]:
            raise DrafterStateError(
                f"{update.rejected.shape[0]} rejected rows exceed block_size {self.carry.shape[0]}"
            )
        self.summary_m, self.summary_lam = update_summary(
            self.summary_m, self.summary_lam, g, update.committed_k, update.committed_v, scale
        )
        self._write_window(update.committed_k, update.committed_v)
        self._append_history(update.tokens)
        self.boundary.copy_(update.boundary)
        self.carry_len = update.rejected.shape[0] if carry else 0
        self.carry[: self.carry_len] = update.rejected[: self.carry_len]

    def window_mask(self) -> torch.Tensor:
        """``[W]`` bool: which ring slots hold a row."""
        W = self.window_k.shape[2]
        return torch.arange(W, device=self.device) < min(self.length, W)

    def carry_mask(self) -> torch.Tensor:
        """``[k_max]`` bool: which carry rows are present."""
        return torch.arange(self.carry.shape[0], device=self.device) < self.carry_len

    def carry_positions(self) -> torch.Tensor:
        """Absolute positions ``[carry_len]`` of the carry rows (the rejected positions)."""
        return torch.arange(self.length, self.length + self.carry_len, device=self.device)

    def state_bytes(self) -> int:
        """Bytes of this state's tensors (fixed in the context length)."""
        return _bytes(
            self.context_k,
            self.context_v,
            self.summary_m,
            self.summary_lam,
            self.boundary,
            self.carry,
            self.history,
        )

    @staticmethod
    def expected_bytes(cfg: DrafterConfig, dtype_bytes: int = 4) -> int:
        """The closed form of ``state_bytes()``: window (and the round's context rows) +
        summary (fp32) + boundary + carry + the token history (int64)."""
        t, L = cfg.target, cfg.num_layers
        rows = cfg.window + 1 + (cfg.block_size if cfg.carry else 0)
        window = 2 * L * rows * t.num_kv_heads * t.head_dim * dtype_bytes
        summary = L * t.num_heads * cfg.summary_slots * (t.head_dim + 1) * 4
        hidden = (1 + cfg.block_size) * L * t.hidden_size * dtype_bytes
        return window + summary + hidden + HISTORY_TOKENS * 8
