"""Waiting and running queues; admission by KV capacity and a cap on running sequences.

Each admitted sequence reserves the KV rows it can ever need (prompt + max_tokens + one
verify block, capped by the context), so a running sequence never finds the cache full
mid-generation and nothing has to be preempted. The reservation is released when the
sequence finishes or is aborted.
"""

from __future__ import annotations

from collections import deque

from services.engine.sequence import SeqStatus, Sequence


class Scheduler:
    def __init__(
        self,
        kv_capacity_tokens: int,
        max_num_seqs: int,
        max_prefill_seqs: int,
        block_extra: int,
        max_len: int,
    ) -> None:
        self.capacity = kv_capacity_tokens
        self.max_num_seqs, self.max_prefill_seqs = max_num_seqs, max_prefill_seqs
        self.block_extra, self.max_len = block_extra, max_len
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.reserved: dict[int, int] = {}

    @property
    def reserved_tokens(self) -> int:
        return sum(self.reserved.values())

    def need(self, seq: Sequence) -> int:
        return min(
            len(seq.prompt_ids) + seq.params.max_tokens + self.block_extra,
            self.max_len + self.block_extra,
        )

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def admit(self) -> list[Sequence]:
        """Move waiting sequences to running, FIFO, while they fit (head-of-line blocking)."""
        admitted: list[Sequence] = []
        while (
            self.waiting
            and len(admitted) < self.max_prefill_seqs
            and len(self.running) + len(admitted) < self.max_num_seqs
        ):
            seq = self.waiting[0]
            need = self.need(seq)
            if self.reserved_tokens + need > self.capacity:
                break
            self.waiting.popleft()
            self.reserved[seq.seq_id] = need
            seq.status = SeqStatus.RUNNING
            admitted.append(seq)
        self.running.extend(admitted)
        return admitted

    def can_ever_fit(self, seq: Sequence) -> bool:
        return self.need(seq) <= self.capacity

    def finish(self, seq: Sequence) -> None:
        """Drop a sequence from whichever queue holds it and release its reservation."""
        seq.status = SeqStatus.FINISHED
        self.reserved.pop(seq.seq_id, None)
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
