"""The speculative-decoding engine: continuous batching over draft -> verify -> commit rounds.

One ``step()`` gives every running sequence KV room for its next round (preempting the
newest when the pool runs out: ``services.engine.scheduler``), admits waiting requests
(one batched prefill; preempted ones recompute their KV), then runs one round for every
running sequence: the drafter proposes ``k`` tokens per sequence in one call, the target
verifies them in one batched forward and samples on rank 0 (lossless rejection sampling),
and the engine commits the returned tokens and streams them out. Plain decoding is the
same round with no drafter (zero drafts per sequence), so comparisons are like with like.
What each round drafts (k, copies, the drafter put aside) is the planner's
(``services.engine.adaptive.planner``): ``plan`` before the round, ``observe`` after it.

The target and drafter are driven through their handle protocols
(``target_actor.handle.TargetHandle``, ``drafter_actor.handle.DrafterHandle``),
in-process or over Ray alike. ``prefill``/``verify`` return the small ``StepResult`` the
engine reads and the drafter's messages, which go to the drafter without the engine
looking inside.
"""

from __future__ import annotations

import itertools
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from drafter_actor.handle import DrafterHandle
from services.engine.adaptive.copies import copy_proposal
from services.engine.adaptive.planner import RoundPlan, RoundPlanner
from services.engine.detokenizer import IncrementalDetokenizer
from services.engine.errors import is_fatal, user_error_message
from services.engine.metrics import EngineStats
from services.engine.params import InvalidRequest, SamplingParams
from services.engine.scheduler import Scheduler
from services.engine.sequence import OutputLogprob, RequestOutput, SeqStatus, Sequence
from services.engine.stopping import StopChecker
from services.engine.structured import GrammarChecker
from services.engine.tokenizer import Tokenizer
from target_actor.batch import PrefillBatch, ResumeBatch, StepResult, TokenLogprobs, VerifyBatch
from target_actor.config import TargetConfigError
from target_actor.handle import TargetHandle
from target_actor.messages import DraftRequest, Proposal, scatter_proposal

log = logging.getLogger("longspark.engine")


@dataclass
class EngineConfig:
    k: int = 15  # draft tokens per round (spec mode)
    max_num_seqs: int = 32
    max_prefill_seqs: int = 8
    drafter_name: str = ""  # for reports: a folder, "random", or "" in plain mode
    adaptive: bool = False  # pick each round's k (0 = plain) from measured acceptance and cost
    probe_every: int = 256  # adaptive, drafter aside: rounds between probe sequences
    # adaptive: rounds without the network draft context copies where they pay
    copy_drafts: bool = False
    # adaptive: consider every k in 0..k; False: only 0 or k, for fp32 MKL-packed GEMMs,
    # whose middle row counts cost more than a full block (adaptive/policy.py, _choices)
    any_k: bool = False

    def __post_init__(self) -> None:
        if min(self.k, self.max_num_seqs, self.max_prefill_seqs, self.probe_every) < 1:
            raise ValueError("k, max_num_seqs, max_prefill_seqs and probe_every must be >= 1")


class Engine:
    def __init__(
        self,
        target: TargetHandle,
        tokenizer: Tokenizer,
        drafter: DrafterHandle | None = None,
        config: EngineConfig | None = None,
    ) -> None:
        self.target, self.drafter, self.tok = target, drafter, tokenizer
        self.config = config or EngineConfig()
        self.cfg = target.cfg
        self.max_len = self.cfg.max_position_embeddings
        self.eos = self.cfg.eos_token_ids or (
            (tokenizer.eos_token_id,) if tokenizer.eos_token_id is not None else ()
        )
        kv = target.kv_stats()
        self.scheduler = Scheduler(
            kv["total_blocks"],
            kv["block_size"],
            self.config.max_num_seqs,
            self.config.max_prefill_seqs,
            self.config.k + 1,
            self.max_len,
        )
        self.stats = EngineStats()
        self.requests: dict[str, Sequence] = {}
        self._ids = itertools.count()
        self._updates: Any = None  # the last verify's RoundUpdates handle, for the drafter
        self._grammars: GrammarChecker | None = None  # built at the first structured request
        self.planner = RoundPlanner(
            self.config.k,
            self.max_len,
            self.stats,
            drafter is not None,
            self.config.adaptive,
            self.config.copy_drafts,
            self.config.probe_every,
            self.config.any_k,
        )
        if drafter is not None:
            target.set_summary_queries(drafter.summary_queries())

    @property
    def mode(self) -> str:
        return "ar" if self.drafter is None else "spec"

    # -- requests -----------------------------------------------------------------
    def add_request(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        on_output: Callable[[RequestOutput], None] | None = None,
    ) -> Sequence:
        """Validate and queue a request; raises ``InvalidRequest`` / ``TargetConfigError``."""
        if not prompt_ids:
            raise InvalidRequest("the prompt is empty", "prompt")
        if len(prompt_ids) >= self.max_len:
            raise TargetConfigError(
                f"the prompt has {len(prompt_ids)} tokens; the model's context is {self.max_len} tokens"
            )
        if any(not 0 <= t < self.cfg.vocab_size for t in prompt_ids):
            raise InvalidRequest("prompt token id outside the vocabulary", "prompt")
        params.check_vocab(self.cfg.vocab_size)
        if params.grammar is not None:
            if self._grammars is None:
                self._grammars = GrammarChecker(self.tok.hf, tuple(self.eos))
            self._grammars.check(params.grammar, params.grammar_field)
        request_id = request_id or uuid.uuid4().hex
        if request_id in self.requests:
            raise InvalidRequest(f"request id {request_id!r} is already in use")
        stopper = StopChecker(
            self.eos,
            params.max_tokens,
            params.stop,
            params.ignore_eos,
            self.max_len,
            params.stop_token_ids,
            params.min_tokens,
            params.include_stop_str_in_output,
        )
        seq = Sequence(
            next(self._ids),
            request_id,
            list(prompt_ids),
            params,
            stopper,
            on_output,
            detokenizer=IncrementalDetokenizer(self._decoder(params.skip_special_tokens)),
        )
        if not self.scheduler.can_ever_fit(seq):
            raise InvalidRequest(
                "prompt plus max_tokens exceed the KV cache capacity", "max_tokens"
            )
        self.requests[request_id] = seq
        self.scheduler.add(seq)
        return seq

    def abort(self, request_id: str) -> None:
        seq = self.requests.get(request_id)
        if seq is not None and seq.status is not SeqStatus.FINISHED:
            # a preempted sequence waits without KV, its sampling state still on the ranks
            started = seq.status is SeqStatus.RUNNING or seq.preemptions > 0
            self._finish(seq, "abort")
            if started:
                self._release([seq])

    def has_unfinished(self) -> bool:
        return bool(self.scheduler.waiting or self.scheduler.running)

    # -- the round ----------------------------------------------------------------
    def step(self) -> None:
        """KV room for every running sequence (or preemption), admission (prefill new
        requests, recompute preempted ones), then one draft -> verify -> commit round.

        A round that raises for some sequences never fails the others (see ``_apart``):
        only the sequences that fail on their own finish, with an error.
        """
        preempted = self.scheduler.grow()
        if preempted:
            self._preempt(preempted)  # and admit nobody this step: the pool is short
        admitted = [] if preempted else self.scheduler.admit()
        resumed = [s for s in admitted if s.output_ids]  # before prefill gives the rest one
        self._prefill([s for s in admitted if not s.output_ids])
        self._resume(resumed)
        running = list(self.scheduler.running)
        if running:
            self._round(running)

    def _round(self, running: list[Sequence]) -> None:
        """Plan -> draft -> verify -> commit -> observe, for every running sequence."""
        t0 = time.perf_counter()
        plan = self.planner.plan(
            running,
            self.drafter.drafting if self.drafter else None,
            self.scheduler.full(),
        )
        if plan.put_aside:  # the drafter is put aside: these sequences go on plainly
            self.drafter.free(plan.put_aside)
        batch = VerifyBatch(
            [s.seq_id for s in running],
            [s.anchor for s in running],
            [s.cache_len for s in running],
            plan.num_draft,
            want_updates=self._wants_updates(running),
            capacity=[self.scheduler.granted(s) for s in running],
        )
        proposal, copied = self._draft(running, batch, plan)
        t1 = time.perf_counter()
        try:
            result, self._updates = self.target.verify(batch, proposal)
        except Exception as exc:  # noqa: BLE001 - contained per sequence unless fatal
            if is_fatal(exc):
                raise
            self._apart(running, batch, proposal, exc)
            return
        t2 = time.perf_counter()
        self._commit(running, result, batch.num_draft)
        network = proposal is not None and not copied
        self.planner.observe(
            plan,
            batch.num_draft,
            result.num_accepted,
            t1 - t0,
            t2 - t1,
            network,
            copied,
            batch.want_updates,
        )
        self.stats.observe_round(
            t1 - t0, t2 - t1, time.perf_counter() - t0, batch.num_draft, result.num_accepted
        )

    def _draft(
        self, running: list[Sequence], batch: VerifyBatch, plan: RoundPlan
    ) -> tuple[Proposal | None, bool]:
        """The round's proposal (None: a plain round; ``batch.num_draft`` follows it) and
        whether it holds engine-side copies. The last verify's updates reach the drafter
        here, and only here: a round that fails later must not hand them over twice."""
        updates, self._updates = self._updates, None
        if self.drafter is None:
            return None, False
        if max(batch.num_draft) > 0:
            rows = [i for i, s in enumerate(running) if self.planner.has_state(s.seq_id)]
            requests = [
                DraftRequest(s.seq_id, s.anchor, s.cache_len, s.params.temperature)
                for s in (running[i] for i in rows)
            ]
            try:
                proposal = self.drafter.propose(requests, max(batch.num_draft), updates)
            except Exception as exc:  # noqa: BLE001 - a plain round instead, unless fatal
                if is_fatal(exc):
                    raise
                self._drafter_failed(running, batch, exc)
                return None, False
            if proposal is None:  # the drafter failed this round: verify zero drafts
                batch.num_draft = [0] * len(running)
                return None, False
            return scatter_proposal(proposal, rows, len(running)), False
        if updates is not None:
            self._hand_over(updates, running)  # keep the drafter's views current
        if plan.copies:  # a round without the network: the planned copies draft
            batch.num_draft, proposal = copy_proposal(plan.copies, len(running))
            return proposal, True
        return None, False

    def _drafter_failed(self, running: list[Sequence], batch: VerifyBatch, exc: Exception) -> None:
        """An in-process drafter raised mid-propose: this round verifies no drafts."""
        self._set_aside(running, exc)
        batch.num_draft = [0] * len(running)
        batch.want_updates = self._wants_updates(running)

    def _hand_over(self, updates: Any, seqs: list[Sequence]) -> None:
        """A verify's updates to the drafter outside a propose (plain rounds, split rounds)."""
        try:
            self.drafter.update(updates)
        except Exception as exc:  # noqa: BLE001 - these sequences go on plainly, unless fatal
            if is_fatal(exc):
                raise
            self._set_aside(seqs, exc)

    def _set_aside(self, seqs: list[Sequence], exc: Exception) -> None:
        """The drafter raised: its views of these sequences may be half-updated, so they
        lose their drafter state and go on plainly (still exact)."""
        log.warning("the drafter failed (%s); %d sequences go on plainly", exc, len(seqs))
        self.stats.drafter_errors += 1
        drop = [s.seq_id for s in seqs if self.planner.has_state(s.seq_id)]
        if drop:
            self.planner.go_plain(drop)
            try:
                self.drafter.free(drop)
            except Exception:  # noqa: BLE001 - the state is dropped either way
                log.exception("could not free the drafter state of %s", drop)

    def _apart(
        self, seqs: list[Sequence], batch: VerifyBatch, proposal: Proposal | None, exc: Exception
    ) -> None:
        """The verify of ``seqs`` raised: verify parts apart, each with its rows of the same
        proposal (``_bisect``). The others lose nothing: each forward first rolls the KV
        cache back to the round's start, the verifier restores its seeded generators when
        sampling raises, and the drafter takes every part's updates, so their tokens are
        the ones the whole round would have given."""

        def verify(rows: list[int]) -> None:
            part = [seqs[i] for i in rows]
            sub = batch.select(rows)
            sub.want_updates = self._wants_updates(part)
            result, updates = self.target.verify(sub, _select(proposal, rows))
            self._commit(part, result, sub.num_draft)  # contained per sequence: never raises
            self.stats.observe_tokens(sub.num_draft, result.num_accepted)
            if sub.want_updates:
                self._hand_over(updates, part)

        self._bisect(seqs, exc, verify, "a round")

    def _bisect(
        self,
        seqs: list[Sequence],
        exc: Exception,
        run: Callable[[list[int]], None],
        what: str,
    ) -> None:
        """``run`` over all of ``seqs`` raised ``exc``: run their halves apart (``run`` takes
        indices into ``seqs``), and so on down to the sequences that fail alone, which
        finish with their error; the rest go on."""
        if len(seqs) == 1:
            log.warning("request %s failed alone in %s: %s", seqs[0].request_id, what, exc)
            self.stats.isolated_failures += 1
            self._fail(seqs[0], exc)
            return
        self.stats.split_rounds += 1
        half = len(seqs) // 2
        for rows in (list(range(half)), list(range(half, len(seqs)))):
            try:
                run(rows)
            except Exception as e:  # noqa: BLE001 - contained per sequence unless fatal
                if is_fatal(e):
                    raise
                part = [seqs[i] for i in rows]
                self._bisect(part, e, lambda sub, rows=rows: run([rows[j] for j in sub]), what)

    def _wants_updates(self, seqs: list[Sequence]) -> bool:
        return any(self.planner.has_state(s.seq_id) for s in seqs)

    def _prefill(self, seqs: list[Sequence]) -> None:
        """Prefill ``seqs`` together; if that raises, parts apart (``_bisect``). Prefill is
        idempotent: the KV cache restarts at 0, generators and drafter views are made anew."""
        if not seqs:
            return
        # decided once: retried parts keep it
        with_drafter = self.planner.admit(seqs, len(self.scheduler.running))
        try:
            self._prefill_batch(seqs, with_drafter)
        except Exception as exc:  # noqa: BLE001 - contained per sequence unless fatal
            if is_fatal(exc):
                raise

            def retry(rows: list[int]) -> None:
                self._prefill_batch([seqs[i] for i in rows], with_drafter)

            self._bisect(seqs, exc, retry, "prefill")

    def _prefill_batch(self, seqs: list[Sequence], with_drafter: bool) -> None:
        batch = PrefillBatch(
            [s.seq_id for s in seqs],
            [s.prompt_ids for s in seqs],
            [s.params.target_sampling(self.eos) for s in seqs],
            want_views=with_drafter,
            capacity=[self.scheduler.granted(s) for s in seqs],
        )
        result, views = self.target.prefill(batch)
        if batch.want_views:
            self.drafter.prefill(views)
        else:
            self.planner.go_plain([s.seq_id for s in seqs])
        now = time.monotonic()
        for s in seqs:
            s.first_token_time = now
        for s, entries in zip(seqs, result.prompt_logprobs or [None] * len(seqs), strict=True):
            if entries is not None:
                first = s.prompt_ids[0]
                s.prompt_logprobs = [
                    OutputLogprob(self.tok.decode([first], skip_special_tokens=False), first, None),
                    *self._render_logprobs(s.prompt_ids[1:], entries),
                ]
        self._commit(seqs, result, [0] * len(seqs), count=False)

    def _preempt(self, seqs: list[Sequence]) -> None:
        """The scheduler took these sequences' KV blocks: the ranks drop their caches (and
        keep their sampling state), the drafter its views; they wait to be recomputed.
        The last round's drafter updates for them are dropped with their state, and they
        come back no sooner than the next step, after those updates went out."""
        ids = [s.seq_id for s in seqs]
        log.info("KV cache short: preempting %d sequences (recompute)", len(ids))
        self.stats.preemptions += len(ids)
        self.target.preempt(ids)
        with_state = self.planner.release(ids)
        if with_state:
            self.drafter.free(with_state)

    def _resume(self, seqs: list[Sequence]) -> None:
        """Recompute preempted sequences' KV caches (and drafter views) together; if that
        raises, parts apart (``_bisect``). Nothing is sampled, nothing streamed: the next
        round goes on from their last token as the uninterrupted run would have."""
        if not seqs:
            return
        with_drafter = self.planner.admit(seqs, len(self.scheduler.running))
        try:
            self._resume_batch(seqs, with_drafter)
        except Exception as exc:  # noqa: BLE001 - contained per sequence unless fatal
            if is_fatal(exc):
                raise

            def retry(rows: list[int]) -> None:
                self._resume_batch([seqs[i] for i in rows], with_drafter)

            self._bisect(seqs, exc, retry, "resume")

    def _resume_batch(self, seqs: list[Sequence], with_drafter: bool) -> None:
        batch = ResumeBatch(
            [s.seq_id for s in seqs],
            [s.prompt_ids + s.output_ids[:-1] for s in seqs],
            [len(s.prompt_ids) for s in seqs],
            [self.scheduler.granted(s) for s in seqs],
            want_views=with_drafter,
        )
        views = self.target.resume(batch)
        if batch.want_views:
            self.drafter.prefill(views)
        else:
            self.planner.go_plain(batch.seq_ids)

    def _commit(
        self, seqs: list[Sequence], result: StepResult, num_draft: list[int], count: bool = True
    ) -> None:
        """Append each sequence's tokens, stream them, finish the ones that stopped. A
        sequence whose commit raises (its stop rules, its text) finishes alone."""
        done: list[Sequence] = []
        logprobs = result.logprobs or [None] * len(seqs)
        for seq, tokens, m, nd, lps in zip(
            seqs, result.committed, result.num_accepted, num_draft, logprobs, strict=True
        ):
            try:
                if lps is not None:
                    seq.logprobs.extend(self._render_logprobs(tokens, lps))
                if self._commit_one(seq, tokens, m, nd, count):
                    done.append(seq)
            except Exception as exc:  # noqa: BLE001 - this sequence's failure alone
                if is_fatal(exc):
                    raise
                log.warning("request %s failed alone in commit: %s", seq.request_id, exc)
                self.stats.isolated_failures += 1
                self._fail(seq, exc)
        self._release(done)

    def _commit_one(self, seq: Sequence, tokens: list[int], m: int, nd: int, count: bool) -> bool:
        """Commit one sequence's round; True if it finished."""
        if count:
            seq.stats.observe(nd, m)
        seq.output_ids.extend(tokens)
        reason, keep = seq.stopper.check_tokens(seq.output_ids, len(tokens), seq.total_len)
        if reason is not None:
            del seq.output_ids[keep:]
            del seq.logprobs[keep:]
        text, stop_cut = self._text(seq)
        if stop_cut is not None:
            reason, text = "stop", text[:stop_cut]
        if reason is None:
            self._emit(seq, text)
            return False
        self._finish(seq, reason, text)
        return True

    def _decoder(self, skip_special_tokens: bool) -> Callable[[list[int]], str]:
        if skip_special_tokens:
            return self.tok.decode
        return lambda ids: self.tok.decode(ids, skip_special_tokens=False)

    def _render_logprobs(
        self, tokens: list[int], entries: list[TokenLogprobs]
    ) -> list[OutputLogprob]:
        """The target's log-probabilities with each token's text (a token alone, special
        tokens spelt out, as vLLM shows them)."""

        def text(t: int) -> str:
            return self.tok.decode([t], skip_special_tokens=False)

        return [
            OutputLogprob(
                text(t),
                t,
                e.logprob,
                [(text(i), i, v) for i, v in zip(e.top_ids, e.top_logprobs, strict=True)],
                e.rank,
            )
            for t, e in zip(tokens, entries, strict=True)
        ]

    def _text(self, seq: Sequence) -> tuple[str, int | None]:
        text = seq.detokenizer.text(seq.output_ids)
        cut = seq.stopper.check_text(text, len(seq.emitted_text), len(seq.output_ids))
        return text, (cut if cut >= 0 else None)

    def _emit(self, seq: Sequence, text: str, final: bool = False) -> None:
        """Stream the new tokens and text; hold back what may still become a stop string."""
        if not final:
            text = text.rstrip("\ufffd")  # an incomplete UTF-8 character comes next round
            if seq.stopper.holdback:
                text = text[: max(len(seq.emitted_text), len(text) - seq.stopper.holdback)]
        new_ids = seq.output_ids[seq.emitted_tokens :]
        new_logprobs = (
            seq.logprobs[seq.emitted_tokens :] if seq.params.logprobs is not None else None
        )
        new_text = text[len(seq.emitted_text) :]
        prompt_logprobs = seq.prompt_logprobs if seq.emitted_tokens == 0 else None
        seq.emitted_tokens, seq.emitted_text = len(seq.output_ids), text
        if seq.on_output is not None and (new_ids or new_text or final):
            seq.on_output(
                RequestOutput(
                    seq.request_id,
                    new_ids,
                    new_text,
                    final,
                    seq.finish_reason,
                    text,
                    list(seq.output_ids),
                    len(seq.prompt_ids),
                    seq.stats if final else None,
                    seq.error if final else None,
                    new_logprobs,
                    list(seq.logprobs) if final and new_logprobs is not None else None,
                    prompt_logprobs,
                )
            )

    def _finish(self, seq: Sequence, reason: str, text: str | None = None) -> None:
        seq.finish_reason, seq.finish_time = reason, time.monotonic()
        self.scheduler.finish(seq)
        self._emit(seq, seq.detokenizer.text(seq.output_ids) if text is None else text, final=True)
        self.requests.pop(seq.request_id, None)
        self.stats.observe_finish(seq)

    def _fail(self, seq: Sequence, exc: BaseException) -> None:
        """Finish ``seq`` alone with the error (its stream gets ``RequestOutput.error``)
        and free its state, even if telling its stream fails too."""
        seq.error = f"the engine failed on this request: {user_error_message(exc)}"
        try:
            self._finish(seq, "error", seq.emitted_text)
        except Exception:  # noqa: BLE001 - its stream is broken: drop it from the engine
            log.exception("could not report the failure of %s", seq.request_id)
            self.scheduler.finish(seq)
            self.requests.pop(seq.request_id, None)
        self._release([seq])

    def _release(self, seqs: list[Sequence]) -> None:
        """Free the target KV and drafter state of sequences that left the running batch."""
        if not seqs:
            return
        ids = [s.seq_id for s in seqs]
        self.target.free(ids)
        with_state = self.planner.release(ids)
        if with_state:
            self.drafter.free(with_state)

    # -- convenience --------------------------------------------------------------
    def generate(
        self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]
    ) -> list[RequestOutput]:
        """Run requests to completion (offline use, tests, benchmarks)."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        finals: dict[str, RequestOutput] = {}
        order = []
        for ids, p in zip(prompts, plist, strict=True):
            seq = self.add_request(
                ids,
                p,
                on_output=lambda out: out.finished and finals.__setitem__(out.request_id, out),
            )
            order.append(seq.request_id)
        while self.has_unfinished():
            self.step()
        return [finals[r] for r in order]


def _select(proposal: Proposal | None, rows: list[int]) -> Proposal | None:
    """The proposal's ``rows`` (a part of a round verified apart)."""
    if proposal is None:
        return None
    index = torch.tensor(rows, dtype=torch.long, device=proposal.tokens.device)
    return Proposal(proposal.tokens[index], proposal.q_ids[index], proposal.q_probs[index])
