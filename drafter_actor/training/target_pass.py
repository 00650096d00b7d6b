"""The frozen target's two passes for training, on the ``TargetModel``'s own weights.

* ``taps``: a plain causal forward over whole recorded sequences (several packed into one
  pass), returning the tapped layers' hidden states and K/V rows, as the engine's
  ``TargetRunner.forward(..., return_taps=True)`` would, but without a KV cache and with
  the fused causal attention kernel (about 1.5x faster on CPU for 768 tokens); optionally
  also the target's greedy next token after every row (the labels of text the target
  did not write itself).
* ``verify_branches``: the Carryover draft-verify step for many anchors of one recorded
  sequence at once. The recorded prefix runs once; each branch ``[x_a, d_1..d_k]`` at
  positions ``a..a+k`` attends to the prefix rows ``< a`` and causally to its own rows
  (a block-diagonal mask), so every branch sees exactly what verifying it alone would.
  Acceptance is greedy: ``d_j`` is accepted while it equals the target's argmax.

Both reuse the layer arithmetic of ``target_actor.model.DecoderLayer`` (same weights,
norms, biases, RoPE); the unit tests check them against ``TargetRunner.forward``.
Training runs the target at TP=1.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from target_actor.model import DecoderLayer, TargetModel, rms_norm
from target_actor.rope import apply_rope

GREEDY_ROWS = 256  # rows per LM-head call of ``taps(..., greedy=True)``


def _qkv(
    layer: DecoderLayer, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``h`` ``[T, d]`` -> q ``[T, H, hd]``, k, v ``[T, H_kv, hd]`` (q, k post-RoPE)."""
    cfg, hd, T = layer.cfg, layer.cfg.head_dim, h.shape[0]
    qkv = F.linear(rms_norm(h, layer.input_norm, cfg.rms_norm_eps), layer.qkv, layer.qkv_bias)
    q, k, v = qkv.split([layer.heads * hd, layer.kv_heads * hd, layer.kv_heads * hd], dim=-1)
    q, k, v = q.view(T, layer.heads, hd), k.view(T, layer.kv_heads, hd), v.view(T, -1, hd)
    if layer.q_norm is not None:
        q = rms_norm(q, layer.q_norm, cfg.rms_norm_eps)
        k = rms_norm(k, layer.k_norm, cfg.rms_norm_eps)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


def _finish(layer: DecoderLayer, h: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
    """Residual + output projection of ``attn`` ``[T, H * hd]``, then the MLP."""
    out = F.linear(attn, layer.o)
    if layer.o_bias is not None:
        out = out + layer.o_bias
    h = h + out
    gate, up = F.linear(rms_norm(h, layer.post_norm, layer.cfg.rms_norm_eps), layer.gate_up).chunk(
        2, -1
    )
    return h + F.linear(F.silu(gate) * up, layer.down)


def _causal(layer: DecoderLayer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal self-attention of one sequence: q ``[T, H, hd]``, k/v ``[T, H_kv, hd]`` -> ``[T, H*hd]``."""
    o = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0),
        k.transpose(0, 1).unsqueeze(0),
        v.transpose(0, 1).unsqueeze(0),
        is_causal=True,
        scale=layer.scale,
        enable_gqa=True,
    )  # [1, H, T, hd]
    return o[0].transpose(0, 1).reshape(q.shape[0], -1)


class TargetPass:
    """Tap and branch-verify passes of a loaded, frozen ``TargetModel`` (TP=1)."""

    def __init__(self, model: TargetModel) -> None:
        if model.tp.enabled:
            raise ValueError("training runs the target at TP=1")
        self.model, self.cfg = model, model.cfg
        self.tap_ids = list(model.cfg.tap_layer_ids)

    @torch.inference_mode()
    def taps(self, seqs: list[list[int]], greedy: bool = False) -> list[tuple[torch.Tensor, ...]]:
        """Per sequence: tapped hidden ``[T, L, d]`` and K, V ``[T, L, H_kv, hd]`` (post-RoPE);
        with ``greedy`` also the target's argmax next token ``[T]`` after every row."""
        m = self.model
        lens = [len(s) for s in seqs]
        tokens = torch.tensor([t for s in seqs for t in s], dtype=torch.long)
        cos, sin = m.rope.lookup(torch.cat([torch.arange(n) for n in lens]))
        h = F.embedding(tokens, m.embed)
        hs, ks, vs = [], [], []
        last = len(m.layers) - 1 if greedy else max(self.tap_ids)
        for i, layer in enumerate(m.layers[: last + 1]):
            q, k, v = _qkv(layer, h, cos, sin)
            parts, off = [], 0
            for n in lens:
                sl = slice(off, off + n)
                parts.append(_causal(layer, q[sl], k[sl], v[sl]))
                off += n
            h = _finish(layer, h, torch.cat(parts))
            if i in self.tap_ids:
                hs.append(h)
                ks.append(k)
                vs.append(v)
        hidden, kk, vv = torch.stack(hs, 1), torch.stack(ks, 1), torch.stack(vs, 1)
        out = [hidden.split(lens), kk.split(lens), vv.split(lens)]
        if greedy:  # the LM head a few hundred rows at a time: [rows, vocab] stays small
            best = torch.cat([m.logits(c).argmax(-1) for c in h.split(GREEDY_ROWS)])
            out.append(best.split(lens))
        return list(zip(*out, strict=True))

    @torch.inference_mode()
    def verify_branches(
        self, tokens: torch.Tensor, anchors: torch.Tensor, drafts: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Verify the drafts of many anchors of one recorded sequence in one pass.

        Args:
            tokens: ``[T]`` the recorded sequence (only rows ``< max(anchors) + 1`` are read).
            anchors: ``[A]`` anchor positions ``a`` (``1 <= a < T``).
            drafts: ``[A, k]`` target ids drafted at each anchor.

        Returns:
            accepted ``[A]`` (greedy: leading drafts equal to the target's argmax) and the
            tapped hidden states ``[A, k+1, L, d]`` of each branch's rows ``a..a+k``.
        """
        m, cfg = self.model, self.cfg
        A, k = drafts.shape
        S, P, hd = k + 1, int(anchors.max()), cfg.head_dim
        branch = torch.cat([tokens[anchors].unsqueeze(1), drafts], 1)  # [A, S]
        pos = anchors.unsqueeze(1) + torch.arange(S)  # [A, S]
        cos_p, sin_p = m.rope.lookup(torch.arange(P))
        cos_b, sin_b = m.rope.lookup(pos.flatten())
        h_p = F.embedding(tokens[:P], m.embed)  # [P, d]
        h_b = F.embedding(branch.flatten(), m.embed)  # [A * S, d]
        see_prefix = torch.arange(P) < anchors[:, None]  # [A, P]: rows before the anchor
        see_own = torch.ones(S, S, dtype=torch.bool).tril()  # [S, S]: causal in the branch
        mask = torch.cat([see_prefix[:, None, :].expand(A, S, P), see_own.expand(A, S, S)], -1)
        mask = mask[:, None, None]  # [A, 1, 1, S, P + S]
        taps, last = [], len(m.layers) - 1
        for i, layer in enumerate(m.layers):
            q, kp, vp = _qkv(layer, h_p, cos_p, sin_p)  # the prefix: [P, heads, hd]
            qb, kb, vb = _qkv(layer, h_b, cos_b, sin_b)  # the branches: [A * S, heads, hd]
            j, g = layer.kv_heads, layer.heads // layer.kv_heads
            qb = qb.view(A, S, j, g, hd)  # query head j * g + i reads KV head j
            kb, vb = kb.view(A, S, j, hd), vb.view(A, S, j, hd)
            scores = torch.cat(  # [A, H_kv, group, S, P + S]: shared prefix rows, own rows
                [
                    torch.einsum("asjgd,pjd->ajgsp", qb, kp),
                    torch.einsum("asjgd,atjd->ajgst", qb, kb),
                ],
                -1,
            )
            p = torch.softmax((scores * layer.scale).masked_fill(~mask, float("-inf")), -1)
            o = torch.einsum("ajgsp,pjd->asjgd", p[..., :P], vp) + torch.einsum(
                "ajgst,atjd->asjgd", p[..., P:], vb
            )  # [A, S, H_kv, group, hd]
            h_b = _finish(layer, h_b, o.reshape(A * S, -1))
            if i < last:
                h_p = _finish(layer, h_p, _causal(layer, q, kp, vp))
            if i in self.tap_ids:
                taps.append(h_b.view(A, S, -1))
        accepted = self._greedy_accept(h_b.view(A, S, -1), drafts)
        return accepted, torch.stack(taps, 2)  # [A, S, L, d]

    def _greedy_accept(self, h: torch.Tensor, drafts: torch.Tensor) -> torch.Tensor:
        """Leading drafts equal to the target's argmax; the LM head runs on live branches only."""
        A, k = drafts.shape
        accepted = torch.zeros(A, dtype=torch.long)
        alive = torch.arange(A)
        for j in range(k):
            if alive.numel() == 0:
                break
            best = self.model.logits(h[alive, j]).argmax(-1)  # [alive]: predicts row a+j+1
            match = best == drafts[alive, j]
            accepted[alive[match]] += 1
            alive = alive[match]
        return accepted
