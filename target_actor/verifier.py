"""The target's side of a speculative round: prefill and verify, on every TP rank.

Every rank runs the same forward; rank 0 alone samples (rejection sampling against the
drafter's proposal) and builds the messages for the drafter. The per-sequence sampling
settings and seeded generators live here, next to the sampling, so a seeded request is
reproducible whatever else shares its batch. The target probabilities ``p`` never leave
this process: the engine gets tokens and counts (``StepResult``), the drafter gets
fixed-size views (``PrefillViews`` / ``RoundUpdate``). A sequence with penalties, a
logit bias or ``min_tokens`` also keeps its token history here (``TokenHistory``), and
log-probabilities are read off the raw logits of the rows its tokens were sampled from.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools

import torch

from target_actor.batch import (
    ForwardBatch,
    PrefillBatch,
    ResumeBatch,
    SeqSampling,
    StepResult,
    VerifyBatch,
)
from target_actor.grammar import GrammarState, ll_tokenizer
from target_actor.logits_processors import TokenHistory
from target_actor.messages import PrefillViews, Proposal, RoundUpdate
from target_actor.model import EXACT_ROWS
from target_actor.rejection import rejection_sample
from target_actor.runner import TargetRunner
from target_actor.sampling import token_logprobs
from target_actor.summary import (
    build_round_update,
    empty_summary,
    history_tensor,
    update_summary,
)

PREFILL_TOKENS = 1024  # prompt tokens per prefill forward (and its chunk grid): bounds activations


class _ViewBuilder:
    """Accumulates one prompt's drafter views chunk by chunk: summary, window, boundary."""

    def __init__(self, g: torch.Tensor, window: int, head_dim: int) -> None:
        self.g, self.window, self.scale = g, window, head_dim**-0.5
        self.m, self.lam = empty_summary(*g.shape, device=g.device)
        self.win_k: torch.Tensor | None = None
        self.win_v: torch.Tensor | None = None
        self.boundary: torch.Tensor | None = None
        self.length = 0

    def add(self, k: torch.Tensor, v: torch.Tensor, hidden: torch.Tensor) -> None:
        """Rows ``k``, ``v`` ``[L, n, H_kv, hd]`` and ``hidden`` ``[n, L, d]`` of the next chunk."""
        self.m, self.lam = update_summary(self.m, self.lam, self.g, k, v, self.scale)
        self.win_k = k if self.win_k is None else torch.cat([self.win_k, k], dim=1)
        self.win_v = v if self.win_v is None else torch.cat([self.win_v, v], dim=1)
        self.win_k, self.win_v = self.win_k[:, -self.window :], self.win_v[:, -self.window :]
        self.boundary = hidden[-1]
        self.length += k.shape[1]

    def build(self, seq_id: int, seed: int | None, prompt: list[int]) -> PrefillViews:
        return PrefillViews(
            seq_id=seq_id,
            length=self.length,
            window_k=self.win_k.contiguous(),
            window_v=self.win_v.contiguous(),
            summary_m=self.m,
            summary_lam=self.lam,
            boundary=self.boundary.clone(),
            seed=seed,
            tokens=history_tensor(prompt),
        )


class Verifier:
    def __init__(self, runner: TargetRunner, window: int = 256) -> None:
        self.runner, self.cfg, self.window = runner, runner.cfg, window
        self.device = runner.device
        self.is_driver = runner.tp.rank == 0
        self.sampling: dict[int, SeqSampling] = {}
        self.generators: dict[int, torch.Generator | None] = {}
        self.history: dict[int, TokenHistory] = {}  # sequences with logits processors
        self.grammars: dict[int, GrammarState] = {}  # sequences with structured output
        self.prompt_lens: dict[int, int] = {}  # of the sequences with either
        self.summary_queries: torch.Tensor | None = None  # G [L, H, R, hd], set by the engine

    def set_summary_queries(self, g: torch.Tensor | None) -> None:
        self.summary_queries = None if g is None else g.to(self.device, torch.float32)

    # -- prefill ------------------------------------------------------------------
    @torch.inference_mode()
    def prefill(self, batch: PrefillBatch) -> tuple[StepResult | None, list[PrefillViews] | None]:
        """Run the prompts (packed into ragged forwards of at most ``PREFILL_TOKENS`` tokens,
        long ones split into chunks), sample each first token, build each drafter's views."""
        for seq_id, sampling, prompt in zip(
            batch.seq_ids, batch.sampling, batch.prompts, strict=True
        ):
            self.sampling[seq_id] = sampling
            self.generators[seq_id] = (
                None
                if sampling.seed is None
                else torch.Generator(self.device).manual_seed(sampling.seed)
            )
            self._drop_state(seq_id)
            if not self.is_driver:
                continue
            if sampling.penalised:
                self.history[seq_id] = TokenHistory(
                    sampling, prompt, self.cfg.vocab_size, self.device
                )
            if sampling.grammar is not None:
                tokenizer = ll_tokenizer(self.runner.spec.path, tuple(self.cfg.eos_token_ids))
                self.grammars[seq_id] = GrammarState(sampling.grammar, tokenizer)
            if seq_id in self.history or seq_id in self.grammars:
                self.prompt_lens[seq_id] = len(prompt)
        taps = batch.want_views and self.summary_queries is not None
        prompts = dict(zip(batch.seq_ids, batch.prompts, strict=True))
        cap = dict(zip(batch.seq_ids, batch.capacity or [None] * len(batch.seq_ids), strict=True))
        # the same prompt twice in a batch (n choices of one request) runs once; the other
        # copies are forked from it after the forward (same bits: the chunk grid does not
        # depend on the batch). Prompt log-probabilities need their own rows.
        leader_of: dict[tuple[int, ...], int] = {}
        copies: dict[int, int] = {}
        for seq_id in batch.seq_ids:
            if self.sampling[seq_id].prompt_logprobs is not None:
                continue
            key = tuple(prompts[seq_id])
            if key in leader_of:
                copies[seq_id] = leader_of[key]
            else:
                leader_of[key] = seq_id
        progress = {s: 0 for s in batch.seq_ids if s not in copies}
        views = (
            {
                s: _ViewBuilder(self.summary_queries, self.window, self.cfg.head_dim)
                for s in progress
            }
            if taps
            else {}
        )
        shared = set(copies.values())
        last_logits: dict[int, torch.Tensor] = {}
        # prompt log-probabilities: every row of the prompt, read chunk by chunk
        prompt_lps = {s: [] for s in batch.seq_ids if self.sampling[s].prompt_logprobs is not None}
        while progress:
            # chunks lie on a grid of PREFILL_TOKENS from each prompt's start, whatever it
            # is batched with: the attention over a chunk (SDPA) rounds by the chunk's
            # extent, so a batch-dependent split would change the prompt's KV bits, and
            # through bf16 GEMM inputs the answer. A chunk that does not fit waits.
            ids, chunks, budget = [], [], PREFILL_TOKENS
            for seq_id, done in progress.items():
                chunk = prompts[seq_id][done : done + PREFILL_TOKENS]
                if ids and len(chunk) > budget:
                    continue
                ids.append(seq_id)
                chunks.append(chunk)
                budget -= len(chunk)
                if budget <= 0:
                    break
            ends = [
                progress[s] + len(c) == len(prompts[s]) for s, c in zip(ids, chunks, strict=True)
            ]
            out = self.runner.forward(
                ForwardBatch(
                    seq_ids=ids,
                    token_ids=self._ids([t for c in chunks for t in c]),
                    num_new=[len(c) for c in chunks],
                    start_pos=[progress[s] for s in ids],
                    num_logits=[
                        len(c) if s in prompt_lps else int(e)
                        for s, c, e in zip(ids, chunks, ends, strict=True)
                    ],
                    return_taps=taps,
                    capacity=None if batch.capacity is None else [cap[s] for s in ids],
                )
            )
            row, off = 0, 0
            for seq_id, chunk, end in zip(ids, chunks, ends, strict=True):
                if taps:
                    rows = slice(off, off + len(chunk))
                    views[seq_id].add(out.tap_k[:, rows], out.tap_v[:, rows], out.tap_hidden[rows])
                off += len(chunk)
                n = len(chunk) if seq_id in prompt_lps else int(end)
                if seq_id in prompt_lps and self.is_driver:
                    done, keep = progress[seq_id], n - int(end)  # the last row: the output's
                    prompt_lps[seq_id] += token_logprobs(
                        torch.log_softmax(out.logits[row : row + keep].float(), dim=-1),
                        prompts[seq_id][done + 1 : done + 1 + keep],
                        self.sampling[seq_id].prompt_logprobs or 0,
                        rank=True,
                    )
                progress[seq_id] += len(chunk)
                if end:
                    last_logits[seq_id] = out.logits[row + n - 1]
                    del progress[seq_id]
                row += n
        for seq_id, leader in copies.items():
            self.runner.fork(leader, seq_id, cap[seq_id])
            last_logits[seq_id] = last_logits[leader]
            if taps:
                views[seq_id] = views[leader]
        if not self.is_driver:
            return None, None
        logits = torch.stack([last_logits[s] for s in batch.seq_ids])  # [n, vocab]
        with self._rewind_on_failure(batch.seq_ids):
            result = self._sample(batch.seq_ids, logits, None, [0] * len(batch.seq_ids))
        if prompt_lps:
            result.prompt_logprobs = [prompt_lps.get(s) for s in batch.seq_ids]
        self._record(batch.seq_ids, result)
        if not taps:
            return result, None
        return result, [
            _own(views[s].build(s, self.sampling[s].seed, prompts[s]), s in shared or s in copies)
            for s in batch.seq_ids
        ]

    # -- preemption -------------------------------------------------------------------
    def preempt(self, seq_ids: list[int]) -> None:
        """Drop these sequences' KV caches for others' and keep the rest (sampling settings,
        seeded generators, token histories, grammars) for their ``resume``."""
        self.runner.free(seq_ids)

    @torch.inference_mode()
    def resume(self, batch: ResumeBatch) -> list[PrefillViews] | None:
        """Recompute preempted sequences' KV caches, bit for bit as they were: each prompt
        on its prefill chunk grid, then its output in blocks of at most ``EXACT_ROWS`` rows
        (the row-exact path its verify rows took), so the rounds after go as if nothing
        happened. Nothing is sampled. With ``want_views``, the drafter's views are built
        from the whole context, as a prefill builds them from a prompt."""
        taps = batch.want_views and self.summary_queries is not None
        tokens = dict(zip(batch.seq_ids, batch.tokens, strict=True))
        cap = dict(zip(batch.seq_ids, batch.capacity, strict=True))
        todo = {
            s: _replay_segments(p, len(t))
            for s, p, t in zip(batch.seq_ids, batch.prompt_lens, batch.tokens, strict=True)
        }
        views = (
            {s: _ViewBuilder(self.summary_queries, self.window, self.cfg.head_dim) for s in todo}
            if taps
            else {}
        )
        self.runner.free(batch.seq_ids)  # a retried resume starts over
        while todo:
            ids, parts, budget = [], [], PREFILL_TOKENS
            for seq_id, segments in todo.items():
                a, b = segments[0]
                if ids and b - a > budget:
                    continue
                ids.append(seq_id)
                parts.append((a, b))
                budget -= b - a
                if budget <= 0:
                    break
            out = self.runner.forward(
                ForwardBatch(
                    seq_ids=ids,
                    token_ids=self._ids(
                        [t for s, (a, b) in zip(ids, parts, strict=True) for t in tokens[s][a:b]]
                    ),
                    num_new=[b - a for a, b in parts],
                    start_pos=[a for a, _ in parts],
                    num_logits=[1] * len(ids),  # unused; keeps the head's shapes ordinary
                    return_taps=taps,
                    capacity=[cap[s] for s in ids],
                )
            )
            off = 0
            for seq_id, (a, b) in zip(ids, parts, strict=True):
                if taps:
                    rows = slice(off, off + b - a)
                    views[seq_id].add(out.tap_k[:, rows], out.tap_v[:, rows], out.tap_hidden[rows])
                off += b - a
                todo[seq_id].pop(0)
                if not todo[seq_id]:
                    del todo[seq_id]
        if not taps or not self.is_driver:
            return None
        return [views[s].build(s, self.sampling[s].seed, tokens[s]) for s in batch.seq_ids]

    # -- verify -------------------------------------------------------------------
    @torch.inference_mode()
    def verify(
        self, batch: VerifyBatch, proposal: Proposal | None
    ) -> tuple[StepResult | None, list[RoundUpdate] | None]:
        """Target forward over ``[anchor, drafts]`` per sequence, then rejection sampling."""
        if proposal is not None:
            # drafts arrive in host memory (Ray) or on the drafter's device (in process)
            proposal = proposal.to(self.device)
        rows = proposal.tokens.tolist() if proposal is not None else []  # one read-back
        drafts = [[] if n == 0 else rows[i][:n] for i, n in enumerate(batch.num_draft)]
        if self.is_driver:
            self._rewind(batch)
            if self.runner.tp.world == 1:  # other ranks could not cut the same rows
                drafts = self._cut_to_grammar(batch.seq_ids, drafts)
        num_draft = [len(d) for d in drafts]
        tokens = [[a, *d] for a, d in zip(batch.anchors, drafts, strict=True)]
        fwd = ForwardBatch(
            seq_ids=batch.seq_ids,
            token_ids=self._ids([t for s in tokens for t in s]),
            num_new=[len(s) for s in tokens],
            start_pos=batch.positions,
            num_logits=[len(s) for s in tokens],
            return_taps=batch.want_updates,
            capacity=batch.capacity,
        )
        out = self.runner.forward(fwd)
        if not self.is_driver:
            return None, None
        # ragged logits: each sequence's 1 + num_draft rows, never padded to the round's k
        with self._rewind_on_failure(batch.seq_ids):
            result = self._sample(batch.seq_ids, out.logits, proposal, num_draft)
            updates = (
                self._round_updates(batch, fwd, out, result, tokens) if batch.want_updates else None
            )
        self._record(batch.seq_ids, result)
        return result, updates

    def _rewind(self, batch: VerifyBatch) -> None:
        """Token histories and grammar matchers back to the round's start, as the KV."""
        for seq_id, pos in zip(batch.seq_ids, batch.positions, strict=True):
            if seq_id not in self.prompt_lens:
                continue
            num_output = pos + 1 - self.prompt_lens[seq_id]
            if (hist := self.history.get(seq_id)) is not None:
                hist.rewind(num_output)
            if (grammar := self.grammars.get(seq_id)) is not None:
                grammar.rewind(num_output)

    def _cut_to_grammar(self, seq_ids: list[int], drafts: list[list[int]]) -> list[list[int]]:
        """Each structured sequence's drafts through the first one its grammar forbids
        (``GrammarState.cut``): no verify row is spent past it."""
        return [
            g.cut(d) if d and (g := self.grammars.get(s)) is not None else d
            for s, d in zip(seq_ids, drafts, strict=True)
        ]

    @contextlib.contextmanager
    def _rewind_on_failure(self, seq_ids: list[int]):
        """If the block raises, every seeded generator of ``seq_ids`` is put back as it was,
        so the engine can verify the round's sequences apart and each seeded one draws the
        numbers the whole round would have given it. (With TP > 1, a failure on another
        rank after rank 0 sampled is not rewound: such a seeded request stays correctly
        distributed but may not repeat its text.)"""
        saved = [(g, g.get_state()) for s in seq_ids if (g := self.generators[s]) is not None]
        try:
            yield
        except Exception:
            for g, state in saved:
                g.set_state(state)
            raise

    @staticmethod
    def _round_updates(
        batch: VerifyBatch, fwd: ForwardBatch, out, result: StepResult, tokens: list[list[int]]
    ) -> list[RoundUpdate]:
        updates, off = [], 0
        for i, seq_id in enumerate(batch.seq_ids):
            rows = slice(off, off + fwd.num_new[i])
            updates.append(
                build_round_update(
                    seq_id,
                    batch.positions[i],
                    result.num_accepted[i],
                    out.tap_k[:, rows],
                    out.tap_v[:, rows],
                    out.tap_hidden[rows],
                    tokens[i],
                )
            )
            off += fwd.num_new[i]
        return updates

    def _sample(self, seq_ids, logits, proposal: Proposal | None, num_draft) -> StepResult:
        """Process, verify and sample ragged ``logits`` ``[sum(num_draft + 1), vocab]``
        (processed in place); log-probabilities come from the raw rows."""
        gens = [self.generators[s] for s in seq_ids]
        params = [self.sampling[s] for s in seq_ids]
        k, n = max(num_draft), len(seq_ids)
        if proposal is None:  # plain decoding steps: an empty proposal
            dev = self.device
            proposal = Proposal(
                torch.zeros(n, 0, dtype=torch.long, device=dev),
                torch.zeros(n, 0, 1, dtype=torch.long, device=dev),
                torch.zeros(n, 0, 1, device=dev),
            )
        elif proposal.tokens.shape[1] != k:  # drafted more than any sequence verifies
            proposal = Proposal(
                proposal.tokens[:, :k], proposal.q_ids[:, :k], proposal.q_probs[:, :k]
            )
        starts = list(itertools.accumulate((d + 1 for d in num_draft), initial=0))
        raw = {
            i: torch.log_softmax(logits[starts[i] : starts[i + 1]].float(), dim=-1)
            for i, sp in enumerate(params)
            if sp.logprobs is not None
        }
        for i, seq_id in enumerate(seq_ids):
            hist, grammar = self.history.get(seq_id), self.grammars.get(seq_id)
            if hist is None and grammar is None:
                continue
            rows = slice(starts[i], starts[i + 1])
            drafts = proposal.tokens[i, : num_draft[i]].tolist()  # a penalised / structured row
            if hist is not None:
                logits[rows] = hist.process(logits[rows], drafts)
            if grammar is not None:
                logits[rows] = grammar.mask(logits[rows].float(), drafts)
        res = rejection_sample(logits, proposal, params, gens, num_draft)
        logprobs = None
        if raw:
            logprobs = [None] * n
            for i, rows in raw.items():
                logprobs[i] = token_logprobs(rows, res.committed[i], params[i].logprobs)
        return StepResult(res.committed, res.num_accepted.tolist(), logprobs)

    def _record(self, seq_ids: list[int], result: StepResult) -> None:
        """The committed tokens into the histories of the sequences that keep one."""
        for seq_id, tokens in zip(seq_ids, result.committed, strict=True):
            if (hist := self.history.get(seq_id)) is not None:
                hist.extend(tokens)
            if (grammar := self.grammars.get(seq_id)) is not None:
                grammar.commit(tokens)

    # -- lifecycle ----------------------------------------------------------------
    def free(self, seq_ids: list[int]) -> None:
        self.runner.free(seq_ids)
        for s in seq_ids:
            self.sampling.pop(s, None)
            self.generators.pop(s, None)
            self._drop_state(s)

    def _drop_state(self, seq_id: int) -> None:
        self.history.pop(seq_id, None)
        self.grammars.pop(seq_id, None)
        self.prompt_lens.pop(seq_id, None)

    def forward(self, batch: ForwardBatch):
        return self.runner.forward(batch)

    def _ids(self, tokens: list[int]) -> torch.Tensor:
        """A forward's token ids, made on the target's device (one host-to-device copy)."""
        return torch.tensor(tokens, dtype=torch.long, device=self.device)

    def kv_stats(self) -> dict[str, int]:
        return self.runner.kv_stats()


def _replay_segments(prompt_len: int, length: int) -> list[tuple[int, int]]:
    """The forwards that rebuild ``length`` cached rows as they were first computed: the
    prompt's prefill chunks, then the output's rows in blocks of at most ``EXACT_ROWS``."""
    cuts = list(range(0, prompt_len, PREFILL_TOKENS)) + list(range(prompt_len, length, EXACT_ROWS))
    return list(zip(cuts, cuts[1:] + [length], strict=True))


def _own(views: PrefillViews, shared: bool) -> PrefillViews:
    """Views of a prompt that several sequences share, given each its own tensors."""
    if not shared:
        return views
    return dataclasses.replace(
        views,
        window_k=views.window_k.clone(),
        window_v=views.window_v.clone(),
        summary_m=views.summary_m.clone(),
        summary_lam=views.summary_lam.clone(),
    )
