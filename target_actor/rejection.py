"""Verify a round of draft tokens against the target: lossless speculative sampling.

Vocabulary (used the same way everywhere in the project):

* **draft tokens** ``d_1..d_k``: what the drafter proposed for positions ``t+1..t+k``.
* **target** ``p``: the distribution the target model actually samples from, i.e.
  ``target_actor.sampling.target_probs`` (temperature, min-p, top-k, top-p) of the
  logits after the sequence's processors (``target_actor.logits_processors``). Logit row ``j`` was
  computed at position ``t+j``, so it predicts the token after it: row ``j`` verifies
  draft ``j+1`` and row ``k`` gives the bonus token.
* **proposal** ``q``: the distribution draft ``d_j`` was sampled from. The drafter ships
  it sparsely (``q_probs`` on ``q_ids``, zero elsewhere); greedy drafting is one-hot.
* **accepted** tokens: the leading drafts that pass verification, ``m`` of them.
* **recovered** token: at the first rejection, a token sampled from
  ``norm(max(0, p - q))`` at that slot (greedy: the target argmax there).
* **bonus** token: after all drafts are accepted, a token sampled from ``p`` at row
  ``num_draft`` (greedy: the target argmax there).

A round commits ``m + 1`` tokens: the accepted drafts, then one **output token**
(recovered or bonus). Draft lengths may be ragged: sequence ``i`` uses only its first
``num_draft[i]`` slots (the rest are ignored and may hold padding such as -1), so the
engine can shrink ``k`` per sequence. With ``num_draft == 0`` the round is a plain
decoding step: the output token is sampled from row 0 exactly as
``sampling.sample_next`` would, and it counts as a bonus (all zero drafts accepted).

Greedy (``temperature == 0``) accepts while ``d_j == argmax(row j-1)``, which is exactly
plain greedy decoding. Sampling accepts ``d_j`` with probability ``min(1, p(d_j) / q(d_j))``
(Leviathan et al. 2023, Chen et al. 2023), which makes the committed tokens distributed
exactly as the target's.

**The invariant every proposer must keep:** slot ``j``'s ``q`` is exactly the distribution
its token ``d_j`` was drawn from, given the history and the slots before it. ``q`` may be
one-hot (a copy, a greedy draft) and may depend on anything decided before slot ``j`` was
drawn (the earlier slots, the history, timings, other randomness), but a choice that
looks at ``d_j`` itself must leave ``q_j`` as the distribution ``d_j`` came from. Swapping
``d_j`` for a copy *because* it equals the copy, and then shipping a one-hot ``q_j``,
accepts it with ``p(d_j)`` instead of ``min(1, p / q)`` and biases the output
(``drafter_actor.context_copy`` keeps the network's ``q`` in that slot for this reason).
Truncating a block (a smaller ``num_draft``) keeps the invariant: the verified prefix is
unchanged.

Random numbers. A sequence with its own ``torch.Generator`` draws, in this order:
``num_draft`` uniforms (one per draft slot, all drawn before any is used), then one
key for the output token's draw (``draw``; one ``torch.multinomial`` draw off the CPU
kernels). Greedy sequences draw nothing. So a seeded sequence's result does not depend
on what else is in the batch, nor on its order. Sequences without a generator share the
global RNG, drawn batch-wide.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch

from target_actor.batch import SeqSampling
from target_actor.messages import Proposal
from target_actor.native import library
from target_actor.sampling import target_probs

RACE_KEYS = 1 << 62  # a row's key for the output draw (csrc/sample.c), drawn in [0, this)


@dataclass
class RejectionResult:
    """The outcome of one verification round for a batch of ``n`` sequences."""

    num_accepted: torch.Tensor  # [n] int64: m, accepted drafts per sequence
    output_token: torch.Tensor  # [n] int64: the recovered or bonus token
    committed: list[list[int]]  # n lists of m + 1 tokens: accepted drafts, then output token
    bonus: torch.Tensor  # [n] bool: every draft accepted, output token is the bonus


def rejection_sample(
    target_logits: torch.Tensor,  # [n, k + 1, vocab] dense, or [sum(num_draft + 1), vocab]
    proposal: Proposal,
    params: list[SeqSampling],
    generators: list[torch.Generator | None],
    num_draft: list[int] | None = None,  # [n], each in 0..k; default k for all
) -> RejectionResult:
    """Accept a prefix of each sequence's drafts and sample its output token.

    ``target_logits`` may be ragged (2-D): sequence ``i``'s ``num_draft[i] + 1`` rows one
    after another, as the target's forward returns them. Only those rows are ever read, so
    a round where one sequence drafts 7 tokens and 31 verify none costs 39 rows of argmax
    or softmax, not 32 x 8 (the padded tensor made such a round sample ~8x the rows).
    """
    tokens, q_ids, q_probs = proposal.tokens, proposal.q_ids, proposal.q_probs
    n, k = tokens.shape
    assert q_ids.ndim == 3 and q_ids.shape[:2] == (n, k), f"q_ids {tuple(q_ids.shape)}"
    assert q_probs.shape == q_ids.shape, f"q_probs {tuple(q_probs.shape)} != q_ids"
    assert len(params) == n and len(generators) == n
    num_draft = [k] * n if num_draft is None else list(num_draft)
    assert len(num_draft) == n and all(0 <= d <= k for d in num_draft), num_draft
    device = target_logits.device
    if not any(num_draft):
        return _plain(target_logits, params, generators)
    nd = torch.tensor(num_draft, dtype=torch.long, device=device)  # [n]
    rows = _row_index(nd, k)  # [n, k + 1]: each slot's row in the ragged logits
    if target_logits.ndim == 3:
        assert target_logits.shape[:2] == (n, k + 1), (
            f"logits {tuple(target_logits.shape)} != {(n, k + 1)}"
        )
        dense_rows = torch.arange(n, device=device)[:, None] * (k + 1) + torch.arange(
            k + 1, device=device
        )
        keep = torch.arange(k + 1, device=device) <= nd[:, None]
        target_logits = target_logits.flatten(0, 1)[dense_rows[keep]]
    assert target_logits.shape[0] == int((nd + 1).sum()), (
        f"{target_logits.shape[0]} logit rows for drafts {num_draft}"
    )

    unused = torch.arange(k, device=device) >= nd[:, None]  # [n, k]: may hold padding (-1)
    tokens = tokens.to(device).masked_fill(unused, 0)
    q_ids = q_ids.to(device).masked_fill(unused[..., None], 0)
    q_probs = q_probs.to(device)
    num_accepted = torch.zeros(n, dtype=torch.long, device=device)  # [n]
    output_token = torch.zeros(n, dtype=torch.long, device=device)  # [n]

    greedy = [i for i in range(n) if params[i].greedy]
    sampled = [i for i in range(n) if not params[i].greedy]
    if greedy:
        idx = torch.tensor(greedy, device=device)
        m, out = _verify_greedy(target_logits, rows[idx], tokens[idx], nd[idx])
        num_accepted[idx], output_token[idx] = m, out
    if sampled:
        idx = torch.tensor(sampled, device=device)
        m, out = _verify_sampled(
            target_logits,
            rows[idx],
            tokens[idx],
            q_ids[idx],
            q_probs[idx],
            nd[idx],
            [params[i] for i in sampled],
            [generators[i] for i in sampled],
        )
        num_accepted[idx], output_token[idx] = m, out

    drafts, ms, outs = tokens.tolist(), num_accepted.tolist(), output_token.tolist()
    return RejectionResult(
        num_accepted=num_accepted,
        output_token=output_token,
        committed=[d[:m] + [y] for d, m, y in zip(drafts, ms, outs, strict=True)],
        bonus=num_accepted == nd,
    )


def _plain(
    target_logits: torch.Tensor, params: list[SeqSampling], generators: list[torch.Generator | None]
) -> RejectionResult:
    """A round without drafts (plain decoding's round): each output token is its row's
    argmax, or its draw from ``p``: what the general path returns for it (the same rows
    into ``target_probs``, the same weights into ``draw``), in a few ops instead of its
    ~25, which are a visible share of a small model's step."""
    rows = target_logits[:, 0] if target_logits.ndim == 3 else target_logits  # [n, vocab]
    n = rows.shape[0]
    sampled = [i for i in range(n) if not params[i].greedy]
    if len(sampled) < n:
        out = rows.argmax(-1)
    else:  # every row draws: no argmax over the vocabulary
        out = torch.empty(n, dtype=torch.long, device=rows.device)
    if sampled:
        dev = rows.device
        idx = torch.tensor(sampled, device=dev)
        none = torch.zeros(len(sampled), dtype=torch.long, device=dev)
        own = torch.arange(len(sampled), device=dev)[:, None]
        p = _processed_p(rows[idx], own, none, [params[i] for i in sampled])
        out[idx] = draw(p, [generators[i] for i in sampled])
    zeros = torch.zeros(n, dtype=torch.long, device=out.device)
    return RejectionResult(
        num_accepted=zeros,
        output_token=out,
        committed=[[t] for t in out.tolist()],
        bonus=torch.ones(n, dtype=torch.bool, device=out.device),
    )


def _row_index(nd: torch.Tensor, k: int) -> torch.Tensor:
    """``[n, k + 1]``: the ragged row of sequence ``i``'s slot ``j`` (slots past
    ``nd[i]`` repeat its last row; they are never used)."""
    start = torch.cumsum(nd + 1, 0) - (nd + 1)  # [n]
    slot = torch.minimum(torch.arange(k + 1, device=nd.device)[None, :], nd[:, None])
    return start[:, None] + slot


def _leading_accepted(accept: torch.Tensor, nd: torch.Tensor) -> torch.Tensor:
    """``accept`` ``[n, k]`` bool -> m ``[n]``: accepted slots before the first rejection."""
    valid = torch.arange(accept.shape[1], device=accept.device) < nd[:, None]  # [n, k]
    return (accept & valid).long().cumprod(-1).sum(-1)


def _verify_greedy(
    logits: torch.Tensor,  # [rows, vocab] ragged (all sequences)
    rows: torch.Tensor,  # [n, k + 1]: these sequences' rows
    tokens: torch.Tensor,  # [n, k]
    nd: torch.Tensor,  # [n]
) -> tuple[torch.Tensor, torch.Tensor]:
    used = torch.unique(rows)  # sorted: the rows these sequences own
    if len(used) == logits.shape[0]:  # the whole batch is greedy: no row copy
        top = logits.argmax(-1)
    else:
        top = torch.zeros(logits.shape[0], dtype=torch.long, device=logits.device)
        top[used] = logits[used].argmax(-1)
    top = top[rows]  # [n, k + 1]
    m = _leading_accepted(tokens == top[:, :-1], nd)  # [n]
    return m, top.gather(1, m[:, None]).squeeze(1)


def _verify_sampled(
    logits: torch.Tensor,  # [rows, vocab] ragged (all sequences)
    rows: torch.Tensor,  # [n, k + 1]: these sequences' rows
    tokens: torch.Tensor,  # [n, k]
    q_ids: torch.Tensor,  # [n, k, K_q]
    q_probs: torch.Tensor,  # [n, k, K_q]
    nd: torch.Tensor,  # [n]
    params: list[SeqSampling],
    generators: list[torch.Generator | None],
) -> tuple[torch.Tensor, torch.Tensor]:
    n, k1 = rows.shape
    k = k1 - 1
    seqs = torch.arange(n, device=logits.device)
    p = _processed_p(logits, rows, nd, params)  # [rows, vocab]: zero outside these sequences

    # Accept d_j with probability min(1, p(d_j) / q(d_j)), i.e. when u * q(d_j) < p(d_j).
    u = _uniforms(n, k, nd, generators, logits.device)  # [n, k]
    p_d = p[rows[:, :k], tokens]  # [n, k]
    q_d = (q_probs.float() * (q_ids == tokens[..., None])).sum(-1)  # [n, k]
    m = _leading_accepted(u * q_d < p_d, nd)  # [n]

    # Output token: recovered from max(0, p - q) at slot m, or the bonus from p at row m
    # (there q is zero, so the residual is p itself, bit for bit). multinomial normalises.
    # A residual that is all zero means p == q at that slot; then fall back to p.
    p_out = p[rows[seqs, m]]  # [n, vocab]
    residual = p_out
    if k > 0:
        slot = m.clamp(max=k - 1)
        rejected = (m < nd).float()[:, None]  # [n, 1]
        q_out = torch.zeros_like(p_out).scatter_add_(
            -1, q_ids[seqs, slot], q_probs[seqs, slot].float() * rejected
        )  # [n, vocab]: dense q at the rejected slot, zero for bonus rows
        residual = (p_out - q_out).clamp_min_(0.0)
        residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p_out)
    return m, draw(residual, generators)


def _processed_p(
    logits: torch.Tensor, rows: torch.Tensor, nd: torch.Tensor, params: list[SeqSampling]
) -> torch.Tensor:
    """``target_probs`` on each sequence's own ``nd[i] + 1`` rows (ragged ``[rows, vocab]``,
    zero elsewhere), one call per distinct (temperature, top_k, top_p, min_p)."""
    groups: dict[tuple[float, int, float, float], list[int]] = defaultdict(list)
    for i, sp in enumerate(params):
        groups[(sp.temperature, sp.top_k, sp.top_p, sp.min_p)].append(i)
    if len(groups) == 1 and int((nd + 1).sum()) == logits.shape[0]:  # one setting, all rows
        return target_probs(logits, *next(iter(groups)))
    p = torch.zeros(logits.shape, dtype=torch.float32, device=logits.device)
    slots = torch.arange(rows.shape[1], device=logits.device)
    for setting, members in groups.items():
        idx = torch.tensor(members, device=logits.device)
        own = rows[idx][slots[None, :] <= nd[idx][:, None]]  # their rows, each once
        p[own] = target_probs(logits[own], *setting)
    return p


def _uniforms(
    n: int,
    k: int,
    nd: torch.Tensor,  # [n]
    generators: list[torch.Generator | None],
    device: torch.device,
) -> torch.Tensor:
    """``[n, k]`` uniforms; a seeded sequence draws exactly ``nd[i]`` from its generator."""
    u = torch.ones(n, k, device=device)  # slots past nd[i] are never used
    shared = [i for i, g in enumerate(generators) if g is None]
    if shared and k > 0:
        u[shared] = torch.rand(len(shared), k, device=device)
    for i, (gen, d) in enumerate(zip(generators, nd.tolist(), strict=True)):
        if gen is not None and d > 0:
            u[i, :d] = torch.rand(d, generator=gen, device=gen.device).to(device)
    return u


def draw(weights: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """One token per row of unnormalised ``weights`` ``[n, vocab]`` -> ``[n]``.

    On the CPU with the C kernels built: a race on each row's support (``csrc/sample.c``)
    keyed by one draw from the row's generator (the global RNG where it has none). Where
    top-p keeps a few tokens this costs a few microseconds, where ``torch.multinomial``
    draws an exponential for each of the vocabulary's tokens (~1 ms at 49,152). Elsewhere
    (no C compiler, a GPU): ``torch.multinomial``."""
    lib = library()
    if lib is None or weights.device.type != "cpu":
        return _multinomial(weights, generators)
    n, cpu = weights.shape[0], weights.device
    keys = torch.empty(n, dtype=torch.int64, device=cpu)
    shared = [i for i, g in enumerate(generators) if g is None]
    if shared:
        keys[shared] = torch.randint(0, RACE_KEYS, (len(shared),), device=cpu)
    for i, gen in enumerate(generators):
        if gen is not None:
            keys[i] = torch.randint(0, RACE_KEYS, (1,), generator=gen, device=gen.device).item()
    w = weights.float().contiguous()
    out = torch.empty(n, dtype=torch.long, device=cpu)
    lib.ls_race(w.data_ptr(), n, w.shape[1], keys.data_ptr(), out.data_ptr())
    if bool((out < 0).any()):  # as torch.multinomial: nothing to draw from
        raise RuntimeError("invalid distribution: no token has a positive weight")
    return out


def _multinomial(weights: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    out = torch.empty(weights.shape[0], dtype=torch.long, device=weights.device)
    shared = [i for i, g in enumerate(generators) if g is None]
    if shared:
        out[shared] = torch.multinomial(weights[shared], 1).squeeze(1)
    for i, gen in enumerate(generators):
        if gen is not None:
            out[i] = torch.multinomial(weights[i].to(gen.device), 1, generator=gen).item()
    return out
