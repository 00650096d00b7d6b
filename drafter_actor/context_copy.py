"""Context copy: draft the continuation of the longest recent n-gram match, where it is sure.

Greedy text from a small target repeats itself (lists, code, loops) and copies its prompt
(summaries, translations, quoted code). For the committed tokens plus the anchor, the
drafter looks for the most recent earlier occurrence of their longest suffix (up to
``MAX_NGRAM`` tokens) in the sequence's token history and proposes what followed it.

Two rules merge a copy into the network's proposal, and both keep every slot's ``q`` the
exact distribution its token was drawn from, given the slots before it (the invariant
lossless rejection sampling rests on):

* **sure**: the match is long (at least the drafter's ``copy_sure_ngram`` tokens,
  ``MIN_NGRAM`` by default). The choice depends on the history alone, so every slot takes
  the copy with a one-hot ``q``. A copy is always ``k`` tokens long (a copy that reaches
  the anchor repeats itself), so a sure copy replaces the whole block and the drafter
  skips the network's pass for that sequence.
* **agreement**: the copy's first token equals the network's first draft (two
  independent guesses agree). That choice depends on the first slot's *sampled* token,
  so the first slot keeps the network's token and its ``q`` (the distribution it was
  drawn from); only the later slots, fixed once the first is known, take the copy with
  a one-hot ``q``. Making the first slot one-hot as well would accept it with ``p(c)``
  instead of ``min(1, p(c) / q(c))`` and bias sampled output.

The history is a fixed-size buffer (``HISTORY_TOKENS`` ids), so the drafter's state
stays independent of the context length. It lives in host memory whatever the drafter's
device: the search below is a few short scans ending in Python lists (``tolist``), which
on a GPU would wait for the device several times a sequence a round.
"""

from __future__ import annotations

import torch

from target_actor.messages import HISTORY_TOKENS, Proposal

MAX_NGRAM = 8  # the longest suffix matched
MIN_NGRAM = 2  # a match this long is copied without the network's agreement (the default)


def find_copy(history: torch.Tensor, anchor: int, k: int) -> tuple[list[int], int]:
    """The continuation (``k`` ids) of the longest recent match, and the match's length.

    ``history`` ``[n]``: committed token ids, oldest first; ``anchor`` follows them. The
    match is the longest suffix of ``history + [anchor]`` (up to ``MAX_NGRAM``) that also
    ends earlier in it, the most recent one among the longest; ``([], 0)`` if none.
    """
    seq = torch.cat([history, torch.tensor([anchor], dtype=history.dtype, device=history.device)])
    T = seq.shape[0]
    ends = (seq[:-1] == anchor).nonzero().flatten()  # earlier positions holding the anchor
    if ends.numel() == 0:
        return [], 0
    length = torch.ones_like(ends)
    alive = torch.ones_like(ends, dtype=torch.bool)
    for i in range(1, MAX_NGRAM):
        ok = (ends - i >= 0) & alive
        ok[ok.clone()] = seq[ends[ok] - i] == seq[T - 1 - i]
        alive = ok
        length += alive.long()
        if not bool(alive.any()):
            break
    best = int(length.max())
    end = int(ends[length == best].max())  # the most recent of the longest matches
    # what followed the match, up to the anchor; a copy that reaches the anchor goes on
    # copying itself (the text repeats with period T - 1 - end), as LZ77 copies overlap
    follow = seq[end + 1 :].tolist()
    return [follow[j % len(follow)] for j in range(k)], best


def is_sure(copy: list[int], n: int, sure_ngram: int = MIN_NGRAM) -> bool:
    """A match long enough to copy whatever the network drafts (it replaces every slot)."""
    return bool(copy) and n >= sure_ngram


def copy_inputs(
    copies: list[tuple[list[int], int]], k: int, device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """The network's copy inputs on ``device``: tokens ``[n, k]`` (-1: none) and match
    lengths ``[n]``, built in Python and copied over once."""
    rows = [copy[:k] + [-1] * (k - len(copy[:k])) for copy, _ in copies]
    tokens = torch.tensor(rows, dtype=torch.long, device=device).view(len(copies), k)
    lengths = [n if copy else 0 for copy, n in copies]
    return tokens, torch.tensor(lengths, dtype=torch.long, device=device)


def copies_in_text(
    tokens: torch.Tensor, seq: torch.Tensor, pos: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Copy inputs at many anchors of recorded text (training): anchor ``tokens[seq, pos]``
    after the history ``tokens[seq, :pos]`` (its last ``HISTORY_TOKENS``)."""
    rows = tokens.tolist()
    copies = [
        find_copy(
            torch.tensor(rows[b][max(0, t - HISTORY_TOKENS) : t], dtype=torch.long, device="cpu"),
            rows[b][t],
            k,
        )
        for b, t in zip(seq.tolist(), pos.tolist(), strict=True)
    ]
    return copy_inputs(copies, k)


def apply_copies(
    proposal: Proposal, copies: list[tuple[list[int], int]], sure_ngram: int = MIN_NGRAM
) -> tuple[Proposal, int]:
    """``proposal`` with each row's slots replaced by its copy where a rule allows, and how
    many rows took a copy: every slot for a match of ``sure_ngram`` tokens; every slot
    after the first when the copy agrees with the network's first draft (the first slot
    keeps its ``q``, which its token was drawn from; see the module docstring).

    The rows' choices are made in Python, then written in one pass on the proposal's
    device (the input is not modified)."""
    tokens, q_ids, q_probs = proposal.tokens, proposal.q_ids, proposal.q_probs
    k = tokens.shape[1]
    # the agreement rule reads the network's first drafts: one copy of that column to
    # the host, and only when a row has a copy that rule could take
    agreeing = any(copy and not is_sure(copy, n, sure_ngram) for copy, n in copies)
    firsts = tokens[:, 0].tolist() if agreeing else []
    changed, replace, values = 0, [[False] * k for _ in copies], [[0] * k for _ in copies]
    for i, (copy, n) in enumerate(copies):
        if is_sure(copy, n, sure_ngram):
            first = 0
        elif copy and copy[0] == firsts[i]:
            first = 1  # the agreeing slot stays the network's own draw
        else:
            continue
        changed += 1
        for j in range(first, min(len(copy), k)):
            replace[i][j], values[i][j] = True, copy[j]
    if not changed:
        return proposal, 0
    dev = tokens.device
    mask = torch.tensor(replace, dtype=torch.bool, device=dev).view(tokens.shape)
    ids = torch.tensor(values, dtype=tokens.dtype, device=dev).view(tokens.shape)
    # a copied slot's q: one-hot on its token (support slot 0; the other ids 0, no mass)
    slot0 = torch.arange(q_ids.shape[-1], device=dev) == 0  # [K_q]
    tokens = torch.where(mask, ids, tokens)
    q_ids = torch.where(mask.unsqueeze(-1), ids.unsqueeze(-1) * slot0, q_ids)
    q_probs = torch.where(mask.unsqueeze(-1), slot0.to(q_probs.dtype), q_probs)
    return Proposal(tokens, q_ids, q_probs), changed
