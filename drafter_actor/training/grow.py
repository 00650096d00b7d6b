"""Growing a trained drafter without changing what it drafts (``train drafter --mlp-width``).

Two widths can grow from an ``init_from`` drafter:

- each layer's MLP (``mlp_width``): new gate and up rows start random, the matching new
  columns of the down projection start at zero, so every layer's output is unchanged;
- the Markov head's rank (``markov_rank``): new columns of ``w1`` start random, the new
  rows of ``w2`` at zero, so the transition bias ``w1[x] @ w2`` is unchanged.

The grown drafter therefore starts exactly where its parent stopped (a unit test checks
the logits), and training can use the new units from the first step: the zero half of
each pair gets a gradient through the random half.
"""

from __future__ import annotations

import dataclasses

import torch

from drafter_actor.config import DrafterConfig
from drafter_actor.training.config import TrainError


def grow_weights(
    cfg: DrafterConfig,
    weights: dict[str, torch.Tensor],
    mlp_width: int,
    markov_rank: int,
    seed: int,
    std: float,
) -> tuple[DrafterConfig, dict[str, torch.Tensor]]:
    """``(cfg, weights)`` widened to ``mlp_width`` / ``markov_rank`` (0 keeps a width)."""
    mlp_width = mlp_width or cfg.mlp_width
    markov_rank = markov_rank or cfg.markov_rank
    for name, old, new in (
        ("mlp_width", cfg.mlp_width, mlp_width),
        ("markov_rank", cfg.markov_rank, markov_rank),
    ):
        if new < old:
            raise TrainError(f"{name} {new} is below the init_from drafter's {old}: cannot shrink")
    gen = torch.Generator().manual_seed(seed)
    out = dict(weights)

    def random(rows: int, cols: int, like: torch.Tensor) -> torch.Tensor:
        return (torch.randn(rows, cols, generator=gen) * std).to(like.dtype)

    if mlp_width > cfg.mlp_width:
        extra = mlp_width - cfg.mlp_width
        for i in range(cfg.num_layers):
            gu, down = weights[f"layers.{i}.gate_up.weight"], weights[f"layers.{i}.down.weight"]
            gate, up = gu.chunk(2, 0)  # [W, d] each: forward splits the output the same way
            d = gu.shape[1]
            out[f"layers.{i}.gate_up.weight"] = torch.cat(
                [gate, random(extra, d, gu), up, random(extra, d, gu)], 0
            )
            out[f"layers.{i}.down.weight"] = torch.cat([down, down.new_zeros(d, extra)], 1)
    if markov_rank > cfg.markov_rank:
        extra = markov_rank - cfg.markov_rank
        w1, w2 = weights["markov.w1"], weights["markov.w2"]  # [V_d + 1, r], [r, V_d]
        out["markov.w1"] = torch.cat([w1, random(w1.shape[0], extra, w1)], 1)
        out["markov.w2"] = torch.cat([w2, w2.new_zeros(extra, w2.shape[1])], 0)
    return dataclasses.replace(cfg, mlp_width=mlp_width, markov_rank=markov_rank), out
