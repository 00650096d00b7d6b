"""The drafter network: one layer per tapped target layer, a block pass over read-only context.

Drafter layer ``l`` is paired with tapped target layer ``l`` and has the target's attention
geometry (``H`` query heads, ``H_kv`` KV heads, ``hd``, RoPE), so the target's own K/V rows
(the window) are attended to as they are. Each layer attends, non-causally, over

    K = [context rows ; G ; block],   V = [context rows ; M ; block]

where the context rows (``LayerContext``) are whatever the caller assembled (LongSpark:
boundary, window and carry rows; the full-prefix baseline: every prefix row and carry),
``G`` ``[H, R, hd]`` are the layer's summary queries acting as keys (no RoPE) with the
summary ``M`` as values, and the block is ``[anchor, MASK x k]`` itself. Order does not
matter to attention; masks mark missing rows.

``forward`` is a pure function of (block embeddings, positions, per-layer context), with
no per-sequence state, so training can build contexts at many anchors in parallel.

Keys everywhere are post-RoPE at their absolute positions: the target's window keys as
cached, and the drafter's own boundary / carry / block keys rotated here. Training must
build its views the same way.

The token embedding and the LM head are the target's (frozen buffers, never saved);
``d2t`` (sorted target ids of the draft vocabulary) slices the LM head.

The network runs on any torch device: ``net.to(device)`` moves its parameters, buffers
and RoPE table (a tied embedding / LM head stays one tensor). On the host the GEMMs and
norms take the C kernels where they apply (``inference_linear``, ``rms_norm``); those
fall back to torch's ops on every other device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from drafter_actor.config import DrafterConfig
from drafter_actor.context_copy import MAX_NGRAM
from drafter_actor.markov import MarkovHead
from drafter_actor.native_pass import NativeBlockPass, NativeMarkovGreedy
from target_actor import native
from target_actor.arena import into_arena
from target_actor.config import ModelConfig
from target_actor.linear import Int8Linear, inference_linear, native_q4_lib, rows_through
from target_actor.model import rms_norm
from target_actor.rope import RotaryTable, apply_rope


@dataclass
class ContextRefs:
    """Each sequence's own context buffers, by address, for the host's C attention
    (``ls_draft_attend`` in ``target_actor/csrc/attention.c``): a batch reads them where they
    live instead of stacking copies every round. All fp32, contiguous."""

    k: torch.Tensor  # [N] int64: addresses of each sequence's [L, H_kv, C, hd] keys
    v: torch.Tensor  # [N] int64: ... values
    summary_m: torch.Tensor  # [N] int64: [L, H, R, hd] summary values
    summary_lam: torch.Tensor  # [N] int64: [L, H, R] log-masses (-inf: an empty slot)
    rows: int  # C
    owners: tuple  # what holds the buffers: kept alive while the addresses are in use

    @classmethod
    def of(cls, buffers: list[tuple[torch.Tensor, ...]]) -> ContextRefs:
        """From each sequence's ``(k, v, summary_m, summary_lam)``."""
        for t in (t for seq in buffers for t in seq):
            if t.dtype != torch.float32 or not t.is_contiguous() or t.device.type != "cpu":
                raise ValueError("context buffers for the C attention: fp32, contiguous, host")
        addr = [
            torch.tensor([seq[i].data_ptr() for seq in buffers], dtype=torch.int64, device="cpu")
            for i in range(4)
        ]  # addresses: host memory, as the buffers are
        return cls(*addr, rows=buffers[0][0].shape[2], owners=tuple(buffers))


@dataclass
class LayerContext:
    """One drafter layer's read-only context: every row it attends to except the block.
    Either as batch tensors (``k``, ``v``, summary) or, on the host with the C kernels, as
    ``refs`` to each sequence's buffers with this layer's index."""

    k: torch.Tensor | None  # [N, H_kv, C, hd]: keys, post-RoPE (target key space for the window)
    v: torch.Tensor | None  # [N, H_kv, C, hd]
    mask: torch.Tensor  # [N, C] bool: True where a row is present
    summary_m: torch.Tensor | None = None  # [N, H, R, hd]: values for the summary keys G
    summary_mask: torch.Tensor | None = None  # [N, H, R] bool: False for an empty slot
    refs: ContextRefs | None = None
    layer: int = 0  # which layer's slice of ``refs``


class Linear(nn.Linear):
    """``nn.Linear`` (no bias) whose inference forward takes a C GEMM: int8 (``q8``, set by
    ``DrafterNetwork.gemm_weights_int8``) or bf16."""

    q8: Int8Linear | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.q8 is not None and not torch.is_grad_enabled():
            return rows_through(self.q8, x)
        return inference_linear(x, self.weight)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on ``x`` ``[N, S, heads, hd]`` with ``cos``/``sin`` ``[N, S, hd]``."""
    cos, sin = cos.to(x.dtype).flatten(0, 1), sin.to(x.dtype).flatten(0, 1)
    return apply_rope(x.flatten(0, 1), cos, sin).view_as(x)


class DrafterLayer(nn.Module):
    """A pre-norm decoder layer whose attention reads a context plus the block."""

    qkv_q8: Int8Linear | None = None  # q, k, v stacked: one GEMM (``gemm_weights_int8``)

    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__()
        t = cfg.target
        d, hd, self.eps = t.hidden_size, t.head_dim, cfg.rms_norm_eps
        self.heads, self.kv_heads, self.head_dim = t.num_heads, t.num_kv_heads, hd
        self.group = self.heads // self.kv_heads
        self.input_norm = nn.Parameter(torch.ones(d))
        self.q_proj = Linear(d, self.heads * hd, bias=False)
        self.k_proj = Linear(d, self.kv_heads * hd, bias=False)
        self.v_proj = Linear(d, self.kv_heads * hd, bias=False)
        self.q_norm = nn.Parameter(torch.ones(hd)) if cfg.qk_norm else None
        self.k_norm = nn.Parameter(torch.ones(hd)) if cfg.qk_norm else None
        self.o_proj = Linear(self.heads * hd, d, bias=False)
        self.post_norm = nn.Parameter(torch.ones(d))
        self.gate_up = Linear(d, 2 * cfg.mlp_width, bias=False)
        self.down = Linear(cfg.mlp_width, d, bias=False)
        self.scale = hd**-0.5

    def kv(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values ``[N, H_kv, C, hd]`` of features ``x`` ``[N, C, d]`` (RoPE'd)."""
        return self.rotate_kv(self.k_proj(x), self.v_proj(x), cos, sin)

    def rotate_kv(
        self, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Projected keys and values ``[N, C, H_kv * hd]`` -> ``[N, H_kv, C, hd]``, keys
        normed (``qk_norm``) and RoPE'd."""
        N, C, _ = k.shape
        k, v = k.view(N, C, self.kv_heads, self.head_dim), v.view(N, C, self.kv_heads, -1)
        if self.k_norm is not None:
            k = rms_norm(k, self.k_norm, self.eps)
        return _rope(k, cos, sin).transpose(1, 2), v.transpose(1, 2)

    def qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The three projections of ``x`` ``[N, S, d]``: one GEMM where they are fused
        (int8 inference, ``qkv_q8``), three otherwise."""
        if self.qkv_q8 is not None and not torch.is_grad_enabled():
            d_kv = self.kv_heads * self.head_dim
            return rows_through(self.qkv_q8, x).split([self.heads * self.head_dim, d_kv, d_kv], -1)
        return self.q_proj(x), self.k_proj(x), self.v_proj(x)

    def forward(
        self,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        ctx: LayerContext,
        g: torch.Tensor,
    ) -> torch.Tensor:
        """``h`` ``[N, S, d]`` (the block) -> new ``h``; ``g`` ``[H, R, hd]`` the summary keys."""
        N, S, _ = h.shape
        hd = self.head_dim
        x = rms_norm(h, self.input_norm, self.eps)
        q, k, v = self.qkv(x)
        q = q.view(N, S, self.heads, hd)
        if self.q_norm is not None:
            q = rms_norm(q, self.q_norm, self.eps)
        q = _rope(q, cos, sin)
        kb, vb = self.rotate_kv(k, v, cos, sin)  # the block's own rows: [N, H_kv, S, hd]
        if ctx.refs is not None:
            out = self._attend_native(q, kb, vb, ctx, g)
        else:
            out = self._attend(q, kb, vb, ctx, g)
        h = h + self.o_proj(out)
        gate, up = self.gate_up(rms_norm(h, self.post_norm, self.eps)).chunk(2, -1)
        return h + self.down(F.silu(gate) * up)

    def _attend_native(
        self,
        q: torch.Tensor,
        kb: torch.Tensor,
        vb: torch.Tensor,
        ctx: LayerContext,
        g: torch.Tensor,
    ) -> torch.Tensor:
        """``_attend`` in one C call over each sequence's own buffers (``ctx.refs``)."""
        N, S, H, hd = q.shape
        refs, out = ctx.refs, torch.empty(N, S, H, hd, device="cpu")  # the host's kernels
        q, kb, vb = q.float().contiguous(), kb.float().contiguous(), vb.float().contiguous()
        mask, g = ctx.mask.contiguous(), g.float().contiguous()  # held: the call reads them
        rc = native.library().ls_draft_attend(
            q.data_ptr(),
            kb.data_ptr(),
            vb.data_ptr(),
            refs.k.data_ptr(),
            refs.v.data_ptr(),
            mask.data_ptr(),
            g.data_ptr(),
            refs.summary_m.data_ptr(),
            refs.summary_lam.data_ptr(),
            out.data_ptr(),
            N,
            ctx.layer,
            S,
            H,
            self.kv_heads,
            refs.rows,
            g.shape[1],
            hd,
            self.scale,
        )
        if rc != 0:
            raise ValueError(f"head_dim {hd} does not fit the C attention")
        return out.view(N, S, H * hd)

    def _attend(
        self,
        q: torch.Tensor,
        kb: torch.Tensor,
        vb: torch.Tensor,
        ctx: LayerContext,
        g: torch.Tensor,
    ) -> torch.Tensor:
        """Block rows ``q`` ``[N, S, H, hd]`` over context, summary and block keys, one
        softmax: ``[N, S, H * hd]``."""
        N, S, _, _ = q.shape
        Hkv, G, hd = self.kv_heads, self.group, self.head_dim
        # query head h = j * G + g reads KV head j: [N, H_kv, G * S, hd]
        qg = q.view(N, S, Hkv, G, hd).permute(0, 2, 3, 1, 4).reshape(N, Hkv, G * S, hd)

        no = float("-inf")
        scores = [
            (qg @ ctx.k.transpose(-1, -2)).masked_fill(~ctx.mask[:, None, None, :], no),
            qg @ kb.transpose(-1, -2),
        ]  # [N, H_kv, G * S, C] and [N, H_kv, G * S, S]
        if ctx.summary_m is not None:
            s = torch.einsum(
                "njgsd,jgrd->njgsr", qg.view(N, Hkv, G, S, hd), g.reshape(Hkv, G, -1, hd)
            )  # the summary keys are G itself, without RoPE
            if ctx.summary_mask is not None:
                s = s.masked_fill(~ctx.summary_mask.reshape(N, Hkv, G, 1, -1), no)
            scores.append(s.reshape(N, Hkv, G * S, -1))  # [N, H_kv, G * S, R]
        sizes = [s.shape[-1] for s in scores]
        p = torch.softmax(torch.cat(scores, -1).float() * self.scale, -1).to(q.dtype)
        p = p.split(sizes, -1)
        out = p[0] @ ctx.v + p[1] @ vb  # [N, H_kv, G * S, hd]
        if ctx.summary_m is not None:
            m = ctx.summary_m.to(q.dtype).reshape(N, Hkv, G, -1, hd)
            p_sum = p[2].reshape(N, Hkv, G, S, -1)
            out = out + torch.einsum("njgsr,njgrd->njgsd", p_sum, m).reshape(N, Hkv, G * S, hd)
        return out.view(N, Hkv, G, S, hd).permute(0, 3, 1, 2, 4).reshape(N, S, -1)


class DrafterNetwork(nn.Module):
    """All drafter-owned weights plus the target's frozen embedding and LM head."""

    def __init__(self, cfg: DrafterConfig, target: ModelConfig) -> None:
        super().__init__()
        cfg.check_target(target)
        self.cfg = cfg
        t, L = cfg.target, cfg.num_layers
        d, H, R, hd = t.hidden_size, t.num_heads, cfg.summary_slots, t.head_dim
        self.fuse_proj = Linear(L * d, d, bias=False)  # F: L*d -> d, then RMSNorm
        self.fuse_norm = nn.Parameter(torch.ones(d))
        self.mask_embedding = nn.Parameter(torch.zeros(d))  # the MASK slots' input
        self.carry_embedding = nn.Parameter(torch.zeros(L * d))  # E_carry
        # the boundary state fed straight into the block's rows (EAGLE-style), besides its
        # K/V row: zero at init, so a drafter trained without it starts unchanged
        self.boundary_proj = Linear(d, d, bias=False) if cfg.boundary_input else None
        # the context-copy candidate of each MASK slot (its embedding, projected) plus a
        # vector per match length; the projection starts as the identity (the candidate's
        # own embedding), since from zero it grows too slowly to be learned in a short run
        self.copy_proj = Linear(d, d, bias=False) if cfg.copy_input else None
        self.copy_bias = nn.Parameter(torch.zeros(MAX_NGRAM + 1, d)) if cfg.copy_input else None
        self.summary_queries = nn.Parameter(torch.zeros(L, H, R, hd))  # G
        self.layers = nn.ModuleList(DrafterLayer(cfg) for _ in range(L))
        self.norm = nn.Parameter(torch.ones(d))
        self.markov = MarkovHead(cfg.draft_vocab_size, cfg.markov_rank)
        self.register_buffer("d2t", torch.arange(cfg.draft_vocab_size))  # [V_d] sorted target ids
        # the target's, frozen and not saved:
        self.register_buffer("t2d", torch.arange(t.vocab_size), persistent=False)  # [V]
        self.register_buffer("embed", torch.zeros(t.vocab_size, d), persistent=False)
        self.register_buffer("lm_head", torch.zeros(cfg.draft_vocab_size, d), persistent=False)
        self.target_config = target
        self.rope = RotaryTable(target)
        self.lm_head_q8: Int8Linear | None = None  # set by gemm_weights_int8
        self.q8_arena = None  # their memory (gemm_weights_int8: target_actor.arena)
        self.context_kv_q8: Int8Linear | None = None  # every layer's k, v: one GEMM (same)
        self.native_pass: NativeBlockPass | None = None  # the block pass in one C call (same)

    @property
    def device(self) -> torch.device:
        return self.norm.device

    def _apply(self, fn, recurse: bool = True):
        """``to`` / ``cuda`` / ``float`` ...: a tied embedding and LM head move as one tensor
        (twice the memory otherwise), and the RoPE table follows the parameters' device."""
        tied = self.lm_head is self.embed
        if tied:
            self.lm_head = None
        try:
            super()._apply(fn, recurse)
        finally:
            if tied:
                self.lm_head = self.embed
        if self.rope.cos.device != self.device:
            self.rope = RotaryTable(self.target_config, device=self.device)
        return self

    def rotary(
        self, positions: torch.Tensor, top: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE ``cos``, ``sin`` ``[..., hd]`` at ``positions``. ``top``: their largest value,
        when the caller knows it; the table's own check reads it off ``positions``, which on
        a GPU waits for the device (only needed when the table must grow)."""
        if top is not None and top < self.rope.cos.shape[0]:
            return self.rope.cos[positions], self.rope.sin[positions]
        return self.rope.lookup(positions)

    # -- weights ------------------------------------------------------------------------

    def init_random(self, seed: int, std: float = 0.02) -> None:
        """Random drafter-owned weights (a random drafter still drafts, just badly). Drawn
        on the host, so a seed gives the same weights on every device."""
        gen = torch.Generator(device="cpu").manual_seed(seed)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if "norm" in name:
                    p.fill_(1.0)
                elif name.startswith(("boundary_proj", "copy_bias")):
                    p.zero_()
                elif name == "copy_proj.weight":
                    p.copy_(torch.eye(p.shape[0], device="cpu"))
                elif name == "summary_queries":  # scores of O(1) against the target's keys
                    p.copy_(torch.randn(p.shape, generator=gen, device="cpu"))
                else:
                    p.copy_(torch.randn(p.shape, generator=gen, device="cpu") * std)

    def set_target_weights(
        self, embed: torch.Tensor, lm_head: torch.Tensor, d2t: torch.Tensor | None = None
    ) -> None:
        """Install the target's embedding ``[V, d]`` and LM head ``[V, d]`` (sliced to ``d2t``)."""
        V, dev = self.cfg.target.vocab_size, self.device
        d2t = self.d2t if d2t is None else d2t.to(dev, torch.long)
        if d2t.shape != (self.cfg.draft_vocab_size,) or not bool((d2t[1:] > d2t[:-1]).all()):
            raise ValueError("d2t must be a strictly increasing list of draft_vocab_size ids")
        if int(d2t[0]) < 0 or int(d2t[-1]) >= V:
            raise ValueError(f"d2t ids must lie in 0..{V - 1}")
        act, gemm = self.norm.dtype, self.fuse_proj.weight.dtype  # differ after gemm_weights_to
        self.d2t = d2t.clone()
        self.t2d = torch.full((V,), self.cfg.draft_vocab_size, dtype=torch.long, device=dev)
        self.t2d[d2t] = torch.arange(len(d2t), device=dev)
        self.embed = embed.to(dev, act)
        head = lm_head if self.cfg.full_vocab else lm_head[d2t.to(lm_head.device)]
        # (full vocab: d2t == arange, and a tied head stays the embedding)
        self.lm_head = self.embed if head is embed and act == gemm else head.to(dev, gemm)

    def int8_gemms_fit(self) -> bool:
        """Whether every GEMM here fits the VNNI integer kernels (``csrc/q4.c``) on this host."""
        shapes = [m.weight.shape for m in self.modules() if isinstance(m, Linear)]
        shapes += [self.lm_head.shape, self.markov.w2.shape[::-1]]
        return self.device.type == "cpu" and all(native_q4_lib(tuple(s)) for s in shapes)

    def gemm_weights_int8(self) -> None:
        """What the GEMMs read (linears, LM head, Markov ``W2``) as GGUF Q8_0 blocks (an fp16
        scale per 32 inputs) multiplied by integer dot products with the activations as one
        int8 plane per 32 (llama.cpp's Q8): half bf16's bytes and half the target's integer
        work (``target_actor.linear.Int8Linear``). The rounding only shapes the proposals,
        which carry the distribution they were drawn from: verification stays exact."""
        for module in self.modules():
            if isinstance(module, Linear):
                module.q8 = Int8Linear(module.weight.data, planes=1)
        # fewer, larger calls: each output channel's sums are its own, so stacking weights
        # changes no bits, only the per-call cost (~35 GEMM calls a round at C=1 before)
        for layer in self.layers:
            qkv = (layer.q_proj.weight, layer.k_proj.weight, layer.v_proj.weight)
            layer.qkv_q8 = Int8Linear(torch.cat(qkv).data, planes=1)
        kv = [w for layer in self.layers for w in (layer.k_proj.weight, layer.v_proj.weight)]
        self.context_kv_q8 = Int8Linear(torch.cat(kv).data, planes=1)
        self.lm_head_q8 = Int8Linear(self.lm_head, planes=1)
        self.markov.w2t_q8 = Int8Linear(self.markov.w2.data.t(), planes=1)
        # in 2 MB pages, before the C passes take their addresses (target_actor.arena)
        q8s = [m.q8 for m in self.modules() if isinstance(m, Linear)]
        q8s += [layer.qkv_q8 for layer in self.layers]
        self.q8_arena = into_arena([*q8s, self.context_kv_q8, self.lm_head_q8, self.markov.w2t_q8])
        self.markov.native_greedy = NativeMarkovGreedy.build(self.markov)
        self.native_pass = NativeBlockPass.build(self)

    def gemm_weights_to(self, dtype: torch.dtype) -> None:
        """Cast only what the GEMMs read (linears, LM head, Markov ``W2``) to ``dtype``."""
        for module in self.modules():
            if isinstance(module, Linear):
                module.weight.data = module.weight.data.to(dtype)
        self.markov.w2.data = self.markov.w2.data.to(dtype)
        self.lm_head = self.lm_head.to(dtype)  # a copy even when tied: the embedding stays

    # -- the pieces of a block pass -----------------------------------------------------

    def fuse(self, taps: torch.Tensor) -> torch.Tensor:
        """``F``: tapped hidden states ``[..., L, d]`` -> conditioning vectors ``[..., d]``."""
        return rms_norm(self.fuse_proj(taps.flatten(-2)), self.fuse_norm, self.cfg.rms_norm_eps)

    def carry_features(self, rejected: torch.Tensor) -> torch.Tensor:
        """Rejected positions' tapped states ``[..., L, d]`` -> ``F(h + E_carry)`` ``[..., d]``."""
        return self.fuse(rejected + self.carry_embedding.view(rejected.shape[-2:]))

    def project_context(
        self, feats: torch.Tensor, positions: torch.Tensor, top: int | None = None
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's K/V ``[N, H_kv, C, hd]`` of fused features ``[N, C, d]`` at ``positions``
        (``top``: their largest, if known; see ``rotary``)."""
        cos, sin = self.rotary(positions, top)  # [N, C, hd]
        if self.context_kv_q8 is None or torch.is_grad_enabled():
            return [layer.kv(feats, cos, sin) for layer in self.layers]
        kv = rows_through(self.context_kv_q8, feats).chunk(2 * len(self.layers), -1)
        return [
            layer.rotate_kv(kv[2 * i], kv[2 * i + 1], cos, sin)
            for i, layer in enumerate(self.layers)
        ]

    def embed_block(
        self,
        anchors: torch.Tensor,
        k: int,
        boundary: torch.Tensor | None = None,
        copies: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """The block ``[anchor, MASK x k]`` ``[N, k+1, d]`` for anchors ``[N]`` (target ids).

        ``boundary`` ``[N, d]``: the fused boundary state (``fuse`` of the taps at the
        position before the anchor); with ``boundary_input`` it is added to every row.
        ``copies``: context-copy candidates ``[N, k]`` (target ids, -1 none) and their
        match lengths ``[N]``; with ``copy_input`` they are added to the MASK rows.
        """
        mask = self.mask_embedding.expand(anchors.shape[0], k, -1)
        if self.copy_proj is not None:
            if copies is None:
                raise ValueError("this drafter reads context-copy candidates in its block input")
            ids, lengths = copies
            cand = self.copy_proj(F.embedding(ids.clamp(min=0), self.embed))  # [N, k, d]
            cand = cand + self.copy_bias[lengths].unsqueeze(1)
            mask = mask + cand * (ids >= 0).unsqueeze(-1).to(cand.dtype)
        x = torch.cat([F.embedding(anchors, self.embed).unsqueeze(1), mask], 1)
        if self.boundary_proj is not None:
            if boundary is None:
                raise ValueError("this drafter reads the boundary state in its block input")
            x = x + self.boundary_proj(boundary).unsqueeze(1)
        return x

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        contexts: list[LayerContext],
        top: int | None = None,
    ) -> torch.Tensor:
        """Block pass: embeddings ``[N, S, d]`` at ``positions`` ``[N, S]`` -> hidden ``[N, S, d]``
        (``top``: the largest position, if known; see ``rotary``)."""
        cos, sin = self.rotary(positions, top)  # [N, S, hd]
        for layer, ctx, g in zip(self.layers, contexts, self.summary_queries, strict=True):
            x = layer(x, cos, sin, ctx, g)
        return x

    def block_logits(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        contexts: list[LayerContext],
        top: int | None = None,
    ) -> torch.Tensor:
        """Block pass and LM head: embeddings ``[N, S, d]`` at ``positions`` -> base logits
        ``[N, S - 1, V_d]`` of the MASK slots, in one C call where it applies (int8 GEMMs,
        attention over ``refs``: ``native_pass.py``), else ``forward`` then ``logits``."""
        if self.native_pass is not None and contexts[0].refs is not None:
            cos, sin = self.rotary(positions, top)
            return self.native_pass.logits(x, cos, sin, contexts)
        return self.logits(self(x, positions, contexts, top=top)[:, 1:])

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Base logits ``[..., V_d]`` over the draft vocabulary from hidden ``[..., d]``."""
        x = rms_norm(h, self.norm, self.cfg.rms_norm_eps)
        if self.lm_head_q8 is not None:
            return rows_through(self.lm_head_q8, x)
        return inference_linear(x, self.lm_head).float()

    def to_draft_ids(self, tokens: torch.Tensor) -> torch.Tensor:
        """Target ids -> draft ids (``V_d`` for ids outside the draft vocabulary)."""
        return self.t2d[tokens]

    def num_parameters(self) -> int:
        """Drafter-owned parameters (what the checkpoint stores, without ``d2t``)."""
        return sum(p.numel() for p in self.parameters())
