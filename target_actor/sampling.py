"""The distribution a sequence actually samples from: ``p`` = processed target probabilities.

``target_probs`` applies temperature, then min-p, then top-k, then top-p, and renormalises
(vLLM's order). The logits it takes are already processed (penalties, logit bias,
``min_tokens``: ``target_actor.logits_processors``). Plain
decoding samples from it and the rejection sampler verifies drafts against exactly the
same ``p``, which keeps speculative output lossless. Greedy (``temperature == 0``) never
builds ``p``: it takes the argmax of the logits.

Every setting the boundary accepts gives a proper distribution: temperatures below
``SAMPLING_EPS`` are greedy (as in vLLM: ``logits / T`` would overflow fp32), and top-p
keeps at least the most likely token, however small ``top_p`` is (a ``top_p`` that
rounds to 0 in fp32 used to mask every token).
"""

from __future__ import annotations

import torch

from target_actor.batch import TokenLogprobs
from target_actor.native import library

TOP_P_CANDIDATES = 1024  # top-p sorts only this many candidates when they hold enough mass
SAMPLING_EPS = 1e-5  # temperatures below this are greedy


def target_probs(
    logits: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float = 0.0
) -> torch.Tensor:
    """``logits`` ``[n, vocab]`` -> the processed distribution ``[n, vocab]`` (fp32, sums to 1)."""
    logits = logits.float() / temperature
    if min_p > 0.0:  # drop tokens less likely than min_p x the most likely one
        probs = softmax(logits)
        floor = min_p * probs.amax(-1, keepdim=True)
        logits = logits.masked_fill(probs < floor, float("-inf"))
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = softmax(logits)
    if top_p < 1.0:
        probs = _top_p(probs, top_p)
    return probs


def softmax(logits: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dim of fp32 ``[n, vocab]`` logits. On the CPU with the C
    kernels: ``csrc/sample.c``, each row alone in a fixed order (the same bits in any
    batch); ``torch.softmax`` slows several-fold on rows whose exps fall below fp32's
    normal range (a low temperature), which the C exp clamps."""
    lib = library()
    if lib is None or logits.device.type != "cpu" or logits.dim() != 2:
        return torch.softmax(logits, dim=-1)
    x = logits.contiguous()
    out = torch.empty_like(x)
    lib.ls_softmax(x.data_ptr(), x.shape[0], x.shape[1], out.data_ptr())
    return out


def _top_p(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose mass reaches ``top_p``, renormalised.

    Sorting the whole vocabulary is the slow part, so only the top candidates are sorted
    when they already hold ``top_p`` of the mass (the usual case): in C where the kernels
    are built (``csrc/sample.c``, each row alone), else among ``torch.topk``'s. A row whose
    candidates hold less (a flat distribution) is sorted whole."""
    lib = library()
    if lib is None or probs.device.type != "cpu" or probs.dim() != 2:
        return _top_p_torch(probs, top_p)
    p = probs.contiguous()
    n, vocab = p.shape
    out = torch.empty_like(p)
    done = torch.empty(n, dtype=torch.uint8, device=p.device)
    scratch = torch.empty(TOP_P_CANDIDATES * 16, dtype=torch.uint8, device=p.device)
    lib.ls_top_p(
        p.data_ptr(), n, vocab, top_p, TOP_P_CANDIDATES, scratch.data_ptr(), out.data_ptr(),
        done.data_ptr(),
    )  # fmt: skip
    for r in (done == 0).nonzero().flatten().tolist():  # one at a time: any batch, same bits
        out[r] = _top_p_torch(p[r : r + 1], top_p)[0]
    return out


def _top_p_torch(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    n_cand = min(TOP_P_CANDIDATES, probs.shape[-1])
    sorted_p, idx = probs.topk(n_cand, dim=-1)  # descending
    if n_cand < probs.shape[-1] and bool((sorted_p.sum(-1) < top_p).any()):
        sorted_p, idx = probs.sort(dim=-1, descending=True)
    before = sorted_p.cumsum(-1) - sorted_p  # mass strictly before each token
    drop = before >= top_p
    drop[..., 0] = False  # the most likely token always stays
    sorted_p = sorted_p.masked_fill(drop, 0.0)
    out = torch.zeros_like(probs).scatter_(-1, idx, sorted_p)
    return out / out.sum(-1, keepdim=True)


def token_logprobs(
    logprobs: torch.Tensor, tokens: list[int], top: int, rank: bool = False
) -> list[TokenLogprobs]:
    """Rows ``[>= len(tokens), vocab]`` of log-probabilities -> token ``j``'s entry from row
    ``j``, with the ``top`` most likely tokens of that row (and the token's rank there)."""
    rows = logprobs[: len(tokens)]
    dev = rows.device
    chosen_t = rows[torch.arange(len(tokens), device=dev), torch.tensor(tokens, device=dev)]
    chosen = chosen_t.tolist()
    if top:
        best = rows.topk(top, dim=-1)
        ids, values = best.indices.tolist(), best.values.tolist()
    else:
        ids = values = [[] for _ in tokens]
    ranks: list[int | None] = [None] * len(tokens)
    if rank:
        ranks = ((rows > chosen_t[:, None]).sum(-1) + 1).tolist()
    return [
        TokenLogprobs(c, i, v, r) for c, i, v, r in zip(chosen, ids, values, ranks, strict=True)
    ]
