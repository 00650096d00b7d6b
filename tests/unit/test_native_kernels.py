"""The C kernels: as accurate as torch's ops, a row never depends on its batch or its block,
and a machine without a compiler gets the torch path."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from target_actor import native
from target_actor.batch import ForwardBatch
from target_actor.kv_cache import KVCache
from target_actor.layer_ops import NativeOps, TorchOps, ops_for
from target_actor.model import DecoderLayer, _AttnPlan
from target_actor.runner import TargetRunner, TargetSpec

pytestmark = pytest.mark.skipif(not native.available(), reason="no C compiler")


def _layer(heads: int, kv_heads: int, hd: int) -> DecoderLayer:
    layer = DecoderLayer.__new__(DecoderLayer)  # just what _attend_native reads
    layer.heads, layer.kv_heads, layer.scale = heads, kv_heads, hd**-0.5
    layer.cfg = type("Cfg", (), {"head_dim": hd})
    return layer


def attend(seqs, heads=6, kv_heads=2, hd=32, lib=None, kv_dtype=torch.float32):
    """Run the kernel over ``seqs``: (cached length, new rows, seed) each; a sequence's
    cache, queries and new K/V come from its own seed, whatever else is in the call."""
    cache = KVCache(2, kv_heads, hd, 10_000, dtype=kv_dtype)
    qs, kvs = [], []
    for s, (length, n, seed) in enumerate(seqs):
        gen = torch.Generator().manual_seed(seed)
        cache.reserve(s, length + n)
        cache.set_length(s, length + n)
        data = cache.seqs[s].data
        data[:, :, :, : length + n].copy_(
            torch.randn(data[:, :, :, : length + n].shape, generator=gen)
        )
        qs.append(torch.randn(n, heads, hd, generator=gen))
        kvs.append(torch.randn(n, 2 * kv_heads * hd, generator=gen))
    q, kv = torch.cat(qs), torch.cat(kvs)  # k, v as strided views, as in a layer
    T = q.shape[0]
    k, v = kv[:, : kv_heads * hd].view(T, kv_heads, hd), kv[:, kv_heads * hd :].view(T, -1, hd)
    news = [n for _, n, _ in seqs]
    batch = ForwardBatch(
        list(range(len(seqs))), torch.zeros(T, dtype=torch.long), news, [s[0] for s in seqs], news
    )
    plan = _AttnPlan(batch, cache, lib or native.library())
    out = torch.empty(T, heads * hd)
    _layer(heads, kv_heads, hd)._attend_native(plan, 1, q, k, v, out)
    return cache, q, k, v, out


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
def test_attention_matches_fp64_sdpa_and_stores_the_new_rows(kv_dtype):
    """A bf16 cache holds the new rows as torch rounds them, and each row's output is the
    fp32 attention over those keys and values, as with an fp32 cache."""
    lens, news = [0, 300, 77, 5, 1500], [1, 8, 3, 1, 4]  # 300, 1500: over several chunks
    cache, q, k, v, out = attend(list(zip(lens, news, range(5), strict=True)), kv_dtype=kv_dtype)
    off, group = 0, 3
    for s, (length, n) in enumerate(zip(lens, news, strict=True)):
        keys, values = cache.view(1, s, length + n)
        assert keys.dtype == kv_dtype
        assert torch.equal(keys[:, length:], k[off : off + n].transpose(0, 1).to(kv_dtype))
        assert torch.equal(values[:, length:], v[off : off + n].transpose(0, 1).to(kv_dtype))
        for r in range(n):  # row r sees keys 0..length+r
            qs = q[off + r].view(2, group, -1)[None].double()
            ref = F.scaled_dot_product_attention(
                qs,
                keys[None, :, : length + r + 1].double(),
                values[None, :, : length + r + 1].double(),
            )
            assert (ref.flatten().float() - out[off + r]).abs().max().item() < 1e-5
        off += n
    assert torch.equal(attend([(77, 3, 2)], kv_dtype=kv_dtype)[-1], out[9:12])  # alone
    assert torch.equal(attend([(1500, 4, 4)], kv_dtype=kv_dtype)[-1], out[13:17])


@pytest.mark.parametrize("length", [40, 124, 250, 700])  # 124, 250: blocks across chunks
def test_a_row_is_the_same_alone_in_a_block_or_in_any_batch(length):
    """Bit for bit: a sequence's rows do not depend on the others in the call, and row i
    of a verify block equals the 1-row step at the same position."""
    _, _, _, _, alone = attend([(length, 8, 3)])
    _, _, _, _, batched = attend([(500, 1, 4), (length, 8, 3), (3, 6, 5), (1100, 2, 6)])
    assert torch.equal(alone, batched[1:9])
    # the same sequence one row at a time: row i sees the cache up to length + i
    cache, q, k, v, block = attend([(length, 8, 3)])
    for i in range(8):
        batch = ForwardBatch([0], torch.zeros(1, dtype=torch.long), [1], [length + i], [1])
        plan = _AttnPlan(batch, cache, native.library())
        one = torch.empty(1, 6 * 32)
        _layer(6, 2, 32)._attend_native(plan, 1, q[i : i + 1], k[i : i + 1], v[i : i + 1], one)
        assert torch.equal(one[0], block[i])


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
def test_attention_paths_agree_bit_for_bit(kv_dtype):
    """The AVX-512 attention (16 keys' scores folded at once) and the portable one compute
    the same bits: the same multiply-adds and the same pairwise fold for every score."""
    portable = native.build_variant(("-mno-avx512f",))
    seqs = [(0, 1, 1), (300, 8, 2), (77, 3, 3), (16, 1, 4), (33, 2, 5), (1030, 8, 6)]
    for hd in (32, 64, 80):  # 80: a head wider than four vectors' step
        args = dict(heads=9, kv_heads=3, hd=hd, kv_dtype=kv_dtype)
        fast = attend(seqs, **args)[-1]
        assert torch.equal(fast, attend(seqs, lib=portable, **args)[-1])


def close(a: torch.Tensor, b: torch.Tensor, act: torch.dtype) -> bool:
    """Equal up to one rounding of ``act`` (torch rounds bf16 at every op, C once)."""
    rel = 1e-2 if act == torch.bfloat16 else 1e-5
    return bool(((a.float() - b.float()).abs() <= rel * b.float().abs() + 1e-5).all())


@pytest.mark.parametrize("act", [torch.float32, torch.bfloat16])
def test_rowwise_ops_match_torch(act):
    gen = torch.Generator().manual_seed(1)
    c, t = NativeOps(native.library()), TorchOps()
    h = torch.randn(5, 96, generator=gen)
    y = torch.randn(5, 96, generator=gen).to(act)
    w = torch.rand(96, generator=gen) + 0.5
    h1, h2 = h.clone(), h.clone()
    a, b = c.add_rms_norm(h1, y, w, 1e-6, act), t.add_rms_norm(h2, y, w, 1e-6, act)
    assert torch.equal(h1, h2)  # the residual add is one fp32 rounding in both
    assert a.dtype == act and close(a, b, act)

    heads, kv, hd = 4, 2, 32
    qkv = torch.randn(5, (heads + 2 * kv) * hd, generator=gen).to(act)
    bias = torch.randn((heads + 2 * kv) * hd, generator=gen)
    qn, kn = torch.rand(hd, generator=gen) + 0.5, torch.rand(hd, generator=gen) + 0.5
    ang = torch.rand(5, hd // 2, generator=gen) * 6
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
    for norms in ((None, None), (qn, kn)):
        got = c.qkv_rope(qkv, bias, *norms, 1e-6, cos, sin, heads, kv, hd)
        ref = t.qkv_rope(qkv, bias, *norms, 1e-6, cos, sin, heads, kv, hd)
        for x, r in zip(got, ref, strict=True):
            assert x.shape == r.shape and (x - r).abs().max().item() < 1e-5

    gu = torch.randn(5, 2 * 96, generator=gen).mul(4).to(act)
    got, ref = c.silu_mul(gu, act), t.silu_mul(gu, act)
    assert got.dtype == act and close(got, ref, act)


def test_a_sequence_decodes_the_same_alone_or_batched(tiny_checkpoints):
    """Whole model, int4 (row-invariant GEMMs): one request's logits are bit for bit the
    same whether it runs alone or beside others at other lengths."""
    runner = TargetRunner(TargetSpec(str(tiny_checkpoints["qwen2"]), quant="int4"))
    assert isinstance(runner.model.ops, NativeOps)
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 97, (n,), generator=gen).tolist() for n in (30, 90, 12)]
    for s, p in enumerate(prompts):
        runner.forward(ForwardBatch.single(s, p, 0))
    runner.forward(ForwardBatch.single(9, prompts[0], 0))
    alone = runner.forward(ForwardBatch.single(9, [5, 6, 7], 30, num_logits=3)).logits
    batch = ForwardBatch(
        [1, 0, 2], torch.tensor([1, 5, 6, 7, 2, 3]), [1, 3, 2], [90, 30, 12], [1, 3, 2]
    )
    together = runner.forward(batch).logits
    assert torch.equal(alone, together[1:4])


def test_without_a_compiler_the_model_uses_torch(monkeypatch):
    monkeypatch.setenv("LONGSPARK_NATIVE", "0")
    native.library.cache_clear()
    try:
        assert native.library() is None
        assert isinstance(ops_for(torch.float32, 64), TorchOps)
    finally:
        monkeypatch.delenv("LONGSPARK_NATIVE")
        native.library.cache_clear()
    assert isinstance(ops_for(torch.float32, 64), NativeOps)
    assert isinstance(ops_for(torch.float32, 40), TorchOps)  # head_dim off the vector width
    assert isinstance(ops_for(torch.bfloat16, 64), TorchOps)  # bf16 stream: torch


@pytest.mark.parametrize("quant", ["int4", "none"])
def test_a_prompt_prefills_the_same_whatever_it_is_batched_with(
    tiny_checkpoints, monkeypatch, quant
):
    """Prompt chunks lie on a fixed grid: packed after another prompt, a prompt is split
    where it would be alone, so its KV rows (and so its answer) are bit for bit the same.
    (Splitting by the leftover budget, as before, fails here in fp32: there the chunk
    rows also change the GEMMs' shapes.)"""
    from target_actor import verifier
    from target_actor.batch import PrefillBatch, SeqSampling
    from target_actor.worker import LocalTarget

    monkeypatch.setattr(verifier, "PREFILL_TOKENS", 64)
    target = LocalTarget(TargetSpec(str(tiny_checkpoints["llama"]), quant=quant))
    gen = torch.Generator().manual_seed(11)
    a, b = (torch.randint(0, 97, (n,), generator=gen).tolist() for n in (100, 40))
    greedy = SeqSampling()
    target.prefill(PrefillBatch([0], [a], [greedy], want_views=False))
    target.prefill(PrefillBatch([1, 2], [b, a], [greedy, greedy], want_views=False))
    cache = target.runner.cache
    assert torch.equal(cache.seqs[0].data[:, :, :, :100], cache.seqs[2].data[:, :, :, :100])


@pytest.fixture(scope="module", params=["native", "fp32-path"])
def gemm_lib(request):
    """The kernels as built for this CPU, and as built for one without AVX512-BF16 (the
    fp32 path), so both paths are checked on any machine that can compile them."""
    if request.param == "native":
        return native.library()
    return native.build_variant(("-mno-avx512bf16",))


@pytest.mark.parametrize("kind", [native.GEMM_INT8, native.GEMM_BF16])
def test_gemm_matches_fp64_and_a_row_never_depends_on_its_batch(gemm_lib, kind):
    from target_actor.linear import native_gemm

    gen = torch.Generator().manual_seed(0)
    N, K = 96, 160  # K: an odd number of 32-wide steps
    x = torch.randn(70, K, generator=gen).bfloat16()  # 70 rows: two passes of 64
    if kind == native.GEMM_INT8:
        w = torch.randint(-127, 128, (N, K), generator=gen, dtype=torch.int8)
        scale = torch.rand(N, generator=gen) * 0.01
        dense = w.double() * scale.double()[:, None]
    else:
        w, scale = torch.randn(N, K, generator=gen).bfloat16(), None
        dense = w.double()
    whole = native_gemm(gemm_lib, kind, x, w, scale)
    ref = x.double() @ dense.t()
    assert whole.dtype == torch.float32 and whole.shape == (70, N)
    assert (whole.double() - ref).abs().max() <= 1e-5 * ref.abs().max()
    for lo, hi in ((0, 1), (3, 11), (5, 6), (64, 70)):
        assert torch.equal(
            native_gemm(gemm_lib, kind, x[lo:hi].contiguous(), w, scale), whole[lo:hi]
        )


def test_gemm_build_variants_take_their_paths(gemm_lib):
    has_bf16 = "avx512_bf16" in native.cpu_flags().split()
    fp32_path = gemm_lib is not native.library()
    assert gemm_lib.ls_gemm_bf16_dot() == int(has_bf16 and not fp32_path)


def test_inference_linear_is_the_c_gemm_without_grads_and_torch_with_them():
    from target_actor.linear import inference_linear

    gen = torch.Generator().manual_seed(1)
    w = torch.randn(64, 96, generator=gen).bfloat16().requires_grad_()
    x = torch.randn(2, 3, 96, generator=gen)
    with torch.no_grad():
        fast = inference_linear(x, w)
    slow = inference_linear(x, w)
    assert fast.shape == slow.shape == (2, 3, 64) and fast.dtype == x.dtype
    assert slow.requires_grad and not fast.requires_grad
    assert (fast - x.bfloat16().float() @ w.detach().float().t()).abs().max() <= 1e-4


def _two_planes(x: torch.Tensor, planes: int = 2) -> torch.Tensor:
    """``x`` as ``csrc/q4.c`` sees it: per block of 32, ``dx * (q1 + q2 / 256)`` with
    ``dx = max|x| / 127`` and two int8 planes (``dx * q1`` with one)."""
    blocks = x.view(x.shape[0], -1, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    u = blocks * (127.0 / amax)
    hi = torch.round(u)
    lo = torch.round((u - hi) * 256).clamp(max=127) if planes == 2 else torch.zeros_like(u)
    return ((hi.double() + lo.double() / 256) * (amax / 127.0).double()).view_as(x)


@pytest.fixture(scope="module", params=["native", "portable"])
def q4_lib(request):
    """The int4 GEMM as built here, and as built for a CPU without AVX512-VNNI."""
    if request.param == "native":
        return native.library()
    return native.build_variant(("-mno-avx512vnni",))


def test_q4_gemm_is_q4_1_weights_times_the_inputs_and_rows_stand_alone(q4_lib, monkeypatch):
    """The int4 GEMM multiplies the exact Q4_1 weights (fp16 d, m) by each row quantised per
    block of 32, on both paths, and a row's result never depends on its batch."""
    from target_actor import linear
    from target_actor.linear import Int4Linear, quantize_q4_1

    monkeypatch.setattr(linear, "native_q4_lib", lambda shape: q4_lib)
    gen = torch.Generator().manual_seed(0)
    N, K = 48, 160  # three tiles of 16 channels; five blocks of 32
    w = torch.randn(N, K, generator=gen) * 0.05
    lin = Int4Linear(w)
    assert lin.lib is q4_lib and lin.act == torch.float32
    q, d, m = quantize_q4_1(w)
    d, m = d.half().double().repeat_interleave(32, 1), m.half().double().repeat_interleave(32, 1)
    x = torch.randn(150, K, generator=gen)  # 150 rows: two sweeps of 128, a ragged last tile
    for planes in (2, 1):  # 1: the int4-q8 form (llama.cpp's Q8 activations)
        lin.planes = planes
        whole = lin(x)
        ref = _two_planes(x, planes) @ (d * q + m).t()
        assert whole.dtype == torch.float32 and whole.shape == (150, N)
        assert (whole.double() - ref).abs().max() <= 1e-5 * ref.abs().max()
        for lo, hi in ((0, 1), (3, 11), (5, 6), (7, 16), (128, 150)):
            assert torch.equal(lin(x[lo:hi].contiguous()), whole[lo:hi])


def test_q4_gemm_paths_agree_bit_for_bit():
    """Exact integer sums and the same float steps: a machine with VNNI and one without
    compute the same bits (for a model whose every linear fits the kernel)."""
    from target_actor.linear import pack_q4, pack_w8, quantize_q4_1

    fast, portable = native.library(), native.build_variant(("-mno-avx512vnni",))
    gen = torch.Generator().manual_seed(2)
    w, x = torch.randn(32, 96, generator=gen), torch.randn(9, 96, generator=gen)
    q, d, m = quantize_q4_1(w)
    tiles = [s.view(2, 16, 3).transpose(1, 2).contiguous().half() for s in (d, m)]
    packed = pack_q4(q)
    q8 = pack_w8(torch.randint(-127, 128, (32, 96), generator=gen, dtype=torch.int8))
    d8 = tiles[0].clone()  # any fp16 scales of the tile shape
    outs = []
    for lib in (fast, portable):
        y4, y4_1, y8, y8_1 = (torch.empty(9, 32) for _ in range(4))
        args = (x.data_ptr(), 9, 96, packed.data_ptr(), *(t.data_ptr() for t in tiles), 32)
        assert lib.ls_gemm_q4(*args, y4.data_ptr(), 2) == 0
        assert lib.ls_gemm_q4(*args, y4_1.data_ptr(), 1) == 0
        args = (x.data_ptr(), 9, 96, q8.data_ptr(), d8.data_ptr(), 32)
        assert lib.ls_gemm_w8(*args, y8.data_ptr(), 2) == 0
        assert lib.ls_gemm_w8(*args, y8_1.data_ptr(), 1) == 0
        outs.append((y4, y4_1, y8, y8_1))
    for fast_out, portable_out in zip(*outs, strict=True):
        assert torch.equal(fast_out, portable_out)
    has_vnni = "avx512_vnni" in native.cpu_flags().split()
    assert fast.ls_gemm_q4_vnni() == int(has_vnni) and portable.ls_gemm_q4_vnni() == 0


def test_amx_gemm_computes_the_vnni_bits():
    """Where the CPU has AMX, its tile passes (8 rows and more) take the same integer sums
    and float steps as the VNNI passes: every row count, both kinds, both plane counts."""
    from target_actor.linear import pack_q4, pack_w8, quantize_q4_1

    lib = native.library()
    if lib is None or not lib.ls_gemm_amx(1):
        pytest.skip("no AMX here (CPU, kernel or build)")
    gen = torch.Generator().manual_seed(4)
    N, K = 48, 576  # three tiles; 18 blocks: a whole chunk of 16 blocks and a short one
    q, d, m = quantize_q4_1(torch.randn(N, K, generator=gen))
    tiles = [s.view(3, 16, 18).transpose(1, 2).contiguous().half() for s in (d, m)]
    packed = pack_q4(q)
    q8 = pack_w8(torch.randint(-127, 128, (N, K), generator=gen, dtype=torch.int8))
    x = torch.randn(150, K, generator=gen) * torch.rand(150, 1, generator=gen)
    try:
        for M in (8, 9, 16, 17, 40, 150):  # one pass, ragged passes, two sweeps
            for planes in (2, 1):
                outs = []
                for amx in (0, 1):
                    assert lib.ls_gemm_amx(amx) == amx
                    y4, y8 = torch.empty(M, N), torch.empty(M, N)
                    ptrs = (x.data_ptr(), M, K, packed.data_ptr(), *(t.data_ptr() for t in tiles))
                    assert lib.ls_gemm_q4(*ptrs, N, y4.data_ptr(), planes) == 0
                    ptrs = (x.data_ptr(), M, K, q8.data_ptr(), tiles[0].data_ptr(), N)
                    assert lib.ls_gemm_w8(*ptrs, y8.data_ptr(), planes) == 0
                    outs.append((y4, y8))
                for vnni, amx in zip(*outs, strict=True):
                    assert torch.equal(vnni, amx), (M, planes)
    finally:
        lib.ls_gemm_amx(1)


def test_w8_gemm_is_q8_0_weights_times_the_inputs_and_rows_stand_alone(q4_lib, monkeypatch):
    """int8 weights (the int4 form's LM head) as GGUF Q8_0 blocks: a dequantised Q8_0 grid
    comes back exactly, and goes through the same integer dot products."""
    from target_actor import linear
    from target_actor.linear import Int8Linear, quantize_q8_0

    monkeypatch.setattr(linear, "native_q4_lib", lambda shape: q4_lib)
    gen = torch.Generator().manual_seed(3)
    q = torch.randint(-127, 128, (64, 96), generator=gen)
    q[:, 0::32] = 127  # each block reaches its scale, as a Q8_0 quantiser leaves it
    d = (torch.rand(64, 3, generator=gen) * 0.01 + 1e-3).half().float()
    w = d.repeat_interleave(32, 1) * q
    q_back, d_back = quantize_q8_0(w)
    assert torch.equal(q_back.long(), q) and torch.equal(d_back, d)
    lin = Int8Linear(w)
    assert lin.int_lib is q4_lib and lin.act == torch.float32
    x = torch.randn(20, 96, generator=gen)
    for planes in (2, 1):  # 1: the drafter's (llama.cpp's Q8 activations)
        lin.planes = planes
        whole = lin(x)
        ref = _two_planes(x, planes) @ w.double().t()
        assert (whole.double() - ref).abs().max() <= 1e-5 * ref.abs().max()
        for lo, hi in ((0, 1), (2, 10), (9, 20)):
            assert torch.equal(lin(x[lo:hi].contiguous()), whole[lo:hi])
    with pytest.raises(ValueError, match="planes"):
        Int8Linear(w, planes=3)


@pytest.mark.parametrize(
    ("arch", "quant"), [("llama", "int4"), ("qwen3", "int4"), ("llama", "int8")]
)
def test_the_layers_in_one_c_call_give_the_python_loops_bits(tiny_checkpoints, arch, quant):
    """``csrc/decoder.c`` runs the kernels the Python loop calls, in its order: decode rows
    and verify blocks of several sequences, with taps, come out bit for bit the same (and
    a prompt chunk, which it does not take, goes through the loop)."""
    runner = TargetRunner(TargetSpec(str(tiny_checkpoints[arch]), quant=quant, num_taps=2))
    model = runner.model
    fused = model.native
    assert fused is not None
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 97, (n,), generator=gen).tolist() for n in (40, 9)]
    outs = {}
    for name, native_decoder in (("fused", fused), ("loop", None)):
        model.native = native_decoder
        base = 0 if name == "fused" else 10  # the same sequences under other ids
        for s, p in enumerate(prompts):
            runner.forward(ForwardBatch.single(base + s, p, 0))
        steps = []
        for start, rows in ((0, [1, 1]), (1, [1, 5])):  # decode rows, then a verify block
            tokens = torch.randint(
                0, 97, (sum(rows),), generator=torch.Generator().manual_seed(start)
            )
            batch = ForwardBatch(
                [base, base + 1], tokens, rows, [40 + start, 9 + start], rows, return_taps=True
            )
            steps.append(runner.forward(batch))
        outs[name] = steps
    model.native = fused
    for a, b in zip(outs["fused"], outs["loop"], strict=True):
        assert torch.equal(a.logits, b.logits)
        assert torch.equal(a.tap_hidden, b.tap_hidden)
        assert torch.equal(a.tap_k, b.tap_k) and torch.equal(a.tap_v, b.tap_v)


def _attend_torch(layer, cache, q, k, v, rows: slice, start: int) -> torch.Tensor:
    """``rows`` of q/k/v at ``start`` through the torch path, rows alone (``row_exact``)."""
    n = rows.stop - rows.start
    batch = ForwardBatch([0], torch.zeros(n, dtype=torch.long), [n], [start], [n])
    plan = _AttnPlan(batch, cache, None, row_exact=True)
    return layer._attend(q[rows], k[rows], v[rows], plan, cache, 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_without_the_kernel_a_row_is_the_same_alone_or_in_a_block(dtype):
    """The torch path (no C kernels; rows alone where ``row_exact``): row i of a verify
    block equals the 1-row step at its position: both fold a KV group's query heads into
    one SDPA call the same way."""
    heads, kv_heads, hd, length = 6, 2, 32, 40
    layer = _layer(heads, kv_heads, hd)
    gen = torch.Generator().manual_seed(7)
    cache = KVCache(1, kv_heads, hd, 1000, dtype=dtype)
    cache.reserve(0, length + 8)
    cache.set_length(0, length + 8)
    data = cache.seqs[0].data
    data[:, :, :, :length].copy_(torch.randn(data[:, :, :, :length].shape, generator=gen))
    q, k, v = (torch.randn(8, h, hd, generator=gen).to(dtype) for h in (heads, kv_heads, kv_heads))
    block = _attend_torch(layer, cache, q, k, v, slice(0, 8), length)
    for i in range(8):
        one = _attend_torch(layer, cache, q, k, v, slice(i, i + 1), length + i)
        assert torch.equal(one[0], block[i]), i
