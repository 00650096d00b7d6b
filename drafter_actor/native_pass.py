"""The drafter's block pass, and its greedy Markov draft, in one C call each (``csrc/draft.c``).

A round's block pass from Python is ~15 small torch ops a layer (norms, RoPE, the views
the attention needs, SiLU, the residual adds) around the C GEMMs and attention, then the
final norm and the LM head; at one sequence those ops cost more than the kernels. When
the drafter's GEMMs are the int8 kernels (``DrafterNetwork.gemm_weights_int8``) and its
attention reads each sequence's buffers by address (``ContextRefs``), the same steps run
from one C loop. The greedy Markov draft (``MarkovHead.greedy``) likewise: k small GEMMs
and argmaxes in one call.

The C pass rounds SiLU and RoPE its own way, so its last bits may differ from the Python
path's; a proposal carries the distribution it was drawn from, so verification stays exact
whichever path drafted. Built after the weights are final; it points into them.
"""

from __future__ import annotations

import ctypes

import torch

from target_actor import native
from target_actor.native_decoder import LayerStruct, fill_layer, gemm_fields


def _contiguous_f32(t: torch.Tensor) -> torch.Tensor:
    return t.detach().float().contiguous()


class NativeBlockPass:
    """A drafter network's layers, final norm and LM head as ``ls_draft_pass`` reads them."""

    def __init__(self, lib, net, layers: ctypes.Array, held: tuple) -> None:
        self.fn, self.net, self.layers, self.held = lib.ls_draft_pass, net, layers, held
        self.head = gemm_fields(net.lm_head_q8)

    @classmethod
    def build(cls, net) -> NativeBlockPass | None:
        """The pass for ``net`` (int8 GEMMs on the host), or None where it cannot run."""
        lib = native.library()
        if lib is None or net.device.type != "cpu" or net.lm_head_q8 is None:
            return None
        if gemm_fields(net.lm_head_q8) is None or net.cfg.target.head_dim % native.LANES:
            return None
        layers = (LayerStruct * len(net.layers))()
        for entry, layer in zip(layers, net.layers, strict=True):
            norms = (layer.input_norm, layer.post_norm, layer.q_norm, layer.k_norm)
            lins = (layer.qkv_q8, layer.o_proj.q8, layer.gate_up.q8, layer.down.q8)
            if not all(n is None or n.dtype == torch.float32 for n in norms):
                return None
            if not fill_layer(entry, norms, lins):
                return None
        held = (_contiguous_f32(net.summary_queries), _contiguous_f32(net.norm))
        return cls(lib, net, layers, held)

    def logits(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, contexts
    ) -> torch.Tensor:
        """Block embeddings ``x`` ``[n, S, d]`` with RoPE ``cos``/``sin`` ``[n, S, hd]`` over
        ``contexts`` (``LayerContext`` with ``refs``) -> base logits ``[n, S - 1, V_d]``."""
        net, refs = self.net, contexts[0].refs
        n, S, d = x.shape
        t = net.cfg.target
        h = x.float().contiguous().clone()  # the residual stream, updated in place
        cos, sin = cos.float().contiguous(), sin.float().contiguous()
        mask = contexts[0].mask.contiguous()  # held: the call reads it
        g, norm = self.held
        _, w, scales, _, vocab, _, planes = self.head
        base = torch.empty(n, S - 1, vocab, dtype=torch.float32, device="cpu")
        rc = self.fn(
            ctypes.addressof(self.layers), len(net.layers), h.data_ptr(), net.cfg.rms_norm_eps,
            n, S, d, cos.data_ptr(), sin.data_ptr(), t.num_heads, t.num_kv_heads, t.head_dim,
            net.layers[0].scale, refs.k.data_ptr(), refs.v.data_ptr(), mask.data_ptr(),
            refs.rows, g.data_ptr(), refs.summary_m.data_ptr(), refs.summary_lam.data_ptr(),
            g.shape[2], norm.data_ptr(), w, scales, vocab, planes, base.data_ptr(),
        )  # fmt: skip
        if rc != 0:
            raise MemoryError(f"the drafter's C block pass failed ({rc})")
        return base


class NativeMarkovGreedy:
    """``MarkovHead.greedy`` by ``ls_markov_greedy``: W1 fp32, W2 through its int8 rows."""

    def __init__(self, lib, head) -> None:
        self.fn, self.w1 = lib.ls_markov_greedy, _contiguous_f32(head.w1)
        self.w2 = gemm_fields(head.w2t_q8)

    @classmethod
    def build(cls, head) -> NativeMarkovGreedy | None:
        lib = native.library()
        if lib is None or head.w2t_q8 is None or gemm_fields(head.w2t_q8) is None:
            return None
        return cls(lib, head)

    def __call__(self, base: torch.Tensor, anchor: torch.Tensor) -> torch.Tensor:
        """Base logits ``[n, k, V_d]`` and anchors ``[n]`` (draft ids) -> drafts ``[n, k]``."""
        n, k, vocab = base.shape
        base = base.float().contiguous()
        anchor = anchor.to(torch.int64).contiguous()
        tokens = torch.empty(n, k, dtype=torch.int64, device="cpu")
        _, w, scales, _, _, rank, planes = self.w2
        rc = self.fn(
            base.data_ptr(), n, k, vocab, anchor.data_ptr(), self.w1.data_ptr(), rank, w,
            scales, planes, tokens.data_ptr(),
        )  # fmt: skip
        if rc != 0:
            raise MemoryError(f"the Markov head's C draft failed ({rc})")
        return tokens
