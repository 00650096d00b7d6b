"""Re-picking a trained drafter's draft vocabulary (``train drafter --revocab``).

The backbone never sees draft ids: its logits come from the target's LM head sliced by
``d2t``. Only the Markov head is indexed by them (``w1`` rows by the previous draft id,
with a last row for "outside the vocabulary"; ``w2`` columns by the next one). A new
``d2t`` keeps the learned row and column of every token in both vocabularies and starts
the others at zero (no correction, as a fresh head starts), so the drafter drafts exactly
as before wherever the old vocabulary already held the token.
"""

from __future__ import annotations

import torch


def remap_draft_vocab(
    weights: dict[str, torch.Tensor], new_d2t: torch.Tensor
) -> dict[str, torch.Tensor]:
    """``weights`` (a drafter state dict with ``d2t``) moved onto the vocabulary ``new_d2t``."""
    old_d2t = weights["d2t"].to(torch.long)
    new_d2t = new_d2t.to(torch.long)
    w1, w2 = weights["markov.w1"], weights["markov.w2"]  # [V_old + 1, r], [r, V_old]
    size = int(max(int(old_d2t.max()), int(new_d2t.max())) + 1)
    old_pos = torch.full((size,), -1, dtype=torch.long)
    old_pos[old_d2t] = torch.arange(len(old_d2t))
    src = old_pos[new_d2t]  # [V_new]: the old draft id of each new entry, -1 if new
    kept = src >= 0
    new_w1 = w1.new_zeros(len(new_d2t) + 1, w1.shape[1])
    new_w1[:-1][kept] = w1[src[kept]]
    new_w1[-1] = w1[-1]  # out of the vocabulary
    new_w2 = w2.new_zeros(w2.shape[0], len(new_d2t))
    new_w2[:, kept] = w2[:, src[kept]]
    out = dict(weights)
    out.update({"d2t": new_d2t.clone(), "markov.w1": new_w1, "markov.w2": new_w2})
    return out
