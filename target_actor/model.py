"""Llama / Qwen2 / Qwen3 decoder in plain torch plus C kernels, with a ragged batched forward.

One forward runs every sequence's new tokens through the linears as one ``[T, hidden]``
matrix; between them, the row-wise steps (norms, RoPE, SiLU) run fused per row
(``layer_ops``), and attention takes one C call per layer for every sequence's decode rows
and verify blocks (prompt chunks: SDPA per sequence). A forward of decode rows and verify
blocks through the integer GEMMs runs all its layers in one C call instead
(``native_decoder``): the same kernels in the same order, without the Python between
them. Tensor parallelism is in the weights (each rank holds its heads / channels / vocab
slice) and two collectives from ``TPContext``; at TP=1 they vanish.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from target_actor.arena import into_arena
from target_actor.batch import ForwardBatch, ForwardOutput
from target_actor.config import ModelConfig
from target_actor.kv_cache import KVCache
from target_actor.layer_ops import NativeOps, TorchOps, ops_for, rms_norm
from target_actor.linear import Linear, WeightForm, WeightOnly
from target_actor.native_decoder import NativeDecoder
from target_actor.parallel import TPContext
from target_actor.rope import RotaryTable
from target_actor.weights import CheckpointReader

# Blocks of up to this many rows (decode rows, verify blocks of k+1) are the ones a
# plain and a speculative run must compute identically; larger ones are prompt chunks,
# the same in both modes, and go to torch's fused SDPA (GEMM-blocked, faster for many rows).
EXACT_ROWS = 32


class _AttnPlan:
    """Which sequences attend where, built once per forward and shared by all layers.

    Short blocks of every sequence go to one C kernel call per layer (``native``): each
    row attends alone, in an order of operations fixed by its own length, so a verify
    row equals its decode step bit for bit and no row depends on its batch. Without the
    kernel they go through SDPA per sequence, row by row when ``row_exact`` (bf16 GEMM
    inputs turn SDPA's block-size-dependent last bits into different logits).
    """

    def __init__(
        self, batch: ForwardBatch, cache: KVCache, lib=None, row_exact: bool = False
    ) -> None:
        self.row_exact = row_exact
        device = cache.device
        self.kv_bf16 = int(cache.dtype == torch.bfloat16)  # the C kernel reads / writes bf16
        self.items: list[tuple[int, int, int, int, torch.Tensor | None]] = []
        native_rows: list[tuple[int, int, int, int, int]] = []
        off = 0
        for seq_id, start, n in zip(batch.seq_ids, batch.start_pos, batch.num_new, strict=True):
            if lib is not None and n <= EXACT_ROWS:
                data = cache.seqs[seq_id].data
                native_rows.append((data.data_ptr(), data.shape[3], start, n, off))
            else:
                mask = None
                if n > 1 and not (row_exact and n <= EXACT_ROWS):  # rows alone need none
                    # query i (absolute start+i) sees keys 0..start+i
                    q_pos = torch.arange(start, start + n, device=device).unsqueeze(1)
                    keys = torch.arange(start + n, device=device).unsqueeze(0)
                    mask = keys <= q_pos
                self.items.append((seq_id, off, start, n, mask))
            off += n
        self._additive: dict[tuple[int, int], torch.Tensor] = {}
        self.native = None
        if native_rows:
            # columns: cache base, capacity, start, rows, first row (kept alive here);
            # host memory: the C kernel reads it (CPU only)
            self.meta = torch.tensor(native_rows, dtype=torch.int64, device="cpu").t().contiguous()
            self.native = (lib.ls_attend, len(native_rows), *(c.data_ptr() for c in self.meta))

    def additive_mask(self, item: int, dtype: torch.dtype, fold: int = 1) -> torch.Tensor | None:
        """Item ``item``'s mask as SDPA's additive one (0 where a key is seen, -inf where
        not), its rows repeated ``fold`` times for folded query heads; built once a forward:
        SDPA turns a boolean mask into this itself at every layer, a large share of a long
        prompt chunk's attention (the same bits either way)."""
        mask = self.items[item][4]
        if mask is None:
            return None
        if (item, fold) not in self._additive:
            add = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
            add.masked_fill_(~mask, float("-inf"))
            self._additive[item, fold] = add.repeat(fold, 1) if fold > 1 else add
        return self._additive[item, fold]


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPContext) -> None:
        super().__init__()
        self.cfg, self.tp = cfg, tp
        self.heads = cfg.num_heads // tp.world
        self.kv_heads = cfg.num_kv_heads // tp.world
        self.inter = cfg.intermediate_size // tp.world
        hd, d = cfg.head_dim, cfg.hidden_size
        qkv_out = (self.heads + 2 * self.kv_heads) * hd
        self.input_norm = nn.Parameter(torch.ones(d), requires_grad=False)
        self.qkv = nn.Parameter(torch.empty(qkv_out, d), requires_grad=False)
        self.qkv_bias: nn.Parameter | None = None
        self.q_norm = nn.Parameter(torch.ones(hd), requires_grad=False) if cfg.qk_norm else None
        self.k_norm = nn.Parameter(torch.ones(hd), requires_grad=False) if cfg.qk_norm else None
        self.o = nn.Parameter(torch.empty(d, self.heads * hd), requires_grad=False)
        self.o_bias: nn.Parameter | None = None
        self.post_norm = nn.Parameter(torch.ones(d), requires_grad=False)
        self.gate_up = nn.Parameter(torch.empty(2 * self.inter, d), requires_grad=False)
        self.down = nn.Parameter(torch.empty(d, self.inter), requires_grad=False)
        self.scale = hd**-0.5
        self.prepare(WeightForm())

    def prepare(self, form: WeightForm) -> None:
        """(Re)build the GEMM weights in ``form`` (after loading). A quantized form frees
        the dense weights it was made from."""
        self.lin_qkv, self.lin_o = form.make(self.qkv), form.make(self.o)
        self.lin_gate_up, self.lin_down = form.make(self.gate_up), form.make(self.down)
        if form.quant != "none":
            for p in (self.qkv, self.o, self.gate_up, self.down):
                p.data = torch.empty(0)

    def linears(self) -> tuple[Linear, ...]:
        return self.lin_qkv, self.lin_o, self.lin_gate_up, self.lin_down

    def load(self, ckpt: CheckpointReader, prefix: str) -> None:
        cfg, tp, hd = self.cfg, self.tp, self.cfg.head_dim
        q0, k0 = tp.rank * self.heads * hd, tp.rank * self.kv_heads * hd
        qn, kn = self.heads * hd, self.kv_heads * hd
        att = f"{prefix}.self_attn"
        self.qkv.data = torch.cat(
            [
                ckpt.rows(f"{att}.q_proj.weight", q0, qn),
                ckpt.rows(f"{att}.k_proj.weight", k0, kn),
                ckpt.rows(f"{att}.v_proj.weight", k0, kn),
            ]
        )
        if ckpt.has(f"{att}.q_proj.bias"):
            self.qkv_bias = nn.Parameter(
                torch.cat(
                    [
                        ckpt.rows(f"{att}.q_proj.bias", q0, qn),
                        ckpt.rows(f"{att}.k_proj.bias", k0, kn),
                        ckpt.rows(f"{att}.v_proj.bias", k0, kn),
                    ]
                ),
                requires_grad=False,
            )
        self.o.data = ckpt.cols(f"{att}.o_proj.weight", q0, qn)
        if ckpt.has(f"{att}.o_proj.bias"):  # added once, after the all-reduce
            self.o_bias = nn.Parameter(ckpt.get(f"{att}.o_proj.bias"), requires_grad=False)
        if cfg.qk_norm:
            self.q_norm.data = ckpt.get(f"{att}.q_norm.weight")
            self.k_norm.data = ckpt.get(f"{att}.k_norm.weight")
        self.input_norm.data = ckpt.get(f"{prefix}.input_layernorm.weight")
        self.post_norm.data = ckpt.get(f"{prefix}.post_attention_layernorm.weight")
        i0 = tp.rank * self.inter
        self.gate_up.data = torch.cat(
            [
                ckpt.rows(f"{prefix}.mlp.gate_proj.weight", i0, self.inter),
                ckpt.rows(f"{prefix}.mlp.up_proj.weight", i0, self.inter),
            ]
        )
        self.down.data = ckpt.cols(f"{prefix}.mlp.down_proj.weight", i0, self.inter)

    def forward(
        self,
        h: torch.Tensor,
        y: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        plan: _AttnPlan,
        cache: KVCache,
        layer_id: int,
        ops: TorchOps | NativeOps,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One layer on the residual stream ``h`` ``[T, hidden]``, updated in place.

        ``y`` is the previous layer's output, still to be added to ``h`` (the add is fused
        into this layer's first norm); returns this layer's output and this rank's new
        K, V ``[T, kv_heads, head_dim]``."""
        hd, eps = self.cfg.head_dim, self.cfg.rms_norm_eps
        # each GEMM's input in the dtype its kernel takes (torch's quantized ones: bf16)
        x = ops.add_rms_norm(h, y, self.input_norm, eps, self.lin_qkv.act or h.dtype)
        q, k, v = ops.qkv_rope(
            self.lin_qkv(x), self.qkv_bias, self.q_norm, self.k_norm, eps, cos, sin,
            self.heads, self.kv_heads, hd,
        )  # fmt: skip
        attn = self._attend(q, k, v, plan, cache, layer_id)
        y = self._reduce(self.lin_o(attn.to(self.lin_o.act or h.dtype)))
        if self.o_bias is not None:
            y = y.to(h.dtype) + self.o_bias
        x = ops.add_rms_norm(h, y, self.post_norm, eps, self.lin_gate_up.act or h.dtype)
        y = self._reduce(
            self.lin_down(ops.silu_mul(self.lin_gate_up(x), self.lin_down.act or h.dtype))
        )
        return y, k, v

    def _reduce(self, y: torch.Tensor) -> torch.Tensor:
        """Sum the ranks' partial outputs (in fp32 or the model dtype, never bf16 GEMM output)."""
        if not self.tp.enabled:
            return y
        return self.tp.all_reduce(y.to(self.input_norm.dtype))

    def _attend(self, q, k, v, plan: _AttnPlan, cache: KVCache, layer_id: int) -> torch.Tensor:
        """Store the new K/V rows and attend: short blocks in one C call, prompt chunks
        (and everything without the C kernels) through SDPA per sequence."""
        hd, T = self.cfg.head_dim, q.shape[0]
        group = self.heads // self.kv_heads
        out = torch.empty(T, self.heads * hd, dtype=q.dtype, device=q.device)
        if plan.native is not None:
            self._attend_native(plan, layer_id, q, k, v, out)
        for item, (seq_id, off, start, n, _) in enumerate(plan.items):
            cache.write(layer_id, seq_id, start, k[off : off + n], v[off : off + n])
            if plan.row_exact and 1 < n <= EXACT_ROWS:
                for i in range(off, off + n):
                    keys, values = cache.view(layer_id, seq_id, start + i - off + 1, q.dtype)
                    qs = q[i : i + 1].transpose(0, 1).reshape(1, self.kv_heads, group, hd)
                    o = F.scaled_dot_product_attention(
                        qs, keys[None], values[None], scale=self.scale
                    )
                    out[i] = o.reshape(-1)
                continue
            keys, values = cache.view(layer_id, seq_id, start + n, q.dtype)  # [kv_heads, L, hd]
            if n > EXACT_ROWS:
                # a prompt chunk: [1, heads, n, hd] against [1, kv_heads, L, hd] (GQA), the
                # [n, L] mask shared by every head; 4-D inputs take torch's fused CPU kernel
                # (3-D ones fall back to ~15 small ops)
                qs = q[off : off + n].transpose(0, 1)[None]
                mask = plan.additive_mask(item, q.dtype)
                o = F.scaled_dot_product_attention(
                    qs, keys[None], values[None], attn_mask=mask, scale=self.scale,
                    enable_gqa=group > 1,
                )  # fmt: skip
            else:
                # a decode row or verify block: a KV group's query heads folded together,
                # [1, kv_heads, group * n, hd], the layout the rows-alone path above takes
                # too, so a row's bits do not depend on the block it rides in
                qs = q[off : off + n].transpose(0, 1).reshape(1, self.kv_heads, group * n, hd)
                mask = plan.additive_mask(item, q.dtype, fold=group)
                o = F.scaled_dot_product_attention(
                    qs, keys[None], values[None], attn_mask=mask, scale=self.scale
                )
            out[off : off + n] = o.view(self.heads, n, hd).transpose(0, 1).reshape(n, -1)
        return out

    def _attend_native(self, plan: _AttnPlan, layer_id: int, q, k, v, out) -> None:
        """Store the short blocks' K/V and attend all their rows: one C call."""
        fn, nseq, base, cap, start, nnew, row0 = plan.native
        rc = fn(
            q.data_ptr(),
            q.stride(0),
            k.data_ptr(),
            k.stride(0),
            v.data_ptr(),
            v.stride(0),
            out.data_ptr(),
            nseq,
            base,
            cap,
            start,
            nnew,
            row0,
            layer_id,
            self.heads,
            self.kv_heads,
            self.cfg.head_dim,
            self.scale,
            plan.kv_bf16,
        )
        if rc != 0:
            raise RuntimeError(f"native attention failed ({rc})")


class TargetModel(nn.Module):
    """The whole decoder for one TP rank."""

    def __init__(
        self,
        cfg: ModelConfig,
        tp: TPContext | None = None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        super().__init__()
        self.cfg, self.tp = cfg, tp or TPContext()
        cfg.check_tp(self.tp.world)
        self.vocab_start, self.vocab_size = self.tp.vocab_shard(cfg.vocab_size)
        d = cfg.hidden_size
        self.embed = nn.Parameter(torch.empty(self.vocab_size, d), requires_grad=False)
        self.layers = nn.ModuleList(DecoderLayer(cfg, self.tp) for _ in range(cfg.num_layers))
        self.norm = nn.Parameter(torch.ones(d), requires_grad=False)
        self.lm_head = (
            self.embed
            if cfg.tie_word_embeddings
            else nn.Parameter(torch.empty(self.vocab_size, d), requires_grad=False)
        )
        self.device = torch.device(device)
        self.rope = RotaryTable(cfg, dtype, self.device)
        self.lin_head = WeightForm().make(self.lm_head)
        self.tap_index = {layer: i for i, layer in enumerate(cfg.tap_layer_ids)}
        self.row_exact = False
        self.ops = ops_for(dtype, cfg.head_dim, self.device)
        self.native: NativeDecoder | None = None  # all layers in one C call (prepare)
        self.arena = None  # the quantized GEMM weights' memory (prepare)

    @property
    def local_kv_heads(self) -> int:
        return self.cfg.num_kv_heads // self.tp.world

    def load(self, ckpt: CheckpointReader) -> None:
        v0, vn = self.vocab_start, self.vocab_size
        self.embed.data = ckpt.rows("model.embed_tokens.weight", v0, vn)
        for i, layer in enumerate(self.layers):
            layer.load(ckpt, f"model.layers.{i}")
        self.norm.data = ckpt.get("model.norm.weight")
        if self.cfg.tie_word_embeddings:
            self.lm_head = self.embed
        else:
            self.lm_head = nn.Parameter(ckpt.rows("lm_head.weight", v0, vn), requires_grad=False)

    def prepare(self, form: WeightForm, dtype: torch.dtype) -> None:
        """After loading (in fp32, or ``dtype`` when nothing is quantized): build every GEMM
        in ``form``, then cast what stays dense (norms, biases, embeddings) to ``dtype``."""
        for layer in self.layers:
            layer.prepare(form)
        self.lin_head = form.head().make(self.lm_head)
        if form.quant != "none" and self.lm_head is not self.embed:
            self.lm_head.data = torch.empty(0)
        # fp32 end to end, a verify row differs from its decode step by float rounding
        # only, and greedy never flipped on it; through bf16 GEMM inputs those last bits
        # move roundings and reach the logits, so attention then goes row by row
        self.row_exact = form.quant != "none" or dtype != torch.float32
        self.ops = ops_for(dtype, self.cfg.head_dim, self.device)
        for p in self.parameters():  # dense layers already reference tensors of ``dtype``
            if p.numel() and p.dtype != dtype:
                p.data = p.data.to(dtype)
        # the quantized GEMM weights in 2 MB pages (before the C decoder takes their addresses)
        lins = [lin for layer in self.layers for lin in layer.linears()] + [self.lin_head]
        self.arena = into_arena(lin for lin in lins if isinstance(lin, WeightOnly))
        lib = self.ops.lib if isinstance(self.ops, NativeOps) else None
        self.native = NativeDecoder.build(lib, self)

    def embed_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        """Vocab-parallel lookup: ids outside this rank's slice contribute zeros."""
        if not self.tp.enabled:
            return F.embedding(tokens, self.embed)
        local = tokens - self.vocab_start
        outside = (local < 0) | (local >= self.vocab_size)
        x = F.embedding(local.masked_fill(outside, 0), self.embed)
        return self.tp.all_reduce(x.masked_fill(outside.unsqueeze(-1), 0.0))

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Final norm + LM head on ``h`` ``[N, hidden]`` -> ``[N, vocab]`` (gathered, fp32)."""
        return self._head(rms_norm(h, self.norm, self.cfg.rms_norm_eps))

    def _head(self, x: torch.Tensor) -> torch.Tensor:
        """LM head on normed rows -> ``[N, vocab]``, gathered over the ranks, fp32."""
        return self.tp.all_gather_last(self.lin_head(x), self.cfg.vocab_size).float()

    def forward(self, batch: ForwardBatch, cache: KVCache) -> ForwardOutput:
        positions = [
            p for s, n in zip(batch.start_pos, batch.num_new, strict=True) for p in range(s, s + n)
        ]
        cos, sin = self.rope.lookup(positions)
        ops = self.ops
        plan = _AttnPlan(batch, cache, ops.lib, self.row_exact)
        # the round's token ids: built on this device by the verifier; a batch from
        # elsewhere (tests, the channel) comes in host memory and crosses here
        h, y = self.embed_tokens(batch.token_ids.to(self.device)), None
        taps_h, taps_k, taps_v = [], [], []
        if self.native is not None and plan.native is not None and not plan.items:
            # decode rows and verify blocks: the same kernels as the loop below, one C call
            y, taps = self.native.run(self, h, cos, sin, plan, batch.return_taps)
            taps_h, taps_k, taps_v = ([t[j] for t in taps] for j in range(3))
        else:
            for i, layer in enumerate(self.layers):
                y, k, v = layer(h, y, cos, sin, plan, cache, i, ops)
                if batch.return_taps and i in self.tap_index:
                    taps_h.append(h + y)  # the layer's output (h itself lags by y)
                    taps_k.append(self._gather_heads(k))
                    taps_v.append(self._gather_heads(v))
        x = ops.add_rms_norm(h, y, self.norm, self.cfg.rms_norm_eps, self.lin_head.act or h.dtype)
        out = ForwardOutput(logits=self._head(x[self._logit_rows(batch)]))
        if batch.return_taps:
            out.tap_hidden = torch.stack(taps_h, dim=1)  # [T, L, hidden]
            out.tap_k, out.tap_v = torch.stack(taps_k), torch.stack(taps_v)
        return out

    def _gather_heads(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's ``[T, kv_heads/tp, hd]`` -> every rank's ``[T, kv_heads, hd]``."""
        if not self.tp.enabled:
            return x
        T, hd = x.shape[0], self.cfg.head_dim
        full = self.cfg.num_kv_heads * hd
        return self.tp.all_gather_last(x.reshape(T, -1), full).view(T, -1, hd)

    def _logit_rows(self, batch: ForwardBatch) -> torch.Tensor:
        rows, off = [], 0
        for n, m in zip(batch.num_new, batch.num_logits, strict=True):
            rows.extend(range(off + n - m, off + n))
            off += n
        return torch.tensor(rows, dtype=torch.long, device=self.device)
