"""Waiting and running queues, and the KV blocks each running sequence holds.

The scheduler owns the target's KV pool, as vLLM's block manager does: it grants each
running sequence a capacity in whole blocks and every forward tells the ranks that
capacity, so the ranks allocate exactly what was granted and the two books never drift.

- **Admission** by current need: a sequence enters with room for what it has (its prompt,
  or a preempted sequence's prompt and output) plus one verify block, FIFO while that
  fits above a small watermark of free blocks, never in a step that had to preempt.
- **Growth** before each round: a running sequence short of room for its next verify
  block grows by a quarter (fewer reallocations of its contiguous cache), or by just
  what it needs when blocks are tight.
- **Preemption** when even that does not fit: the most recently admitted running
  sequence gives its blocks back (recompute: its KV is dropped, everything else kept)
  and waits at the head of the queue; the oldest sequences always make progress, and a
  request is refused at arrival only if it could not finish alone in the whole pool.
"""

from __future__ import annotations

from collections import deque

from services.engine.sequence import SeqStatus, Sequence

WATERMARK = 0.01  # of the pool kept free at admission, so admitting does not preempt at once


class Scheduler:
    def __init__(
        self,
        total_blocks: int,
        block_size: int,
        max_num_seqs: int,
        max_prefill_seqs: int,
        lookahead: int,
        max_len: int,
    ) -> None:
        self.total_blocks, self.block_size = total_blocks, block_size
        self.max_num_seqs, self.max_prefill_seqs = max_num_seqs, max_prefill_seqs
        self.lookahead, self.max_len = lookahead, max_len  # lookahead: one verify block
        self.watermark = int(WATERMARK * total_blocks)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order: the last is preempted first
        self.blocks: dict[int, int] = {}  # seq_id -> blocks granted (running sequences)
        self.used_blocks = 0

    # -- accounting -------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        """The pool, in tokens."""
        return self.total_blocks * self.block_size

    @property
    def reserved_tokens(self) -> int:
        return self.used_blocks * self.block_size

    @property
    def free_blocks(self) -> int:
        return self.total_blocks - self.used_blocks

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def granted(self, seq: Sequence) -> int:
        """The tokens ``seq``'s KV cache may hold (what the ranks allocate for it)."""
        return self.blocks[seq.seq_id] * self.block_size

    def _room(self, seq: Sequence) -> int:
        """Rows ``seq`` needs in its cache through its next verify block."""
        committed = len(seq.prompt_ids) + max(0, len(seq.output_ids) - 1)
        return min(committed + self.lookahead, self.max_len + self.lookahead)

    def can_ever_fit(self, seq: Sequence) -> bool:
        """Whether ``seq`` could run to ``max_tokens`` with the whole pool to itself."""
        worst = min(len(seq.prompt_ids) + seq.params.max_tokens, self.max_len) + self.lookahead
        return self.blocks_for(worst) <= self.total_blocks

    # -- queues -----------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def admit(self) -> list[Sequence]:
        """Move waiting sequences to running, FIFO, while they fit above the watermark
        (head-of-line blocking). Preempted sequences come first: they head the queue."""
        admitted: list[Sequence] = []
        while (
            self.waiting
            and len(admitted) < self.max_prefill_seqs
            and len(self.running) + len(admitted) < self.max_num_seqs
        ):
            seq = self.waiting[0]
            need = self.blocks_for(self._room(seq))
            # alone, a sequence may take every block (it was checked to fit at arrival)
            floor = self.watermark if self.running or admitted else 0
            if self.free_blocks - need < floor:
                break
            self.waiting.popleft()
            self._grant(seq, need)
            seq.status = SeqStatus.RUNNING
            admitted.append(seq)
        self.running.extend(admitted)
        return admitted

    def full(self) -> bool:
        """Whether a waiting request waits for room (a slot, or KV blocks), not only for its
        turn among the next step's prefills: then a sequence that ends early lets it in."""
        if not self.waiting:
            return False
        if len(self.running) >= self.max_num_seqs:
            return True
        return self.free_blocks - self.blocks_for(self._room(self.waiting[0])) < self.watermark

    def grow(self) -> list[Sequence]:
        """Give every running sequence room for its next verify block, oldest first,
        preempting from the newest end when the pool runs out; the preempted ones."""
        preempted: list[Sequence] = []
        i = 0
        while i < len(self.running):
            seq = self.running[i]
            room, have = self._room(seq), self.blocks[seq.seq_id]
            need = self.blocks_for(room)
            if need <= have:
                i += 1
                continue
            while need - have > self.free_blocks and self.running[-1] is not seq:
                preempted.append(self._preempt(self.running[-1]))
            if need - have > self.free_blocks:  # it is the newest itself
                preempted.append(self._preempt(seq))
                continue
            # a quarter more (fewer copies of its cache) while that leaves the watermark free
            roomy = self.blocks_for(
                min(max(room, (have + have // 4) * self.block_size), self.max_len + self.lookahead)
            )
            self._grant(seq, need if roomy - have > self.free_blocks - self.watermark else roomy)
            i += 1
        return preempted

    def finish(self, seq: Sequence) -> None:
        """Drop a sequence from whichever queue holds it and release its blocks."""
        seq.status = SeqStatus.FINISHED
        self._release(seq)
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)

    # -- internals --------------------------------------------------------------------
    def _grant(self, seq: Sequence, blocks: int) -> None:
        self.used_blocks += blocks - self.blocks.get(seq.seq_id, 0)
        self.blocks[seq.seq_id] = blocks

    def _release(self, seq: Sequence) -> None:
        self.used_blocks -= self.blocks.pop(seq.seq_id, 0)

    def _preempt(self, seq: Sequence) -> Sequence:
        """``seq`` leaves the running batch for the head of the queue, holding no blocks."""
        self._release(seq)
        self.running.remove(seq)
        seq.status = SeqStatus.WAITING
        seq.preemptions += 1
        self.waiting.appendleft(seq)
        return seq
