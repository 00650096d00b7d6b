"""Rotary position embedding (RoPE) with the checkpoint's scaling.

Supported ``rope_type``: default, linear, llama3, yarn (the ones Llama / Qwen2 / Qwen3
checkpoints ship with). Formulas follow the published definitions, which transformers
implements too, so our logits match theirs.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from target_actor.config import ModelConfig, TargetConfigError


def rope_inv_freq(cfg: ModelConfig) -> tuple[torch.Tensor, float]:
    """Inverse frequencies ``[head_dim // 2]`` (fp32) and the cos/sin attention factor."""
    dim, base = cfg.head_dim, cfg.rope_theta
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling: dict[str, Any] = cfg.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv_freq, 1.0
    if kind == "linear":
        return inv_freq / float(scaling["factor"]), 1.0
    if kind == "llama3":
        return _llama3(inv_freq, scaling), 1.0
    if kind == "yarn":
        return _yarn(cfg, scaling)
    raise TargetConfigError(
        f"unsupported rope_type {kind!r} (supported: default, linear, llama3, yarn)"
    )


def _llama3(inv_freq: torch.Tensor, s: dict[str, Any]) -> torch.Tensor:
    factor, low, high = (
        float(s["factor"]),
        float(s["low_freq_factor"]),
        float(s["high_freq_factor"]),
    )
    old_len = float(s["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn(cfg: ModelConfig, s: dict[str, Any]) -> tuple[torch.Tensor, float]:
    dim, base = cfg.head_dim, cfg.rope_theta
    orig = s.get("original_max_position_embeddings") or cfg.max_position_embeddings
    factor = s.get("factor") or cfg.max_position_embeddings / orig

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attn = s.get("attention_factor")
    if attn is None:
        m, m_all = s.get("mscale"), s.get("mscale_all_dim")
        attn = mscale(factor, m) / mscale(factor, m_all) if (m and m_all) else mscale(factor)
    beta_fast, beta_slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1

    def corr_dim(rot: float) -> float:
        return dim * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(base))

    low, high = corr_dim(beta_fast), corr_dim(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos = base ** (torch.arange(0, dim, 2).float() / dim)
    extrap = 1 - ramp
    inv_freq = (1.0 / (factor * pos)) * (1 - extrap) + (1.0 / pos) * extrap
    return inv_freq, float(attn)


class RotaryTable:
    """Precomputed cos/sin rows, grown on demand; ``lookup(positions)`` -> ``[T, head_dim]``."""

    def __init__(
        self,
        cfg: ModelConfig,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        self.inv_freq, self.attn_factor = rope_inv_freq(cfg)
        self.dtype, self.device = dtype, torch.device(device)
        self.cos = torch.empty(0, cfg.head_dim, dtype=dtype, device=self.device)
        self.sin = torch.empty(0, cfg.head_dim, dtype=dtype, device=self.device)
        self._grow(max(4096, min(cfg.max_position_embeddings, 8192)))

    def _grow(self, n: int) -> None:
        # computed on the host in fp32 (the same bits on every device), then moved once
        t = torch.arange(n, dtype=torch.float32, device="cpu")
        freqs = torch.outer(t, self.inv_freq)  # [n, head_dim // 2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [n, head_dim]
        self.cos = (emb.cos() * self.attn_factor).to(self.device, self.dtype)
        self.sin = (emb.sin() * self.attn_factor).to(self.device, self.dtype)

    def lookup(self, positions: torch.Tensor | list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin rows ``[..., head_dim]`` for ``positions`` (a tensor of any shape, or
        a list: the target's rows, copied to the device once)."""
        if isinstance(positions, list):
            need = max(positions) + 1 if positions else 0
            positions = torch.tensor(positions, dtype=torch.long, device=self.device)
        else:
            need = int(positions.max()) + 1 if positions.numel() else 0
        if need > self.cos.shape[0]:
            self._grow(max(need, 2 * self.cos.shape[0]))
        return self.cos[positions], self.sin[positions]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[T, heads, head_dim]`` by ``cos``/``sin`` ``[T, head_dim]`` (half-split layout)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    rotated = torch.cat((-x2, x1), dim=-1)
    return x * cos.unsqueeze(1) + rotated * sin.unsqueeze(1)
