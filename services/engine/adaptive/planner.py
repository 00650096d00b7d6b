"""What a round drafts: the per-round plan, and what the planner learns from each round.

The engine asks :meth:`RoundPlanner.plan` before every round and reports back with
:meth:`RoundPlanner.observe` after it (SGLang's speculative-worker hooks have this shape).
Behind those two calls sit all the choices speculation makes:

* **k** each round: fixed (``EngineConfig.k``), or adaptive (``policy.SpecPolicy``: from
  measured acceptance and cost; 0 = a plain round);
* **engine-side copies** in rounds without the network (``copies.CopyPlanner``), while
  one sequence runs or requests wait for a slot (a copy buys a sequence an early finish,
  which frees a slot: worth its rows only where that slot is the round or a request
  waits for it; with every request running, the batch's rounds go on regardless);
* **the drafter put aside** while drafting keeps not paying: running sequences lose their
  drafter state (``RoundPlan.put_aside``, the engine frees it) and new ones start without
  it, except one probe batch every ``probe_every`` rounds (more where a drafted round
  costs several plain ones: ``SpecPolicy.probe_interval``), which drafts once so the
  policy re-measures acceptance;
* **no drafter state for sequences admitted where drafting loses**: at the batch size an
  admission makes, if the policy's measurements say plain rounds win there
  (``SpecPolicy.pays_at``), the new sequences start plain (probes aside), so a loaded
  server does not build views and ship updates for a drafter it will not use;
* **seeded sampled requests** draft a fixed k to the end: which random numbers their tokens
  use depends on the draft lengths, and the adaptive k follows timings, so only a fixed k
  makes the same seed give the same text. They never copy.

The planner makes no actor calls; it decides, the engine acts.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from services.engine.adaptive.copies import CopyCandidate, CopyPlanner, find_candidate
from services.engine.adaptive.policy import SpecPolicy
from services.engine.metrics import EngineStats
from services.engine.sequence import Sequence

log = logging.getLogger("longspark.engine")


@dataclass
class RoundPlan:
    k: int  # the network's draft length this round (0: no network)
    num_draft: list[int]  # drafts per running sequence (0: a plain step for it)
    copies: list[CopyCandidate] = field(default_factory=list)  # drafted if k == 0
    put_aside: list[int] = field(default_factory=list)  # sequences whose drafter state goes


class RoundPlanner:
    def __init__(
        self,
        k: int,
        max_len: int,
        stats: EngineStats,
        drafter: bool,
        adaptive: bool = False,
        copy_drafts: bool = False,
        probe_every: int = 256,
        any_k: bool = False,
    ) -> None:
        self.k, self.max_len, self.stats, self.probe_every = k, max_len, stats, probe_every
        self.drafter = drafter
        self.policy = SpecPolicy(k, all_or_nothing=not any_k) if drafter and adaptive else None
        self.copier = CopyPlanner(k) if self.policy and copy_drafts else None
        self.plain_only: set[int] = set()  # sequences without drafter state, plain to the end
        self.probes: set[int] = set()  # admitted with state while the drafter is aside
        self.asleep = False
        self.since_probe = 0

    # -- the two hooks --------------------------------------------------------------
    def plan(
        self,
        running: list[Sequence],
        drafting: Callable[[int], bool] | None = None,
        waiting: bool = False,
    ) -> RoundPlan:
        """This round's plan; ``drafting(seq_id)`` is False where a sequence's drafter state
        was lost (it decodes plainly); ``waiting``: a request waits for room (a slot or KV
        blocks) that a sequence ending early would free (``Scheduler.full``)."""
        k, copies, put_aside = self.k, [], []
        if self.policy:
            copies = self._plan_copies(running, waiting)
            k = self.policy.choose(len(running))
            put_aside = self._sleep_or_wake(running)
            self.since_probe += 1
        num_draft = [self._num_draft(s, k, drafting) for s in running]
        return RoundPlan(k, num_draft, copies, put_aside)

    def observe(
        self,
        plan: RoundPlan,
        num_draft: list[int],
        num_accepted: list[int],
        draft_s: float,
        verify_s: float,
        network: bool,
        copied: bool,
        taps: bool = False,
    ) -> None:
        """What the round did: ``num_draft`` as verified, whether the network drafted, whether
        the plan's copies did, whether the target returned the drafter's taps."""
        if self.policy:
            self.policy.observe(num_draft, num_accepted, draft_s, verify_s, network, taps)
        if copied:
            self.copier.observe(plan.copies, num_accepted)
            self.stats.copy_drafts += len(plan.copies)

    # -- drafter state --------------------------------------------------------------
    def has_state(self, seq_id: int) -> bool:
        return self.drafter and seq_id not in self.plain_only

    def admit(self, seqs: list[Sequence], batch: int) -> bool:
        """Whether new sequences, admitted into a batch of ``batch`` running sequences
        (themselves included), get drafter state: unless the drafter is aside or drafting
        does not pay at that batch size, when only a probe batch now and then does."""
        if not self.drafter:
            return False
        if any(keeps_k(s) for s in seqs):
            return True
        if not self.asleep and (self.policy is None or self.policy.pays_at(batch)):
            return True
        if self.since_probe < self.policy.probe_interval(batch, self.probe_every):
            return False
        self.since_probe = 0  # a probe: it drafts in the next round, then is put aside
        self.probes.update(s.seq_id for s in seqs)
        self.stats.drafter_probes += len(seqs)
        self.policy.explore_next()
        return True

    def go_plain(self, seq_ids: list[int]) -> None:
        """These sequences have (or keep) no drafter state."""
        self.plain_only.update(seq_ids)
        self.probes.difference_update(seq_ids)

    def release(self, seq_ids: list[int]) -> list[int]:
        """Sequences that left the batch; those whose drafter state is to be freed."""
        with_state = [i for i in seq_ids if self.has_state(i)]
        self.plain_only.difference_update(seq_ids)
        self.probes.difference_update(seq_ids)
        return with_state

    # -- internals ------------------------------------------------------------------
    def _plan_copies(self, running: list[Sequence], waiting: bool) -> list[CopyCandidate]:
        """The context copies worth verifying if this round goes without the network,
        priced into the policy's plain option.

        None, and no search for them, where several sequences run and no request waits for
        room (one waiting only for its turn to prefill is let in next step regardless). A
        copy's accepted tokens end its sequence sooner, and the slot it frees is what they
        buy: the copier prices them at the round's rate, as if another request took that
        slot at once. With every request already running none does, and the batch's rounds
        go on until its longest sequences end, which copies for some rows rarely shorten:
        their rows are a loss."""
        if self.copier is None or (len(running) > 1 and not waiting):
            self.policy.plain_tokens = self.policy.plain_rows = 1.0
            return []
        candidates = []
        for i, s in enumerate(running):
            if keeps_k(s):
                continue
            s.ngrams.sync(s.prompt_ids, s.output_ids)
            c = find_candidate(i, s.ngrams, self.limit(s, self.k), s.params.temperature > 0)
            if c is not None:
                candidates.append(c)
        plan = self.copier.plan(candidates, len(running), self.policy.plain_cost())
        n = len(running)  # an exploration is not priced: it is not why a round goes plain
        self.policy.plain_tokens = 1.0 + sum(self.copier.gain(c) for c in plan.worth) / n
        self.policy.plain_rows = 1.0 + sum(len(c.tokens) for c in plan.worth) / n
        return plan.copies

    def _sleep_or_wake(self, running: list[Sequence]) -> list[int]:
        """Put the drafter aside while drafting does not pay (returns the sequences whose
        state goes); take it back once it does."""
        if not self.policy.idle:
            if self.asleep:
                self.asleep = False
                log.info("drafting pays again: drafter back")
            return []
        if not self.asleep:
            self.asleep, self.since_probe = True, 0
            self.stats.drafter_sleeps += 1
            log.info("drafting does not pay here: drafter put aside")
        drop = [
            s.seq_id
            for s in running
            if s.seq_id not in self.plain_only
            and not keeps_k(s)
            and (s.stats.num_drafts > 0 or s.seq_id not in self.probes)
        ]
        self.go_plain(drop)
        return drop

    def _num_draft(self, seq: Sequence, k: int, drafting) -> int:
        """Drafts worth verifying: never past max_tokens or the context (0 = plain step)."""
        if not self.has_state(seq.seq_id) or (drafting and not drafting(seq.seq_id)):
            return 0
        return self.limit(seq, self.k if keeps_k(seq) else k)

    def limit(self, seq: Sequence, k: int) -> int:
        """At most ``k`` drafts, never past max_tokens or the context."""
        return max(0, min(k, seq.remaining - 1, self.max_len - seq.total_len - 1))


def keeps_k(seq: Sequence) -> bool:
    """Seeded sampled requests draft a fixed k to the end (see the module docstring)."""
    return seq.params.seed is not None and seq.params.temperature > 0
