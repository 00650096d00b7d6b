"""Structured output on the target side: a grammar's token mask on every verified row.

A sequence with a grammar (a JSON schema, a regex, a choice or a Lark grammar, compiled
to llguidance's form by ``services.engine.structured``) keeps an llguidance matcher here,
next to its sampling, on rank 0. Its distribution ``p`` at row ``j`` of a verify block is
the target's with every token the grammar forbids after ``output + d_1..d_j`` masked out:
the matcher consumes the drafts row by row to build the masks, then rolls them back, and
after sampling consumes what was committed. So rejection sampling stays exact and the
output always follows the grammar. Drafts are cut after the first token the grammar forbids
before the forward: the first forbidden one stays (it is verified against the row before
it and surely rejected), the rows after it would be wasted.

Like the token history, the matcher is rewound to the round's start before each verify,
so a round retried after a failure consumes its tokens once.
"""

from __future__ import annotations

import functools

import torch

from target_actor.errors import LongSparkError


class GrammarError(LongSparkError, ValueError):
    """A grammar llguidance cannot compile for this tokenizer (one line)."""


@functools.lru_cache(maxsize=4)
def ll_tokenizer(model_dir: str, eos_ids: tuple[int, ...]):
    """llguidance's view of the model's tokenizer (built once per process: ~1 s)."""
    import llguidance.hf
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(model_dir)
    return llguidance.hf.from_tokenizer(hf, eos_token=list(eos_ids) or None)


def check_grammar(grammar: str, tokenizer) -> None:
    """Raise ``GrammarError`` naming the problem if ``grammar`` does not compile."""
    from llguidance import LLMatcher

    error = LLMatcher.validate_grammar(grammar, tokenizer)
    if error and not error.startswith("WARNING"):
        raise GrammarError(f"the grammar does not compile: {error.splitlines()[0]}")


class GrammarState:
    """One sequence's matcher: masks for its rows, drafts cut, committed tokens consumed."""

    def __init__(self, grammar: str, tokenizer) -> None:
        from llguidance import LLMatcher

        self.matcher = LLMatcher(tokenizer, grammar)
        if self.matcher.is_error():
            raise GrammarError(f"the grammar does not compile: {self.matcher.get_error()}")
        self.vocab = tokenizer.vocab_size  # the mask's width (the logits may be wider)
        self.consumed = 0  # output tokens the matcher has taken

    def rewind(self, num_output: int) -> None:
        """Forget the output tokens past the first ``num_output``."""
        if self.consumed > num_output:
            self.matcher.rollback(self.consumed - num_output)
            self.consumed = num_output

    def cut(self, drafts: list[int]) -> list[int]:
        """The drafts up to and including the first one the grammar forbids: that one is
        still verified (against the row before it, which the block has anyway) and surely
        rejected, so the output token there is the residual exactness needs; the rows
        after it would be wasted. (Dropping the forbidden draft too would make that token
        a bonus drawn from ``p``, biased: the cut would depend on the draft itself.)"""
        return drafts[: self.matcher.validate_tokens(drafts) + 1] if drafts else drafts

    def mask(self, logits: torch.Tensor, drafts: list[int]) -> torch.Tensor:
        """Rows ``[1 + len(drafts), vocab]`` with the grammar's forbidden tokens at -inf
        (in place); row ``j`` as the matcher stands after ``drafts[:j]``. Rows past a
        forbidden draft are never used (it is rejected) and keep the mask before it."""
        import llguidance.torch as llt

        valid = self.matcher.validate_tokens(drafts) if drafts else 0
        bitmask = llt.allocate_token_bitmask(logits.shape[0], self.vocab)
        for j in range(logits.shape[0]):
            if j <= valid:
                llt.fill_next_token_bitmask(self.matcher, bitmask, j)
                if j < valid:
                    self.matcher.consume_token(drafts[j])
            else:
                bitmask[j] = bitmask[valid]
        if valid:
            self.matcher.rollback(valid)
        # llguidance fills a host bitmask; it crosses to the logits' device packed (1/32)
        allowed = _unpack(bitmask.to(logits.device), logits.shape[1])
        return logits.masked_fill_(~allowed, float("-inf"))

    def commit(self, tokens: list[int]) -> None:
        """The round's committed tokens. Those past the grammar's end (a round commits up
        to k + 1 tokens; the engine drops the ones past EOS or max_tokens) are not fed."""
        valid = self.matcher.validate_tokens(tokens)
        self.matcher.consume_tokens(tokens[:valid])
        self.consumed += valid

    def is_done(self) -> bool:
        return self.matcher.is_stopped()


_BITS = torch.arange(32, dtype=torch.int32, device="cpu")


def _unpack(bitmask: torch.Tensor, width: int) -> torch.Tensor:
    """llguidance's packed int32 bitmask ``[rows, words]`` -> bool ``[rows, width]`` (plain
    torch ops: llguidance's own apply compiles a kernel on first use, seconds on a CPU).
    Tokens past the mask's vocabulary are forbidden."""
    bits = _BITS.to(bitmask.device)
    allowed = ((bitmask.unsqueeze(-1) >> bits) & 1).flatten(1).bool()  # [rows, 32 * words]
    if allowed.shape[1] >= width:
        return allowed[:, :width]
    pad = torch.zeros(
        allowed.shape[0], width - allowed.shape[1], dtype=torch.bool, device=bitmask.device
    )
    return torch.cat([allowed, pad], dim=1)
