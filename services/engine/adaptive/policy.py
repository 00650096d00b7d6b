"""How many tokens to draft this round: speculate only where it pays.

Speculation trades target work for fewer rounds. At C=1 a verify block of k+1 tokens costs
about one decode step (memory-bound), so drafting pays whenever anything is accepted; at
high batch sizes the verify forward is compute-bound and k+1 tokens per sequence cost up
to k+1 times a plain step, so drafting loses unless acceptance is high. vLLM and SGLang
leave this to the user (a fixed ``k``, or "disable speculation above batch size N"); here
the engine measures both sides and picks, every round,

    k* = argmax_{0 <= k <= k_max}  B * E[tokens | k] / (draft_s(B, k) + verify_s(B, B * (k+1)))

with ``E[tokens | k] = 1 + sum_{i<=k} prod_{j<=i} alpha_j`` from the per-position
acceptance rates ``alpha_j`` seen so far (DSpark's view of the block: each position is
accepted only if every earlier one was), and both costs from linear models fitted online
to the measured rounds (``seconds ~ a + b * rows + c * seqs``, exponentially forgotten so
they follow load and context changes). ``k = 0`` is a round without the network: plain decoding,
except that the engine drafts context copies there where they pay (``services.engine.adaptive.copies``),
so its ``E[tokens | 0]`` and rows per sequence come from that round's copy plan. By default ``k`` is
either 0 or ``k_max`` (``all_or_nothing``; ``_choices`` says why). The policy never changes
what is generated, only how fast: verification stays lossless for any ``k``.

The models are checked against what rounds really commit: where rounds with the network
have lately committed fewer tokens a second than rounds without it at the same batch size
(or a smaller one), the round goes plain whatever the lines say (``_drafting_lost``).

It explores a little so its estimates stay fresh: every ``explore_every`` rounds it runs
the alternative (one full-length draft while speculation is off, one plain round while it
is on), so a drop in acceptance or a change in cost is noticed within a few dozen rounds.
An alternative that costs more than the round it replaces is tried less often, so that
exploring spends at most ``explore_budget`` of the time: at C=8 a drafted round costs
about three plain ones, and trying one every 32 rounds had cost ~6%.

A plain round is not free while a drafter is attached: the target still returns its taps
and the drafter still ingests them, to stay ready. Once plain rounds have won
``sleep_after`` times in a row the policy reports itself ``idle``, and the engine then
drops the drafter's per-sequence state and decodes without it (see ``Engine``), checking
back now and then with one probe sequence.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

# the kinds of round whose realized rates the policy compares (``SpecPolicy.realized``)
NETWORK = "network"  # the drafter's network drafted
KEPT = "kept"  # no network drafts, the drafter kept ready (the target returned its taps)
PLAIN = "plain"  # no drafter state in the round at all


@dataclass
class LinearCost:
    """``seconds ~ a + b * rows + c * seqs``, least squares with exponential forgetting.

    ``seqs``, the sequences in the forward, matters apart from ``rows``: 8 decode rows of
    8 sequences read 8 contexts' K/V (and sample 8 times) where an 8-row verify block of
    one sequence reads one, and cost ~2x as much. Fitted on rows alone, a server whose
    batch grew from 1 to 8 (its drafted rounds at 1, plain ones at 8) learnt a flat line
    and drafted at 8 where it lost. Where ``seqs`` has not varied apart from ``rows``
    (one batch size, one draft length), the line is fitted on ``rows`` alone."""

    decay: float = 0.97
    n: float = 0.0
    sx: float = 0.0  # rows
    sz: float = 0.0  # seqs
    sy: float = 0.0  # seconds
    sxx: float = 0.0
    szz: float = 0.0
    sxz: float = 0.0
    sxy: float = 0.0
    szy: float = 0.0
    last: tuple[float, float] | None = None  # the slopes when the rows last varied
    _line: tuple[float, float, float] | None = field(default=None, repr=False)  # (a, b, c)

    def observe(self, rows: float, seconds: float, seqs: float = 1.0) -> None:
        d = self.decay
        self.n, self.sx, self.sz, self.sy = (
            d * self.n + 1, d * self.sx + rows, d * self.sz + seqs, d * self.sy + seconds,
        )  # fmt: skip
        self.sxx, self.szz, self.sxz = (
            d * self.sxx + rows * rows, d * self.szz + seqs * seqs, d * self.sxz + rows * seqs,
        )  # fmt: skip
        self.sxy, self.szy = d * self.sxy + rows * seconds, d * self.szy + seqs * seconds
        if self.spread >= 1.0:
            self.last = self._fit()
        self._line = None

    @property
    def known(self) -> bool:
        return self.n > 0

    def _variance(self) -> float:
        mean_x = self.sx / self.n
        return self.sxx / self.n - mean_x * mean_x

    @property
    def spread(self) -> float:
        """Standard deviation of the observed row counts (0: one row count, no slope yet)."""
        return max(0.0, self._variance()) ** 0.5 if self.n > 0 else 0.0

    @property
    def varied(self) -> bool:
        """Whether the row counts ever varied (a slope was measured)."""
        return self.last is not None

    def slopes(self) -> tuple[float, float]:
        """``(b, c)``: seconds per row and per sequence, neither negative. Where the rows
        seen lately no longer vary (a long run of plain rounds at one batch size has
        forgotten the drafted ones), the slopes of the last fit that saw them vary: the
        cost of a round's rows does not vanish because none were tried lately."""
        if self.spread < 1.0 and self.last is not None:
            return self.last
        return self._fit()

    def _fit(self) -> tuple[float, float]:
        n = self.n
        mx, mz, my = self.sx / n, self.sz / n, self.sy / n
        vxx, vzz = self._variance(), self.szz / n - mz * mz
        vxz = self.sxz / n - mx * mz
        cxy, czy = self.sxy / n - mx * my, self.szy / n - mz * my
        tiny = 1e-9 * max(1.0, mx * mx)
        if vxx <= tiny:
            return 0.0, 0.0  # one row count: a flat cost
        det = vxx * vzz - vxz * vxz
        if det > 0.02 * vxx * vzz:  # rows and seqs varied apart: fit both
            b, c = (cxy * vzz - czy * vxz) / det, (czy * vxx - cxy * vxz) / det
            if b >= 0 and c >= 0:
                return b, c
            if b < 0 and vzz > tiny:  # never cheaper for more rows: seqs alone
                return 0.0, max(0.0, czy / vzz)
        return max(0.0, cxy / vxx), 0.0  # rows alone

    def predict(self, rows: float, seqs: float = 1.0) -> float:
        """Seconds for ``rows`` of ``seqs`` sequences; a flat cost until two different row
        counts were seen."""
        if self.n <= 0:
            return 0.0
        if self._line is None:  # the policy predicts ~20 times a round: fit once a round
            b, c = self.slopes()
            mx, mz, my = self.sx / self.n, self.sz / self.n, self.sy / self.n
            self._line = (max(0.0, my - b * mx - c * mz), b, c)
        a, b, c = self._line
        return a + b * rows + c * seqs


@dataclass
class Acceptance:
    """Per-position acceptance of drafts of up to ``k_max`` tokens, exponentially forgotten.

    ``alpha_j`` = P(draft ``j`` accepted | drafts ``1..j-1`` accepted): each position is
    accepted only if every earlier one was (DSpark's view of the block).
    """

    k_max: int
    decay: float = 0.995  # forgetting, per observed sequence-round
    prior: float = 0.5  # acceptance assumed before any evidence (weight 1 trial)
    trials: list[float] = field(default_factory=list)
    accepts: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.trials = [0.0] * self.k_max
        self.accepts = [0.0] * self.k_max

    def alphas(self) -> list[float]:
        return [
            (a + self.prior) / (t + 1.0) for a, t in zip(self.accepts, self.trials, strict=True)
        ]

    def expected_tokens(self, k: int) -> float:
        """Tokens one sequence commits in a round with ``k`` drafts (the bonus included)."""
        total, run = 1.0, 1.0
        for alpha in self.alphas()[:k]:
            run *= alpha
            total += run
        return total

    def observe(self, num_draft: int, num_accepted: int) -> None:
        """One sequence-round: ``num_draft`` drafts of which the first ``num_accepted`` held."""
        if num_draft == 0:
            return
        d = self.decay
        self.trials = [t * d for t in self.trials]
        self.accepts = [a * d for a in self.accepts]
        for j in range(min(num_accepted + 1, num_draft, self.k_max)):  # 1..m held, m+1 failed
            self.trials[j] += 1.0
            self.accepts[j] += 1.0 if j < num_accepted else 0.0


@dataclass
class RealizedRate:
    """Tokens committed per second by one kind of round, exponentially forgotten."""

    decay: float = 0.9
    n: float = 0.0
    tokens: float = 0.0
    seconds: float = 0.0

    def observe(self, tokens: float, seconds: float) -> None:
        d = self.decay
        self.n, self.tokens, self.seconds = (
            d * self.n + 1,
            d * self.tokens + tokens,
            d * self.seconds + seconds,
        )

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


@dataclass
class SpecPolicy:
    """Chooses each round's draft length from measured acceptance and costs."""

    k_max: int
    explore_every: int = 32  # rounds between explorations, at least
    explore_budget: float = 0.02  # share of the time exploration may cost, at most
    probe_budget: float = 0.005  # ... and probes while the drafter is aside (see probe_interval)
    verify: LinearCost = field(default_factory=LinearCost)
    draft: LinearCost = field(default_factory=LinearCost)
    # the verify cost of rounds without the network only (see ``plain_cost``)
    plain_verify: LinearCost = field(default_factory=LinearCost)
    accepted: Acceptance = field(init=False)  # the drafter's drafts (network rounds)
    # a round without the network: engine-side context copies may still draft there
    # (``services.engine.adaptive.copies``), so it is expected to commit ``plain_tokens`` and verify
    # ``plain_rows`` per sequence (1 and 1 without copies); the engine prices its copy
    # plan into these before each ``choose``
    plain_tokens: float = 1.0
    plain_rows: float = 1.0
    sleep_after: int = 16  # plain rounds chosen in a row before the policy is idle
    all_or_nothing: bool = True  # choose k from {0, k_max} only (see _choices)
    since_other: float = 0  # rounds since the mode not chosen last was tried
    last_k: int = -1
    plain_streak: int = 0  # rounds in a row whose best k (exploration aside) was 0
    # what rounds really committed per second, per kind (NETWORK, KEPT, PLAIN) and batch
    # size: the check on the models (see ``_drafting_lost``)
    realized: dict[tuple[str, int], RealizedRate] = field(default_factory=dict)
    realized_min: float = 2.0  # rounds of each kind seen at a batch size before it counts

    def __post_init__(self) -> None:
        if self.k_max < 1:
            raise ValueError("k_max must be >= 1")
        self.accepted = Acceptance(self.k_max)

    # -- estimates ------------------------------------------------------------------------
    def acceptance(self) -> list[float]:
        """``alpha_j`` of the drafter's drafts, j = 1..k_max."""
        return self.accepted.alphas()

    def expected_tokens(self, k: int) -> float:
        """Tokens one sequence commits in a round with ``k`` drafts (the bonus included);
        ``k = 0``: a round without the network (context copies included)."""
        return self.accepted.expected_tokens(k) if k else self.plain_tokens

    def plain_cost(self) -> LinearCost:
        """The verify cost that prices a round without the network and its copies.

        The verify's cost is concave in its rows on a CPU, so a line fitted across plain
        and full-block rounds has a slope below what the first copy rows cost. Rounds without the network vary their rows
        only by their copies, so a line fitted to them alone prices those rows where they
        are; until their rows have varied the shared line stands in."""
        return self.plain_verify if self.plain_verify.spread >= 1.0 else self.verify

    def round_seconds(self, batch: int, k: int) -> float:
        if not k:
            return self.plain_cost().predict(batch * self.plain_rows, batch)
        rows = batch * (k + 1)
        return self.draft.predict(rows, batch) + self.verify.predict(rows, batch)

    # -- the decision ---------------------------------------------------------------------
    def choose(self, batch: int) -> int:
        """Draft length for a round of ``batch`` sequences (0 = plain)."""
        if not (self.verify.known and self.draft.known):
            k = self.k_max  # nothing measured yet: speculate, which measures both
            self.plain_streak = 0
        elif not self.verify.varied:
            # a plain round next, to measure it: until the verify line has seen two row
            # counts it prices a plain round like a full block (at C=8, 4x its cost)
            k = 0
        else:
            k = max(self._choices(), key=lambda k: self._rate(batch, k))
            if k and self._drafting_lost(batch):
                k = 0
            self.plain_streak = self.plain_streak + 1 if k == 0 else 0
            other = 0 if k else self.k_max
            if self.since_other >= self._explore_interval(batch, k, other):
                k = other
        self.since_other = 0 if (k == 0) != (self.last_k == 0) else self.since_other + 1
        self.last_k = k
        return k

    def _choices(self) -> range | tuple[int, int]:
        """The draft lengths considered. On CPU a verify's cost is not linear in its rows:
        the target's GEMMs are MKL-packed for 8 and 16 rows, so 5 rows cost more than 8.
        A linear model then favours middle k that run slower than both ends, so by default
        only plain or a full block is chosen (docs/experiments/performance.md has the
        measurements)."""
        return (0, self.k_max) if self.all_or_nothing else range(self.k_max + 1)

    def _drafting_lost(self, batch: int) -> bool:
        """Whether rounds with the network have lately committed fewer tokens a second than
        rounds without it, at this batch size or a smaller one. The models price a round
        from lines fitted across batch sizes and draft lengths, and a batch that grew (a
        server ramping from 1 to 8 requests) or a plain option that changed (context
        copies) can leave them wrong for a few hundred rounds, while the realized rates
        are what the rounds did. A smaller batch counts: drafting only pays less as the
        batch grows (each verify row costs more of a compute-bound forward), so a server
        whose batch sizes wander (ramps, tails, arrivals) need not lose again at each.
        Exploration keeps both fresh.

        Plain rounds count as they ran without any drafter state (``PLAIN``) where such
        rounds were seen, not only as they run while the drafter is kept ready (``KEPT``:
        the target returns its taps and the drafter ingests them, a tax on every round).
        Against the kept ones alone, drafting that only beats the tax looks like a gain,
        and keeps the drafter awake taxing every round."""
        for (kind, b), net in self.realized.items():
            if kind != NETWORK or b > batch or net.n < self.realized_min:
                continue
            plain = [self.realized.get((other, b)) for other in (PLAIN, KEPT)]
            rates = [r.rate for r in plain if r is not None and r.n >= self.realized_min]
            if rates and net.rate < max(rates):
                return True
        return False

    def pays_at(self, batch: int) -> bool:
        """Whether drafting is expected to pay in rounds of ``batch`` sequences: nothing
        measured yet (speculating measures), or the best ``k > 0`` beats a plain round and
        rounds with the network have not lately lost at this batch size. The engine asks
        before it gives new sequences drafter state: a sequence admitted into a batch where
        drafting loses would only cost the drafter's views and updates."""
        if not (self.verify.known and self.draft.known) or not self.verify.varied:
            return True
        best = max((k for k in self._choices() if k), key=lambda k: self._rate(batch, k))
        return self._rate(batch, best) > self._rate(batch, 0) and not self._drafting_lost(batch)

    @property
    def idle(self) -> bool:
        """Drafting has not paid for ``sleep_after`` rounds: the drafter may be put aside."""
        return self.plain_streak >= self.sleep_after

    def explore_next(self) -> None:
        """Try the other mode in the next round (a probe sequence just joined), however
        dear the exploration budget makes it."""
        self.since_other = math.inf

    def probe_interval(self, batch: int, floor: int) -> float:
        """Rounds between probe batches (sequences admitted with drafter state while the
        drafter is aside) in rounds of ``batch`` sequences: ``floor``, or more where a drafted
        round costs more than a plain one, so probing spends at most ``probe_budget`` of
        the time. A probe costs more than its drafted round (the drafter's prefill, and its
        updates until it is put aside again), and at a batch where drafting lost it rarely
        finds otherwise: at 16 sequences a drafted round costs several plain ones."""
        plain = self.round_seconds(batch, 0)
        if plain <= 0 or not self.draft.known:
            return floor
        extra = self.round_seconds(batch, self.k_max) / plain - 1.0
        return max(floor, extra / self.probe_budget)

    def _explore_interval(self, batch: int, k: int, other: int) -> float:
        """Rounds between tries of ``other`` while ``k`` is chosen: ``explore_every``, or
        more where a try of ``other`` costs more than the round it replaces."""
        chosen = self.round_seconds(batch, k)
        extra = self.round_seconds(batch, other) / chosen - 1.0 if chosen > 0 else 0.0
        return max(self.explore_every, extra / self.explore_budget)

    def _rate(self, batch: int, k: int) -> float:
        seconds = self.round_seconds(batch, k)
        return batch * self.expected_tokens(k) / seconds if seconds > 0 else float("inf")

    # -- feedback -------------------------------------------------------------------------
    def observe(
        self,
        num_draft: list[int],
        num_accepted: list[int],
        draft_s: float,
        verify_s: float,
        network: bool = True,
        taps: bool = True,
    ) -> None:
        """One finished round: per-sequence drafts and accepted counts, and its timings.
        ``network=False``: a round without the drafter's network (any drafts were copies);
        ``taps``: the target returned the drafter's updates (some sequence had its state)."""
        rows, seqs = sum(n + 1 for n in num_draft), len(num_draft)
        committed = seqs + sum(num_accepted)  # each sequence's accepted drafts and one more
        kind = NETWORK if network and any(num_draft) else KEPT if taps else PLAIN
        self.realized.setdefault((kind, seqs), RealizedRate()).observe(
            committed, draft_s + verify_s
        )
        self.verify.observe(rows, verify_s, seqs)
        if not network:
            self.plain_verify.observe(rows, verify_s, seqs)
            return
        if any(num_draft):
            self.draft.observe(rows, draft_s, seqs)
        for n, m in zip(num_draft, num_accepted, strict=True):
            self.accepted.observe(n, m)


__all__ = ["KEPT", "NETWORK", "PLAIN", "Acceptance", "LinearCost", "RealizedRate", "SpecPolicy"]
