"""One request's life in the engine: its tokens, stop rules, stats and output stream."""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from services.engine.adaptive.ngram_index import NgramIndex
from services.engine.detokenizer import IncrementalDetokenizer
from services.engine.params import SamplingParams
from services.engine.stopping import StopChecker


class SeqStatus(enum.Enum):
    WAITING = "waiting"  # not admitted yet, or preempted (then it has output already)
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class SpecStats:
    """Per-request speculation counters (vLLM's names: drafts, draft / accepted tokens)."""

    rounds: int = 0
    num_drafts: int = 0  # rounds that verified at least one draft token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    def observe(self, num_draft: int, num_accepted: int) -> None:
        self.rounds += 1
        if num_draft == 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_draft
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_pos) < num_draft:
            self.accepted_per_pos += [0] * (num_draft - len(self.accepted_per_pos))
        for i in range(num_accepted):
            self.accepted_per_pos[i] += 1

    @property
    def mean_accepted_length(self) -> float:
        """Tokens committed per drafting round, the bonus/recovered token included (tau)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0


@dataclass
class OutputLogprob:
    """A generated token's log-probability with the most likely tokens at its place, as
    text and id (what the API renders in OpenAI's logprobs shapes)."""

    token: str
    token_id: int
    logprob: float | None  # None: the prompt's first token (nothing before it)
    top: list[tuple[str, int, float]] = field(default_factory=list)
    rank: int | None = None  # the token's place in its distribution (prompt tokens)


@dataclass
class RequestOutput:
    """What a request's stream receives after a round (deltas) or at its end."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None = None
    text: str = ""  # the whole output so far
    token_ids: list[int] = field(default_factory=list)  # the whole output so far
    num_prompt_tokens: int = 0
    stats: SpecStats | None = None
    error: str | None = None  # set on the final output of a request the engine failed
    new_logprobs: list[OutputLogprob] | None = None  # one per new token, if asked for
    logprobs: list[OutputLogprob] | None = None  # the whole output's, on the final output
    prompt_logprobs: list[OutputLogprob] | None = None  # on the first output, if asked


@dataclass(eq=False)
class Sequence:
    seq_id: int
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    stopper: StopChecker
    on_output: Callable[[RequestOutput], None] | None = None
    status: SeqStatus = SeqStatus.WAITING
    output_ids: list[int] = field(default_factory=list)  # committed generated tokens
    logprobs: list[OutputLogprob] = field(default_factory=list)  # one per output id, if asked
    prompt_logprobs: list[OutputLogprob] | None = None  # one per prompt token, if asked
    finish_reason: str | None = None
    error: str | None = None  # why the engine failed this request (finish reason "error")
    stats: SpecStats = field(default_factory=SpecStats)
    arrival_time: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    finish_time: float | None = None
    emitted_tokens: int = 0  # how many output tokens the stream has seen
    emitted_text: str = ""
    detokenizer: IncrementalDetokenizer | None = None  # the output's text, read as it grows
    ngrams: NgramIndex = field(default_factory=NgramIndex)  # engine-side context copies
    preemptions: int = 0  # times its KV was dropped for others' and recomputed

    @property
    def cache_len(self) -> int:
        """Committed tokens in the target cache: all but the last output token (the anchor)."""
        return len(self.prompt_ids) + len(self.output_ids) - 1

    @property
    def anchor(self) -> int:
        return self.output_ids[-1]

    @property
    def total_len(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def remaining(self) -> int:
        return self.params.max_tokens - len(self.output_ids)
