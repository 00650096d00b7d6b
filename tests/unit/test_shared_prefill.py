"""A prompt that several sequences of one prefill share (n choices of a request) runs
once and is forked: the copies get the leader's KV rows bit for bit, and each samples its
first token with its own generator, as if it had been prefilled alone."""

from __future__ import annotations

import torch

from target_actor.batch import PrefillBatch, SeqSampling
from target_actor.runner import TargetSpec
from target_actor.worker import LocalTarget


def test_a_shared_prompt_runs_once_and_forks(tiny_checkpoints, monkeypatch):
    from target_actor import verifier

    monkeypatch.setattr(verifier, "PREFILL_TOKENS", 32)  # several chunks
    target = LocalTarget(TargetSpec(str(tiny_checkpoints["llama"])))
    gen = torch.Generator().manual_seed(3)
    a, b = (torch.randint(0, 97, (n,), generator=gen).tolist() for n in (70, 20))
    hot = [SeqSampling(temperature=1.0, seed=s) for s in (1, 2, 3, 4)]

    forwarded: list[int] = []
    real_forward = target.runner.forward
    monkeypatch.setattr(
        target.runner,
        "forward",
        lambda batch: forwarded.append(len(batch.token_ids)) or real_forward(batch),
    )
    shared, _ = target.prefill(PrefillBatch([0, 1, 2, 3], [a, b, a, a], hot, want_views=False))
    assert sum(forwarded) == len(a) + len(b)  # each distinct prompt once

    alone = []
    for i, (prompt, s) in enumerate(zip([a, b, a, a], hot, strict=True)):
        out, _ = target.prefill(PrefillBatch([10 + i], [prompt], [s], want_views=False))
        alone.append(out.committed[0])
    assert shared.committed == alone  # own generators, same distributions
    cache = target.runner.cache
    for copy in (2, 3):
        assert cache.length(copy) == len(a)
        assert torch.equal(
            cache.seqs[copy].data[..., : len(a), :], cache.seqs[0].data[..., : len(a), :]
        )
    target.free([0, 1, 2, 3])
    assert 2 not in cache.seqs and 3 not in cache.seqs  # copies free like any sequence
