"""The LongSpark drafter: per-sequence fixed-size views and one batched block pass per round.

``propose`` first applies each request's last-round result (the committed rows go into
the window and the summary, the boundary is replaced, the rejected positions become the
carry rows), then drafts every sequence in ONE block pass. Every sequence's context has
the same fixed layout ``[window (W) ; boundary (1) ; carry (k_max)]`` plus ``R`` summary
slots, with masks for missing rows, so a batch drafts exactly what each sequence would
alone, and the cost does not depend on the context length. With context copy
(``context_copy.py``) a sequence whose recent text repeats takes the copied continuation
and skips the block pass.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from drafter_actor.checkpoint import load_drafter_weights, load_target_head, save_drafter
from drafter_actor.config import DrafterConfig, DrafterConfigError
from drafter_actor.context_copy import apply_copies, copy_inputs, find_copy, is_sure
from drafter_actor.markov import sample_block
from drafter_actor.network import DrafterNetwork, LayerContext
from drafter_actor.state import DrafterStateError, SequenceState
from target_actor import native
from target_actor.config import ModelConfig
from target_actor.messages import (
    DraftRequest,
    PrefillViews,
    Proposal,
    RoundUpdate,
    scatter_proposal,
)


def draw_uniforms(
    generators: list[torch.Generator], temperature: torch.Tensor, k: int
) -> torch.Tensor:
    """``[n, k]`` uniforms, each row from its sequence's own generator (zeros when greedy)."""
    rows = [
        torch.rand(k, generator=g) if t > 0 else torch.zeros(k)
        for g, t in zip(generators, temperature.tolist(), strict=True)
    ]
    return torch.stack(rows)


def draft_block(
    net: DrafterNetwork,
    requests: list[DraftRequest],
    generators: list[torch.Generator],
    contexts: list[LayerContext],
    k: int,
    boundary: torch.Tensor | None = None,
    copies: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> Proposal:
    """One parallel block pass over ``contexts``, then Markov-corrected sampling of k slots.

    ``boundary`` ``[n, d]``: the fused boundary states, for drafters with ``boundary_input``;
    ``copies``: context-copy candidates and match lengths, for drafters with ``copy_input``.
    """
    anchors = torch.tensor([r.anchor for r in requests])  # [n]
    start = torch.tensor([r.position for r in requests])  # [n]
    temperature = torch.tensor([r.temperature for r in requests], dtype=torch.float32)
    positions = start.unsqueeze(1) + torch.arange(k + 1)  # [n, k+1]: anchor at `position`
    h = net(net.embed_block(anchors, k, boundary, copies), positions, contexts)  # [n, k+1, d]
    base = net.logits(h[:, 1:])  # [n, k, V_d]: MASK slot i predicts the token at position+i
    uniforms = draw_uniforms(generators, temperature, k)  # [n, k]
    tokens, q_ids, q_probs = sample_block(
        base, net.to_draft_ids(anchors), net.markov, temperature, uniforms, net.cfg.proposal_support
    )
    return Proposal(tokens=net.d2t[tokens], q_ids=net.d2t[q_ids], q_probs=q_probs)


def check_requests(requests: list[DraftRequest], k: int, cfg: DrafterConfig) -> None:
    if not 1 <= k <= cfg.block_size:
        raise DrafterStateError(f"k={k} outside 1..block_size={cfg.block_size}")
    if len({r.seq_id for r in requests}) != len(requests):
        raise DrafterStateError("a sequence may appear only once per propose call")
    vocab = cfg.target.vocab_size
    for r in requests:
        if not 0 <= r.anchor < vocab:
            raise DrafterStateError(
                f"sequence {r.seq_id}: anchor {r.anchor} outside 0..{vocab - 1}"
            )


class Drafter:
    """LongSpark drafter: batched ``prefill`` / ``propose`` / ``free`` over per-sequence views."""

    copies_context = True  # keeps a token history for context copy (if the config asks)

    def __init__(self, net: DrafterNetwork, seed: int = 0) -> None:
        self.net = net.eval().requires_grad_(False)
        self.cfg = net.cfg
        self.scale = self.cfg.target.head_dim**-0.5
        self.states: dict[int, SequenceState] = {}
        self.num_copied = 0  # drafts that took a context copy
        self._seeds = torch.Generator().manual_seed(seed)  # seeds unseeded sequences

    # -- construction ------------------------------------------------------------------

    @classmethod
    def random(
        cls,
        target_dir: str | Path,
        config: DrafterConfig | None = None,
        seed: int = 0,
        init_std: float = 0.02,
        d2t: torch.Tensor | None = None,
    ) -> Drafter:
        """A randomly initialised drafter for the target at ``target_dir``.

        With a reduced draft vocabulary, ``d2t`` (sorted target ids) defaults to the
        first ``draft_vocab_size`` ids. ``init_std`` scales the random weights (tests use
        larger ones, so that drafts vary from slot to slot).
        """
        target = ModelConfig.from_pretrained(target_dir)
        cfg = config or DrafterConfig.for_target(target)
        net = DrafterNetwork(cfg, target)
        net.init_random(seed, init_std)
        net.set_target_weights(*load_target_head(target_dir, target), d2t)
        return cls(net, seed)

    @classmethod
    def from_pretrained(
        cls,
        drafter_dir: str | Path,
        target_dir: str | Path,
        carry: bool | None = None,
        seed: int = 0,
        context_copy: bool | None = None,
    ) -> Drafter:
        """Load a saved drafter; ``carry`` / ``context_copy`` override the checkpoint's flags."""
        cfg, weights = load_drafter_weights(drafter_dir)
        target = ModelConfig.from_pretrained(target_dir)
        if carry is not None:
            cfg = dataclasses.replace(cfg, carry=carry)
        if context_copy is not None:
            cfg = dataclasses.replace(cfg, context_copy=context_copy)
        net = DrafterNetwork(cfg, target)  # checks the target fingerprint
        try:
            net.load_state_dict(weights)
        except RuntimeError as e:
            first = str(e).strip().splitlines()[-1].strip()
            raise DrafterConfigError(
                f"{drafter_dir}: weights do not fit its config: {first}"
            ) from None
        net.set_target_weights(*load_target_head(target_dir, target))
        return cls(net, seed)

    def cast(self, dtype: torch.dtype) -> Drafter:
        """Run in ``dtype``: bf16 where this CPU's bf16 GEMMs are faster. With the C GEMMs
        only the GEMM weights turn bf16 and everything else (norms, attention, sequence
        states) stays fp32, which is both faster (no casts, fp32 attention) and closer to
        training. Drafts stay exact proposals: ``q`` is what they were sampled from."""
        if self.states:
            raise DrafterStateError("cast a drafter before it holds sequences")
        if dtype == torch.bfloat16 and native.available():
            self.net.gemm_weights_to(dtype)
            return self
        net, tied = self.net.to(dtype), self.net.lm_head is self.net.embed
        net.embed = net.embed.to(dtype)
        net.lm_head = net.embed if tied else net.lm_head.to(dtype)
        return self

    def save_pretrained(self, folder: str | Path, dtype: str = "float32") -> None:
        save_drafter(folder, self.cfg, self.net.state_dict(), dtype)

    # -- the engine's calls ------------------------------------------------------------

    def summary_queries(self) -> torch.Tensor:
        """``G`` ``[L, H, R, hd]`` fp32, for the target-side prefill summary."""
        return self.net.summary_queries.detach().float().clone()

    def prefill(self, views: list[PrefillViews]) -> None:
        """Start (or restart) sequences from the views the target built for their prompts."""
        for v in views:
            gen = self._generator(v.seed)
            self.states[v.seq_id] = SequenceState.from_prefill(v, self.cfg, gen, self.dtype)

    @torch.no_grad()
    def propose(
        self, requests: list[DraftRequest], k: int, updates: list[RoundUpdate] | None = None
    ) -> Proposal:
        """Apply the last round's updates, then draft ``k`` tokens for every sequence: sure
        context copies as they are, the others in one block pass (a copy that agrees with
        the network's first draft fills the slots after it).

        Updates come with each request (``DraftRequest.update``) or, straight from the
        target's verify, as ``updates`` (matched by ``seq_id``; those of sequences freed
        since are dropped).
        """
        check_requests(requests, k, self.cfg)
        self.apply_updates(updates or [])
        states = [self._advance(r) for r in requests]
        copying = self.copies_context and self.cfg.context_copy
        copies = (
            [
                find_copy(s.recent_tokens(), r.anchor, k)
                for s, r in zip(states, requests, strict=True)
            ]
            if self.copies_context and (copying or self.cfg.copy_input)
            else [([], 0)] * len(states)
        )
        # a sure copy replaces every slot: those sequences skip the block pass
        sure = self.cfg.copy_sure_ngram
        rows = [i for i, c in enumerate(copies) if not (copying and is_sure(*c, sure))]
        part = self._draft(
            [states[i] for i in rows], [requests[i] for i in rows], k, [copies[i] for i in rows]
        )
        proposal = scatter_proposal(part, rows, len(requests))
        if not copying:
            return proposal
        proposal, copied = apply_copies(proposal, copies, sure)
        self.num_copied += copied
        return proposal

    def _draft(
        self,
        states: list[SequenceState],
        requests: list[DraftRequest],
        k: int,
        copies: list[tuple[list[int], int]],
    ) -> Proposal:
        """The network's block pass for ``states`` (``copies``: their context-copy matches)."""
        if not states:
            empty = torch.zeros(0, k, self.cfg.proposal_support)
            return Proposal(empty[..., 0].long(), empty.long(), empty)
        contexts = self._contexts(states)
        boundary = (
            self.net.fuse(torch.stack([s.boundary for s in states]))
            if self.cfg.boundary_input
            else None
        )
        gens = [s.generator for s in states]
        inputs = copy_inputs(copies, k) if self.cfg.copy_input else None
        return draft_block(self.net, requests, gens, contexts, k, boundary, inputs)

    @torch.no_grad()
    def apply_updates(self, updates: list[RoundUpdate]) -> None:
        """Apply round updates of live sequences; updates of freed sequences are dropped."""
        for u in updates:
            if u.seq_id in self.states:
                self._apply(self.states[u.seq_id], u)

    def free(self, seq_ids: list[int]) -> None:
        for seq_id in seq_ids:
            self.states.pop(seq_id, None)

    def num_states(self) -> int:
        return len(self.states)

    def state(self, seq_id: int) -> SequenceState:
        if seq_id not in self.states:
            raise DrafterStateError(f"unknown sequence {seq_id} (not prefilled or freed)")
        return self.states[seq_id]

    def state_bytes(self, seq_id: int) -> int:
        return self.state(seq_id).state_bytes()

    # -- internals ---------------------------------------------------------------------

    @property
    def dtype(self) -> torch.dtype:
        return self.net.norm.dtype  # the activations' (and states') dtype

    def _generator(self, seed: int | None) -> torch.Generator:
        """A sequence's own sampler: seeded by the request, else from the drafter's seed."""
        if seed is None:
            seed = int(torch.randint(2**62, (1,), generator=self._seeds))
        return torch.Generator().manual_seed(seed)

    def _apply(self, state: SequenceState, update: RoundUpdate) -> None:
        state.apply(update, self.net.summary_queries, self.scale, self.cfg.carry)

    def _advance(self, r: DraftRequest) -> SequenceState:
        """Apply ``r.update`` to the sequence's views and check the block position."""
        state = self.state(r.seq_id)
        if r.update is not None:
            self._apply(state, r.update)
        if r.position != state.length:
            raise DrafterStateError(
                f"sequence {r.seq_id}: drafting at position {r.position}, "
                f"but its views cover {state.length} tokens"
            )
        return state

    def _contexts(self, states: list[SequenceState]) -> list[LayerContext]:
        """Stack the sequences' views into each layer's fixed-layout context."""
        net, L = self.net, self.cfg.num_layers
        length = torch.tensor([s.length for s in states])  # [n]
        feats = net.fuse(torch.stack([s.boundary for s in states])).unsqueeze(1)  # [n, 1, d]
        pos = (length - 1).unsqueeze(1)  # [n, 1]: the boundary position
        mask = torch.ones(len(states), 1, dtype=torch.bool)
        if self.cfg.carry:
            carry = net.carry_features(torch.stack([s.carry for s in states]))  # [n, k_max, d]
            feats = torch.cat([feats, carry], 1)
            pos = torch.cat([pos, length.unsqueeze(1) + torch.arange(carry.shape[1])], 1)
            mask = torch.cat([mask, torch.stack([s.carry_mask() for s in states])], 1)
        rows = net.project_context(feats, pos)  # L x [n, H_kv, 1 + k_max, hd]
        # the rows go into each state's context buffer right after its window ring, so a
        # layer's context is the buffer itself (one sequence) or one stack of them
        W = states[0].ring_rows
        rows_k = torch.stack([k for k, _ in rows], 1)  # [n, L, H_kv, 1 + k_max, hd]
        rows_v = torch.stack([v for _, v in rows], 1)
        for i, s in enumerate(states):
            s.context_k[:, :, W:].copy_(rows_k[i])
            s.context_v[:, :, W:].copy_(rows_v[i])
        if len(states) == 1:
            ctx_k, ctx_v = states[0].context_k[None], states[0].context_v[None]
        else:
            ctx_k = torch.stack([s.context_k for s in states])  # [n, L, H_kv, C, hd]
            ctx_v = torch.stack([s.context_v for s in states])
        mask = torch.cat([torch.stack([s.window_mask() for s in states]), mask], 1)  # [n, C]
        summary_m = torch.stack([s.summary_m for s in states])  # [n, L, H, R, hd]
        summary_mask = ~torch.isneginf(torch.stack([s.summary_lam for s in states]))
        return [
            LayerContext(
                k=ctx_k[:, i],  # [n, H_kv, W + 1 + k_max, hd]
                v=ctx_v[:, i],
                mask=mask,
                summary_m=summary_m[:, i],
                summary_mask=summary_mask[:, i],
            )
            for i in range(L)
        ]
