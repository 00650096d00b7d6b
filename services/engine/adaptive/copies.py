"""Context copies in rounds without the drafter's network: draft only where it pays.

On a CPU (or at high load on any device) the network's block rarely pays for the rows it
adds to the verify, and the adaptive policy rounds drop to plain decoding. Greedy text
still repeats itself: the continuation of a long recent n-gram match is right far more
often than the network's average draft, and the longer the match the more often. So in
those rounds the engine drafts, per
sequence, the copy of its longest recent match (the drafter's own rule,
``drafter_actor.context_copy.find_copy``, answered from an n-gram index of the engine's
token ids, ``services.engine.adaptive.ngram_index``: no network, no taps, no actor call) where the
expected gain is worth its rows, and verifies plain rows for the rest. This is
prompt-lookup decoding (vLLM's ``ngram`` method) with a cost model.

Which sequences draft: the verify costs ``a + b * rows`` (the policy's fitted model), and
a copy of ``k`` tokens from a match of length ``n`` is expected to add ``g(n, k)`` tokens
(per-position acceptance per match length, measured as rounds go). The round's rate
``(B + sum g) / cost(B + sum k)`` is maximal when each copy keeps exactly the slots whose
chance of holding (every slot before it held too) beats ``rate * b``, which a few
fixed-point passes find (Dinkelbach): a long match's copy drafts whole, a short one's its
first token or two, a failing one nothing. At one sequence on a CPU, where a row costs a
fraction of a step, most copies draft; in a loaded round only their surest slots.
Now and then one more candidate drafts, the one whose match length has the least evidence,
so estimates stay fresh (exploring every candidate at once costs too much at high load):
every ``explore_every`` rounds at most, and no more often than keeps its extra rows within
``explore_budget`` of the time (at C=8 a 7-token copy adds half a plain round). It is
drafted but not priced: the round's plain option is what the copies worth drafting cost
and gain, so an exploration never makes a plain round look dearer than drafting.

The engine's planner asks for copies only while one sequence runs or requests wait for a
slot (``RoundPlanner._plan_copies`` says why).

A copied slot's proposal is one-hot, and which sequences copy depends only on their
history and on earlier rounds (never on a token sampled this round), so verification
stays lossless at any temperature (the invariant in ``target_actor.rejection``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from drafter_actor.context_copy import MIN_NGRAM
from services.engine.adaptive.ngram_index import NgramIndex
from services.engine.adaptive.policy import Acceptance, LinearCost
from target_actor.messages import Proposal


@dataclass(frozen=True)
class CopyCandidate:
    row: int  # index in the round's batch
    tokens: list[int]  # the copy, at most the sequence's draft limit long
    key: tuple[int, bool]  # (match length, sampled): the acceptance bucket


def find_candidate(row: int, index: NgramIndex, limit: int, sampled: bool) -> CopyCandidate | None:
    """The sure copy for a sequence whose ids ``index`` holds (the last one is the round's
    anchor), at most ``limit`` tokens; None without a match of ``MIN_NGRAM``."""
    if limit < 1:
        return None
    copy, n = index.copy(limit)
    return CopyCandidate(row, copy, (n, sampled)) if n >= MIN_NGRAM else None


@dataclass(frozen=True)
class CopyPlan:
    """A round's copies: those expected to pay for their rows, and one drafted besides to
    keep its estimate fresh (not priced into the round's plain option)."""

    worth: list[CopyCandidate] = field(default_factory=list)
    explore: list[CopyCandidate] = field(default_factory=list)

    @property
    def copies(self) -> list[CopyCandidate]:
        """Every copy the round drafts."""
        return self.worth + self.explore


@dataclass
class CopyPlanner:
    """Chooses the copies worth verifying and learns how often they hold."""

    k_max: int
    explore_every: int = 8  # rounds between explorations, at least
    explore_budget: float = 0.02  # share of the time exploration may cost, at most
    prior: float = 0.5  # acceptance per slot before a match length has evidence (1 trial)
    since_explore: int = 0
    acceptance: dict[tuple[int, bool], Acceptance] = field(default_factory=dict)

    def gain(self, c: CopyCandidate) -> float:
        """Expected tokens the copy adds to its sequence's round (the bonus excluded)."""
        return self._acc(c.key).expected_tokens(len(c.tokens)) - 1.0

    def plan(self, candidates: list[CopyCandidate], batch: int, verify: LinearCost) -> CopyPlan:
        """The copies to draft in a round of ``batch`` sequences."""
        self.since_explore += 1
        if not candidates:
            return CopyPlan()

        def cost(rows: float) -> float:
            return verify.predict(rows, batch)

        b = cost(batch + 1) - cost(batch)  # seconds per extra row (0 until rows varied)
        chosen: list[CopyCandidate] = []
        for _ in range(4):
            rows = batch + sum(len(c.tokens) for c in chosen)
            seconds = cost(rows)
            if seconds <= 0:
                return CopyPlan(candidates)
            rate = (batch + sum(self.gain(c) for c in chosen)) / seconds
            pick = [t for c in candidates if (t := self._worth(c, rate * b)) is not None]
            if pick == chosen:
                break
            chosen = pick
        rest = [c for c in candidates if c.row not in {w.row for w in chosen}]
        if not rest:
            return CopyPlan(chosen)
        least_known = min(rest, key=lambda c: self._acc(c.key).trials[0])
        rows = batch + sum(len(c.tokens) for c in chosen)
        extra = cost(rows + len(least_known.tokens)) / cost(rows) - 1.0
        if self.since_explore < max(self.explore_every, extra / self.explore_budget):
            return CopyPlan(chosen)
        self.since_explore = 0
        return CopyPlan(chosen, [least_known])

    def _worth(self, c: CopyCandidate, price: float) -> CopyCandidate | None:
        """``c`` cut to the length worth its rows (None: no length is), when each row must
        earn ``price`` tokens: its slot ``j`` adds a token with the chance that slots
        ``1..j`` all hold, which only falls with ``j``, so the copy keeps the slots whose
        chance beats the price. A short match's copy is right for a token or two, seldom
        for seven."""
        keep, run = 0, 1.0
        for alpha in self._acc(c.key).alphas()[: len(c.tokens)]:
            run *= alpha
            if run <= price:
                break
            keep += 1
        if keep == 0:
            return None
        return c if keep == len(c.tokens) else CopyCandidate(c.row, c.tokens[:keep], c.key)

    def observe(self, drafted: list[CopyCandidate], num_accepted: list[int]) -> None:
        """``num_accepted``: the round's accepted counts for every row of the batch."""
        for c in drafted:
            self._acc(c.key).observe(len(c.tokens), num_accepted[c.row])

    def _acc(self, key: tuple[int, bool]) -> Acceptance:
        if key not in self.acceptance:
            self.acceptance[key] = Acceptance(self.k_max, prior=self.prior)
        return self.acceptance[key]


def copy_proposal(drafted: list[CopyCandidate], batch: int) -> tuple[list[int], Proposal]:
    """Per-row draft counts and the one-hot proposal holding ``drafted`` (others empty),
    in host memory: the engine's, sent to the ranks like a drafter's over Ray."""
    k = max(len(c.tokens) for c in drafted)
    num_draft = [0] * batch
    rows = [[-1] * k for _ in range(batch)]
    for c in drafted:
        num_draft[c.row] = len(c.tokens)
        rows[c.row][: len(c.tokens)] = c.tokens
    tokens = torch.tensor(rows, dtype=torch.long, device="cpu")
    q_ids = tokens.clamp(min=0).unsqueeze(-1)
    q_probs = torch.ones(batch, k, 1, device="cpu")
    return num_draft, Proposal(tokens, q_ids, q_probs)


__all__ = ["CopyCandidate", "CopyPlan", "CopyPlanner", "copy_proposal", "find_candidate"]
