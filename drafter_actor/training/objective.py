"""The block loss: slot-weighted cross-entropy of the base logits and of the Markov-corrected ones.

Slot ``i`` (1-based) is weighted ``w_i = exp(-(i-1)/γ)``: a later slot only counts if every
earlier one was accepted. The Markov term is teacher-forced (DSpark): slot ``i``'s
correction is conditioned on the true token before it (the anchor for slot 1), and the CE
is taken on ``base + correction``, the distribution drafting samples from. Labels outside
the draft vocabulary are ignored (the proposal never puts mass there, so acceptance there
is zero whatever the drafter does; verification stays lossless).

Metrics: per-slot accuracy of the corrected greedy pick, and ``tau``, the teacher-forced
acceptance length ``1 + leading correct slots``. Under greedy drafting, while slots agree
with the labels the drafted previous token IS the true one, so ``tau`` is exactly the
offline greedy acceptance length against the recorded continuation (bonus token included).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from drafter_actor.network import DrafterNetwork


def slot_weights(k: int, gamma: float) -> torch.Tensor:
    """``[k]``: ``exp(-(i-1)/gamma)`` for slots ``i = 1..k``."""
    return torch.exp(-torch.arange(k, dtype=torch.float32) / gamma)


@dataclass
class BlockStats:
    """Detached numbers of one block loss."""

    ce_base: float
    ce_markov: float
    correct: torch.Tensor  # [k] correct greedy picks per slot
    counted: torch.Tensor  # [k] labels per slot
    accepted: torch.Tensor  # [n_full] leading correct slots of anchors with all k labels

    @property
    def acc(self) -> list[float]:
        return (self.correct / self.counted.clamp(min=1)).tolist()

    @property
    def tau(self) -> float:
        return 1.0 + float(self.accepted.float().mean()) if self.accepted.numel() else 0.0


def block_loss(
    net: DrafterNetwork,
    base: torch.Tensor,
    anchor_tokens: torch.Tensor,
    labels: torch.Tensor,
    valid: torch.Tensor,
    gamma: float,
    base_weight: float = 1.0,
    markov_weight: float = 1.0,
) -> tuple[torch.Tensor, BlockStats]:
    """Loss of base logits ``[N, k, V_d]`` against recorded labels ``[N, k]`` (target ids).

    ``valid`` ``[N, k]`` marks labels inside the sequence; ``anchor_tokens`` ``[N]``.
    """
    N, k, V = base.shape
    lab = net.to_draft_ids(labels)  # [N, k]: V_d outside the draft vocabulary
    counted = valid & (lab < V)
    prev = torch.cat([net.to_draft_ids(anchor_tokens).unsqueeze(1), lab[:, :-1]], 1)
    corrected = net.markov.teacher_forced(base, prev)  # [N, k, V_d]
    target = lab.masked_fill(~counted, -100).reshape(-1)
    ce_b = F.cross_entropy(base.reshape(-1, V), target, ignore_index=-100, reduction="none")
    ce_m = F.cross_entropy(corrected.reshape(-1, V), target, ignore_index=-100, reduction="none")
    w = slot_weights(k, gamma) * counted  # [N, k]
    norm = w.sum().clamp(min=1e-6)
    ce_b, ce_m = (ce_b.view(N, k) * w).sum() / norm, (ce_m.view(N, k) * w).sum() / norm
    loss = base_weight * ce_b + markov_weight * ce_m
    with torch.no_grad():
        correct = (corrected.argmax(-1) == lab) & counted
        full = valid.all(1)
        stats = BlockStats(
            ce_base=float(ce_b),
            ce_markov=float(ce_m),
            correct=correct.sum(0).float(),
            counted=valid.sum(0).float(),
            accepted=correct[full].long().cumprod(1).sum(1),
        )
    return loss, stats
