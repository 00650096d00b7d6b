"""The speculative-decoding engine: continuous batching over draft -> verify -> commit rounds.

One ``step()`` admits waiting requests (one batched prefill), then runs one round for every
running sequence: the drafter proposes ``k`` tokens per sequence in one call, the target
verifies them in one batched forward and samples on rank 0 (lossless rejection sampling),
and the engine commits the returned tokens and streams them out. Plain decoding is the
same round with no drafter (zero drafts per sequence), so comparisons are like with like.

The target and drafter handles are duck-typed: in-process objects (``LocalTarget``,
``LocalDrafter``) or their Ray counterparts. ``prefill``/``verify`` return the small
``StepResult`` the engine reads and an opaque handle (a value or an ``ObjectRef``) that
goes straight to the drafter without the engine looking inside.
"""

from __future__ import annotations

import itertools
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from drafter_actor.messages import DraftRequest
from target_actor.batch import PrefillBatch, SeqSampling, StepResult, VerifyBatch
from target_actor.config import TargetConfigError

from .metrics import EngineStats
from .sampling import InvalidRequest, SamplingParams
from .scheduler import Scheduler
from .sequence import RequestOutput, SeqStatus, Sequence
from .spec_policy import SpecPolicy
from .stopping import StopChecker
from .tokenizer import Tokenizer

log = logging.getLogger("longspark.engine")


@dataclass
class EngineConfig:
    k: int = 15  # draft tokens per round (spec mode)
    max_num_seqs: int = 32
    max_prefill_seqs: int = 8
    drafter_name: str = ""  # for reports: a folder, "random", or "" in plain mode
    adaptive: bool = False  # pick each round's k (0 = plain) from measured acceptance and cost

    def __post_init__(self) -> None:
        if self.k < 1 or self.max_num_seqs < 1 or self.max_prefill_seqs < 1:
            raise ValueError("k, max_num_seqs and max_prefill_seqs must be >= 1")


class Engine:
    def __init__(
        self,
        target: Any,
        tokenizer: Tokenizer,
        drafter: Any | None = None,
        config: EngineConfig | None = None,
    ) -> None:
        self.target, self.drafter, self.tok = target, drafter, tokenizer
        self.config = config or EngineConfig()
        self.cfg = target.cfg
        self.max_len = self.cfg.max_position_embeddings
        self.eos = self.cfg.eos_token_ids or (
            (tokenizer.eos_token_id,) if tokenizer.eos_token_id is not None else ()
        )
        self.scheduler = Scheduler(
            target.kv_capacity_tokens(),
            self.config.max_num_seqs,
            self.config.max_prefill_seqs,
            self.config.k + 1,
            self.max_len,
        )
        self.stats = EngineStats()
        self.requests: dict[str, Sequence] = {}
        self._ids = itertools.count()
        self._updates: Any = None  # the last verify's RoundUpdates handle, for the drafter
        # A fault-tolerant drafter handle (``services.serve_drafter``) may lose sequences'
        # state when its actor dies: ``drafting(seq_id)`` is then False and they go on plain.
        self._drafting: Callable[[int], bool] = getattr(drafter, "drafting", lambda seq_id: True)
        # Adaptive k needs a drafter that can take a plain round's updates without drafting.
        self.policy = (
            SpecPolicy(self.config.k)
            if drafter is not None and self.config.adaptive and hasattr(drafter, "update")
            else None
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
        request_id = request_id or uuid.uuid4().hex
        if request_id in self.requests:
            raise InvalidRequest(f"request id {request_id!r} is already in use")
        stopper = StopChecker(
            self.eos, params.max_tokens, params.stop, params.ignore_eos, self.max_len
        )
        seq = Sequence(next(self._ids), request_id, list(prompt_ids), params, stopper, on_output)
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
            was_running = seq.status is SeqStatus.RUNNING
            self._finish(seq, "abort")
            if was_running:
                self._release([seq])

    def has_unfinished(self) -> bool:
        return bool(self.scheduler.waiting or self.scheduler.running)

    # -- the round ----------------------------------------------------------------
    def step(self) -> None:
        """Admit and prefill new requests, then one draft -> verify -> commit round."""
        self._prefill(self.scheduler.admit())
        running = list(self.scheduler.running)
        if not running:
            return
        t0 = time.perf_counter()
        k = self.policy.choose(len(running)) if self.policy else self.config.k
        num_draft = [self._num_draft(s, k) for s in running]
        batch = VerifyBatch(
            [s.seq_id for s in running],
            [s.anchor for s in running],
            [s.cache_len for s in running],
            num_draft,
            want_updates=self.drafter is not None,
        )
        proposal = None
        if self.drafter is not None and max(num_draft) > 0:
            requests = [
                DraftRequest(s.seq_id, s.anchor, s.cache_len, s.params.temperature) for s in running
            ]
            proposal = self.drafter.propose(requests, max(num_draft), self._updates)
            if proposal is None:  # the drafter failed this round: verify zero drafts
                num_draft = batch.num_draft = [0] * len(running)
        elif self.drafter is not None and self._updates is not None and self.policy:
            self.drafter.update(self._updates)  # a plain round: keep the drafter's views current
        t1 = time.perf_counter()
        result, self._updates = self.target.verify(batch, proposal)
        t2 = time.perf_counter()
        if self.policy:
            self.policy.observe(num_draft, result.num_accepted, t1 - t0, t2 - t1)
        self._commit(running, result, num_draft)
        self.stats.observe_round(
            draft_s=t1 - t0,
            verify_s=t2 - t1,
            round_s=time.perf_counter() - t0,
            num_draft=num_draft,
            num_accepted=result.num_accepted,
        )

    def _num_draft(self, seq: Sequence, k: int) -> int:
        """Drafts worth verifying: never past max_tokens or the context (0 = plain step).

        A seeded sampled request always drafts ``config.k``: which random numbers its
        tokens use depends on the draft lengths, and the adaptive ``k`` follows timings,
        so only a fixed ``k`` makes the same seed give the same text.
        """
        if self.drafter is None or not self._drafting(seq.seq_id):
            return 0
        if seq.params.seed is not None and seq.params.temperature > 0:
            k = self.config.k
        return max(0, min(k, seq.remaining - 1, self.max_len - seq.total_len - 1))

    def _prefill(self, seqs: list[Sequence]) -> None:
        if not seqs:
            return
        batch = PrefillBatch(
            [s.seq_id for s in seqs],
            [s.prompt_ids for s in seqs],
            [
                SeqSampling(s.params.temperature, s.params.top_k, s.params.top_p, s.params.seed)
                for s in seqs
            ],
            want_views=self.drafter is not None,
        )
        result, views = self.target.prefill(batch)
        if self.drafter is not None:
            self.drafter.prefill(views)
        now = time.monotonic()
        for s in seqs:
            s.first_token_time = now
        self._commit(seqs, result, [0] * len(seqs), count=False)

    def _commit(
        self, seqs: list[Sequence], result: StepResult, num_draft: list[int], count: bool = True
    ) -> None:
        done: list[Sequence] = []
        for seq, tokens, m, nd in zip(
            seqs, result.committed, result.num_accepted, num_draft, strict=True
        ):
            if count:
                seq.stats.observe(nd, m)
            seq.output_ids.extend(tokens)
            reason, keep = seq.stopper.check_tokens(seq.output_ids, len(tokens), seq.total_len)
            if reason is not None:
                del seq.output_ids[keep:]
            text, stop_cut = self._text(seq)
            if stop_cut is not None:
                reason, text = "stop", text[:stop_cut]
            if reason is not None:
                self._finish(seq, reason, text)
                done.append(seq)
            else:
                self._emit(seq, text)
        self._release(done)

    def _text(self, seq: Sequence) -> tuple[str, int | None]:
        text = self.tok.decode(seq.output_ids)
        cut = seq.stopper.check_text(text, len(seq.emitted_text))
        return text, (cut if cut >= 0 else None)

    def _emit(self, seq: Sequence, text: str, final: bool = False) -> None:
        """Stream the new tokens and text; hold back what may still become a stop string."""
        if not final:
            text = text.rstrip("\ufffd")  # an incomplete UTF-8 character comes next round
            if seq.stopper.holdback:
                text = text[: max(len(seq.emitted_text), len(text) - seq.stopper.holdback)]
        new_ids = seq.output_ids[seq.emitted_tokens :]
        new_text = text[len(seq.emitted_text) :]
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
                )
            )

    def _finish(self, seq: Sequence, reason: str, text: str | None = None) -> None:
        seq.finish_reason, seq.finish_time = reason, time.monotonic()
        self.scheduler.finish(seq)
        self._emit(seq, self.tok.decode(seq.output_ids) if text is None else text, final=True)
        self.requests.pop(seq.request_id, None)
        self.stats.observe_finish(seq)

    def _release(self, seqs: list[Sequence]) -> None:
        """Free the target KV and drafter state of sequences that left the running batch."""
        if not seqs:
            return
        ids = [s.seq_id for s in seqs]
        self.target.free(ids)
        if self.drafter is not None:
            self.drafter.free(ids)

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
