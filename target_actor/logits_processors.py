"""Logits processors that read a sequence's own tokens: penalties, logit bias, min_tokens.

They turn the target's raw logits into the logits its distribution ``p`` is built from
(``target_actor.sampling.target_probs``; greedy takes their argmax). In a verify round,
row ``j`` of a sequence is processed as if its drafts ``d_1..d_j`` had already been
generated one by one: the counts row ``j`` sees are the committed output's plus those
drafts, and ``min_tokens`` counts them too. So each draft is verified against exactly
the distribution plain decoding would have sampled it from, and speculative output stays
lossless under penalties. The drafter's ``q`` ignores them; exactness does not need it.

vLLM's definitions and order: the logit bias and ``min_tokens`` (the stop ids masked
while fewer tokens are out) first, then the repetition penalty over prompt and output
tokens (a positive logit divided by it, a negative one multiplied), then the frequency
(x count) and presence (x seen) penalties over the output tokens.
"""

from __future__ import annotations

import torch

from target_actor.batch import SeqSampling


class TokenHistory:
    """One sequence's tokens as its processors see them (kept next to the sampling, on
    rank 0). Like the KV cache it is rewound to the round's start before each verify,
    so a round retried after a failure counts its tokens once."""

    def __init__(
        self,
        sampling: SeqSampling,
        prompt: list[int],
        vocab: int,
        device: torch.device | str = "cpu",
    ) -> None:
        self.sampling, self.device = sampling, torch.device(device)
        self.prompt_len = len(prompt)
        self.output: list[int] = []
        dev = self.device
        self.counts = torch.zeros(vocab, device=dev) if sampling.counts_tokens else None
        self.prompt_seen = None
        if sampling.repetition_penalty != 1.0:
            self.prompt_seen = torch.zeros(vocab, dtype=torch.bool, device=dev)
            self.prompt_seen[torch.tensor(prompt, dtype=torch.long, device=dev)] = True

    def _ids(self, tokens: list[int]) -> torch.Tensor:
        return torch.tensor(tokens, dtype=torch.long, device=self.device)

    def extend(self, tokens: list[int]) -> None:
        self.output.extend(tokens)
        if self.counts is not None and tokens:
            ones = torch.ones(len(tokens), device=self.device)
            self.counts.index_add_(0, self._ids(tokens), ones)

    def rewind(self, num_output: int) -> None:
        """Forget the output tokens past the first ``num_output``."""
        dropped = self.output[num_output:]
        if not dropped:
            return
        del self.output[num_output:]
        if self.counts is not None:
            ones = torch.ones(len(dropped), device=self.device)
            self.counts.index_add_(0, self._ids(dropped), -ones)

    def process(self, logits: torch.Tensor, drafts: list[int]) -> torch.Tensor:
        """Rows ``[1 + len(drafts), vocab]`` of raw logits -> processed (fp32); row ``j``
        as if ``drafts[:j]`` had been generated."""
        sp, rows = self.sampling, logits.shape[0]
        logits = logits.float()
        if sp.logit_bias:
            bias = torch.tensor(list(sp.logit_bias.values()), device=logits.device)
            logits[:, self._ids(list(sp.logit_bias))] += bias
        short = min(rows, sp.min_tokens - len(self.output))  # rows still below min_tokens
        if short > 0 and sp.stop_ids:
            logits[:short, list(sp.stop_ids)] = float("-inf")
        if self.counts is None:
            return logits
        counts = self.counts.expand(rows, -1)
        if drafts:
            seen_drafts = torch.zeros(rows, counts.shape[1], device=self.device)
            seen_drafts[torch.arange(1, rows, device=self.device), self._ids(drafts)] = 1.0
            counts = counts + seen_drafts.cumsum_(0)
        if sp.repetition_penalty != 1.0:
            seen = (counts > 0) | self.prompt_seen
            penalised = torch.where(
                logits > 0, logits / sp.repetition_penalty, logits * sp.repetition_penalty
            )
            logits = torch.where(seen, penalised, logits)
        if sp.frequency_penalty:
            logits = logits - sp.frequency_penalty * counts
        if sp.presence_penalty:
            logits = logits - sp.presence_penalty * (counts > 0).float()
        return logits
