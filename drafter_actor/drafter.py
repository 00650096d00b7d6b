"""The LongSpark drafter: per-sequence fixed-size views and one batched block pass per round.

``propose`` first applies each request's last-round result (the committed rows go into
the window and the summary, the boundary is replaced, the rejected positions become the
carry rows), then drafts every sequence in ONE block pass. Every sequence's context has
the same fixed layout ``[window (W) ; boundary (1) ; carry (k_max)]`` plus ``R`` summary
slots, with masks for missing rows, so a batch drafts exactly what each sequence would
alone, and the cost does not depend on the context length. With context copy
(``context_copy.py``) a sequence whose recent text repeats takes the copied continuation
and skips the block pass.

A drafter runs on one torch device (``Drafter.random(..., device=)``,
``Drafter.from_pretrained(..., device=)`` or ``Drafter.to(device)``): its network, every
sequence's views and sampler live there, and the messages it receives (from a target on
another GPU, or from host memory through Ray) move there on arrival. Its proposals stay
on that device; ``DrafterWorker`` hands them back in host memory. Only the token history
of context copy stays on the host (``context_copy.py`` says why); every tensor the round
makes names its device.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import torch

from drafter_actor.checkpoint import load_drafter_weights, load_target_head, save_drafter
from drafter_actor.config import DrafterConfig, DrafterConfigError
from drafter_actor.context_copy import apply_copies, copy_inputs, find_copy, is_sure
from drafter_actor.markov import sample_block
from drafter_actor.network import ContextRefs, DrafterNetwork, LayerContext
from drafter_actor.state import DrafterStateError, SequenceState
from target_actor import native
from target_actor.config import ModelConfig
from target_actor.linear import rows_through
from target_actor.messages import (
    DraftRequest,
    PrefillViews,
    Proposal,
    RoundUpdate,
    scatter_proposal,
)


def draw_uniforms(
    generators: list[torch.Generator],
    temperature: list[float],
    k: int,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """``[n, k]`` uniforms on ``device``, each row from its sequence's own generator (on that
    device), zeros when greedy."""
    rows = [
        torch.rand(k, generator=g, device=device) if t > 0 else torch.zeros(k, device=device)
        for g, t in zip(generators, temperature, strict=True)
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
    dev = net.device
    ids = torch.tensor([[r.anchor, r.position] for r in requests], device=dev)  # [n, 2]
    anchors, start = ids[:, 0], ids[:, 1]  # [n]
    temps = [r.temperature for r in requests]
    temperature = torch.tensor(temps, dtype=torch.float32, device=dev)
    positions = start.unsqueeze(1) + torch.arange(k + 1, device=dev)  # [n, k+1]: anchor first
    top = max(r.position for r in requests) + k  # the largest position, known without a sync
    x = net.embed_block(anchors, k, boundary, copies)
    # [n, k, V_d]: MASK slot i predicts the token at position + i
    base = net.block_logits(x, positions, contexts, top)
    uniforms = draw_uniforms(generators, temps, k, dev)  # [n, k]
    tokens, q_ids, q_probs = sample_block(
        base,
        net.to_draft_ids(anchors),
        net.markov,
        temperature,
        uniforms,
        net.cfg.proposal_support,
        all_greedy=all(t <= 0 for t in temps),
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
        """A drafter around ``net``, on ``net``'s device."""
        self.net = net.eval().requires_grad_(False)
        self.cfg = net.cfg
        self.scale = self.cfg.target.head_dim**-0.5
        self.states: dict[int, SequenceState] = {}
        self.num_copied = 0  # drafts that took a context copy
        # seeds unseeded sequences: host bookkeeping, the same seeds on every device
        self._seeds = torch.Generator(device="cpu").manual_seed(seed)

    # -- construction ------------------------------------------------------------------

    @classmethod
    def random(
        cls,
        target_dir: str | Path,
        config: DrafterConfig | None = None,
        seed: int = 0,
        init_std: float = 0.02,
        d2t: torch.Tensor | None = None,
        device: torch.device | str = "cpu",
    ) -> Drafter:
        """A randomly initialised drafter for the target at ``target_dir``, on ``device``.

        With a reduced draft vocabulary, ``d2t`` (sorted target ids) defaults to the
        first ``draft_vocab_size`` ids. ``init_std`` scales the random weights (tests use
        larger ones, so that drafts vary from slot to slot); they are drawn on the host,
        so a seed gives the same weights on every device.
        """
        target = ModelConfig.from_pretrained(target_dir)
        cfg = config or DrafterConfig.for_target(target)
        net = DrafterNetwork(cfg, target)
        net.init_random(seed, init_std)
        net.set_target_weights(*load_target_head(target_dir, target), d2t)
        return cls(net.to(device), seed)

    @classmethod
    def from_pretrained(
        cls,
        drafter_dir: str | Path,
        target_dir: str | Path,
        carry: bool | None = None,
        seed: int = 0,
        context_copy: bool | None = None,
        device: torch.device | str = "cpu",
    ) -> Drafter:
        """Load a saved drafter onto ``device``; ``carry`` / ``context_copy`` override the
        checkpoint's flags."""
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
        return cls(net.to(device), seed)

    def to(self, device: torch.device | str) -> Drafter:
        """Move the drafter (its network) to ``device``, before it holds sequences."""
        if self.states:
            raise DrafterStateError("move a drafter before it holds sequences")
        self.net.to(device)
        return self

    def cast(self, dtype: torch.dtype) -> Drafter:
        """Run in ``dtype``: bf16 where this CPU's bf16 GEMMs are faster. With the C GEMMs
        (on the host) only the GEMM weights turn bf16 and everything else (norms,
        attention, sequence states) stays fp32, which is both faster (no casts, fp32
        attention) and closer to training. Elsewhere (a GPU) the whole network and the
        states take ``dtype``; the summary stays fp32. Drafts stay exact proposals: ``q``
        is what they were sampled from. Cast after moving the drafter to its device."""
        if self.states:
            raise DrafterStateError("cast a drafter before it holds sequences")
        if dtype == torch.bfloat16 and self.device.type == "cpu" and native.available():
            self.net.gemm_weights_to(dtype)
            return self
        self.net.to(dtype)  # a tied embedding and LM head stay one tensor
        return self

    def quantize_int8(self) -> Drafter:
        """GEMM weights as Q8_0 blocks through the VNNI integer kernels, activations and
        states fp32 (``DrafterNetwork.gemm_weights_int8``); host only. As with ``cast``,
        drafts stay exact proposals."""
        if self.states:
            raise DrafterStateError("quantize a drafter before it holds sequences")
        if not self.net.int8_gemms_fit():
            raise DrafterConfigError("int8 drafter GEMMs need the host's VNNI kernels (csrc/q4.c)")
        self.net.gemm_weights_int8()
        return self

    def save_pretrained(self, folder: str | Path, dtype: str = "float32") -> None:
        save_drafter(folder, self.cfg, self.net.state_dict(), dtype)

    # -- the engine's calls ------------------------------------------------------------

    def summary_queries(self) -> torch.Tensor:
        """``G`` ``[L, H, R, hd]`` fp32 on the drafter's device, for the target-side summary."""
        return self.net.summary_queries.detach().float().clone()

    def prefill(self, views: list[PrefillViews]) -> None:
        """Start (or restart) sequences from the views the target built for their prompts."""
        for v in views:  # the state copies each view onto the device (its ids: the host)
            gen = self._generator(v.seed)
            self.states[v.seq_id] = SequenceState.from_prefill(
                v, self.cfg, gen, self.dtype, self.device
            )

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
        proposal = scatter_proposal(part, rows, len(requests))  # on part's device
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
            empty = torch.zeros(0, k, self.cfg.proposal_support, device=self.device)
            return Proposal(empty[..., 0].long(), empty.long(), empty)
        contexts = self._contexts(states)
        boundary = (
            self.net.fuse(torch.stack([s.boundary for s in states]))
            if self.cfg.boundary_input
            else None
        )
        gens = [s.generator for s in states]
        inputs = copy_inputs(copies, k, self.device) if self.cfg.copy_input else None
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

    @property
    def _native_attention(self) -> bool:
        """Whether the block pass attends by the host's C kernel (fp32 states on the host,
        ``LONGSPARK_DRAFT_ATTENTION=torch`` keeps torch's ops, for comparisons)."""
        return (
            self.device.type == "cpu"
            and self.dtype == torch.float32
            and self.cfg.target.head_dim % native.LANES == 0
            and native.available()
            and os.environ.get("LONGSPARK_DRAFT_ATTENTION", "native") != "torch"
        )

    @property
    def device(self) -> torch.device:
        return self.net.device  # with its index for a GPU: what tensors report

    def _generator(self, seed: int | None) -> torch.Generator:
        """A sequence's own sampler on the drafter's device: seeded by the request, else
        from the drafter's seed (drawn on the host)."""
        if seed is None:
            seed = int(torch.randint(2**62, (1,), generator=self._seeds, device="cpu"))
        return torch.Generator(device=self.device).manual_seed(seed)

    def _apply(self, state: SequenceState, update: RoundUpdate) -> None:
        update = update.to(self.device)  # its token ids stay on the host
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

    def _native_contexts(
        self, states: list[SequenceState], feats: torch.Tensor, pos: torch.Tensor, top: int
    ) -> list[LayerContext]:
        """``_contexts`` on the host's C kernels (int8 GEMMs; no carry rows, no key norm):
        the fused boundary states ``feats`` ``[n, d]`` at ``pos`` ``[n]`` through every
        layer's K/V in one GEMM, then RoPE'd and written into each sequence's buffer by one
        C call."""
        net, t, L = self.net, self.cfg.target, self.cfg.num_layers
        kv = rows_through(net.context_kv_q8, feats)  # [n, L * 2 * H_kv * hd]
        cos, sin = (x.float().contiguous() for x in net.rotary(pos, top))  # [n, hd]
        refs = ContextRefs.of(
            [(s.context_k, s.context_v, s.summary_m, s.summary_lam) for s in states]
        )
        native.library().ls_draft_context_rows(
            kv.data_ptr(), cos.data_ptr(), sin.data_ptr(), len(states), L, t.num_kv_heads,
            t.head_dim, refs.k.data_ptr(), refs.v.data_ptr(), refs.rows, states[0].ring_rows,
        )  # fmt: skip
        boundary = torch.ones(len(states), 1, dtype=torch.bool, device=self.device)
        mask = torch.cat([torch.stack([s.window_mask() for s in states]), boundary], 1)
        return [LayerContext(None, None, mask, refs=refs, layer=i) for i in range(L)]

    def _contexts(self, states: list[SequenceState]) -> list[LayerContext]:
        """Stack the sequences' views into each layer's fixed-layout context."""
        net, L, dev = self.net, self.cfg.num_layers, self.device
        lengths = [s.length for s in states]
        length = torch.tensor(lengths, device=dev)  # [n]
        feats = net.fuse(torch.stack([s.boundary for s in states])).unsqueeze(1)  # [n, 1, d]
        pos = (length - 1).unsqueeze(1)  # [n, 1]: the boundary position
        top = max(lengths) - 1  # the largest position, known without a sync
        native_rows = not (self.cfg.carry or self.cfg.qk_norm) and net.context_kv_q8 is not None
        if self._native_attention and native_rows:
            return self._native_contexts(states, feats.squeeze(1), length - 1, top)
        mask = torch.ones(len(states), 1, dtype=torch.bool, device=dev)
        if self.cfg.carry:
            carry = net.carry_features(torch.stack([s.carry for s in states]))  # [n, k_max, d]
            feats = torch.cat([feats, carry], 1)
            after = torch.arange(carry.shape[1], device=dev)
            pos = torch.cat([pos, length.unsqueeze(1) + after], 1)
            top += carry.shape[1]
            mask = torch.cat([mask, torch.stack([s.carry_mask() for s in states])], 1)
        rows = net.project_context(feats, pos, top)  # L x [n, H_kv, 1 + k_max, hd]
        # the rows go into each state's context buffer right after its window ring, so a
        # layer's context is the buffer itself (one sequence) or one stack of them
        W = states[0].ring_rows
        rows_k = torch.stack([k for k, _ in rows], 1)  # [n, L, H_kv, 1 + k_max, hd]
        rows_v = torch.stack([v for _, v in rows], 1)
        for i, s in enumerate(states):
            s.context_k[:, :, W:].copy_(rows_k[i])
            s.context_v[:, :, W:].copy_(rows_v[i])
        mask = torch.cat([torch.stack([s.window_mask() for s in states]), mask], 1)  # [n, C]
        if self._native_attention:  # each layer reads every sequence's buffers where they are
            refs = ContextRefs.of(
                [(s.context_k, s.context_v, s.summary_m, s.summary_lam) for s in states]
            )
            return [LayerContext(None, None, mask, refs=refs, layer=i) for i in range(L)]
        if len(states) == 1:
            ctx_k, ctx_v = states[0].context_k[None], states[0].context_v[None]
        else:
            ctx_k = torch.stack([s.context_k for s in states])  # [n, L, H_kv, C, hd]
            ctx_v = torch.stack([s.context_v for s in states])
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
