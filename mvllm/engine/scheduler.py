"""Continuous batching: FCFS admission up to max_active, decode of running requests, preemption by
recompute when KV blocks run out."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from mvllm.engine.block_manager import BlockManager
from mvllm.engine.sequence import PENDING, Sequence, Status


@dataclass(slots=True)
class Batch:
    prefill: list[Sequence] = field(default_factory=list)
    decode: list[Sequence] = field(default_factory=list)

    @property
    def seqs(self) -> list[Sequence]:
        return self.prefill + self.decode

    def __bool__(self) -> bool:
        return bool(self.prefill or self.decode)


class Scheduler:
    def __init__(self, blocks: BlockManager, max_active: int, max_model_len: int, eos_token_ids: list[int]):
        self.blocks = blocks
        self.max_active = max_active
        self.max_model_len = max_model_len
        self.eos = set(eos_token_ids)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        p = seq.params
        if p.min_tokens > 0:
            seq.early_stop_ids = sorted(set(p.stop_token_ids) | (set() if p.ignore_eos else self.eos))
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def abort(self, request_id: str) -> Sequence | None:
        for queue in (self.waiting, self.running):
            for seq in queue:
                if seq.request_id == request_id:
                    queue.remove(seq)
                    self._finish(seq, "abort")
                    return seq
        return None

    def schedule(self) -> Batch:
        batch = Batch()
        for seq in list(self.running):
            if seq not in self.running:
                continue  # preempted below to make room for an earlier request
            if self._done(seq):
                continue  # overlap: its last token, still on its way, ends it ("length")
            while not self.blocks.can_append(seq):
                victim = self.running[-1]
                self._preempt(victim)
                if victim is seq:
                    break
            else:
                self.blocks.append(seq)
                batch.decode.append(seq)
        while self.waiting and len(self.running) < self.max_active:
            seq = self.waiting[0]
            if not self.blocks.can_allocate(seq):
                break
            self.waiting.popleft()
            self.blocks.allocate(seq)
            seq.status = Status.RUNNING
            if seq.times.scheduled is None:  # first admission; a preempted request keeps its counts
                seq.times.scheduled = time.time()
                seq.num_cached_tokens = seq.num_computed_tokens
            self.running.append(seq)
            batch.prefill.append(seq)
        return batch

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.free(seq)
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def postprocess(self, batch: Batch, tokens: list[int], now: float,
                    errors: dict[str, Exception] | None = None) -> list[Sequence]:
        """Append each sampled token; return the sequences that finished (their blocks already freed)."""
        self.launched(batch)
        return self.land(batch, [len(s) - 1 for s in batch.seqs], tokens, now, errors)

    def launched(self, batch: Batch) -> None:
        """The batch's step is running: its tokens count as computed, and each sequence holds a PENDING token
        where the step's sampled one will go."""
        for seq in batch.seqs:
            seq.num_computed_tokens = len(seq)
            seq.token_ids.append(PENDING)

    def land(self, batch: Batch, index: list[int], tokens: list[int], now: float,
             errors: dict[str, Exception] | None = None) -> list[Sequence]:
        """The step's sampled tokens reached the host: each goes to token_ids[index] of its sequence (unless it
        ended meanwhile: aborted, or finished by the step before in overlap); returns those that finished.
        `errors`: request id -> why its token could not be sampled. Such a sequence, and one whose landing
        raises (its exception added to `errors`), ends with finish_reason "error" and is returned too; the
        others land as if it were not there."""
        errors = {} if errors is None else errors
        finished = []
        for seq, i, token in zip(batch.seqs, index, tokens):
            if seq.status is Status.FINISHED:
                continue
            reason = None
            if seq.request_id not in errors:
                try:
                    reason = self._land_one(seq, i, token, now)
                except Exception as e:  # this request ends with it; the others go on
                    errors[seq.request_id] = e
            if seq.request_id in errors:
                del seq.token_ids[i:]  # the token that failed, and any PENDING one after it (overlap)
                del seq.times.tokens[i - seq.num_prompt_tokens:]
                self.fail(seq, now)
                finished.append(seq)
            elif reason:
                del seq.token_ids[i + 1:]  # overlap: the next step's PENDING token, computed in vain
                (self.running if seq.status is Status.RUNNING else self.waiting).remove(seq)
                self._finish(seq, reason, now)
                finished.append(seq)
        return finished

    def _land_one(self, seq: Sequence, i: int, token: int, now: float) -> str | None:
        seq.token_ids[i] = token
        if seq.status is Status.RUNNING:
            self.blocks.commit(seq)
        if seq.times.first_token is None:
            seq.times.first_token = now
        seq.times.tokens.append(now)
        return self._stop_reason(seq, token, i + 1)

    def fail(self, seq: Sequence, now: float | None = None) -> None:
        """End seq with finish_reason "error" (its step failed) wherever it is, its blocks freed; trailing
        PENDING tokens (a step that will not land) are dropped."""
        while len(seq) > seq.num_prompt_tokens and seq.token_ids[-1] == PENDING:
            seq.token_ids.pop()
        for queue in (self.running, self.waiting):
            if seq in queue:
                queue.remove(seq)
        self._finish(seq, "error", now)

    def _done(self, seq: Sequence) -> bool:
        p = seq.params
        return (seq.num_output_tokens >= min(p.max_tokens, p.stop_at or p.max_tokens)
                or len(seq) >= self.max_model_len)

    def _stop_reason(self, seq: Sequence, token: int, length: int) -> str | None:
        """Why seq ends with `token`, its length-th token (a later PENDING one may follow it in overlap)."""
        p, n = seq.params, length - seq.num_prompt_tokens
        if n >= p.min_tokens and ((not p.ignore_eos and token in self.eos) or token in p.stop_token_ids):
            return "stop"
        if p.stop_at is not None and n >= p.stop_at:
            return "stop"
        if n >= p.max_tokens or length >= self.max_model_len:
            return "length"
        return None

    def _finish(self, seq: Sequence, reason: str, now: float | None = None) -> None:
        self.blocks.free(seq)
        seq.status = Status.FINISHED
        seq.finish_reason = reason
        seq.times.finished = now if now is not None else time.time()
