"""Continuous batching under a token budget, in vLLM v1's order: each step takes the running requests first (a
decode is one token, a partly prefilled prompt its next chunk), then admits waiting ones first come, first served,
while the budget, max_active and the KV blocks allow. A prompt longer than what is left of the budget runs in
chunks over several steps; only its last chunk samples a token. A request's blocks are allocated whole when it is
admitted; the full blocks of each chunk join the prefix cache once the chunk has run. Preemption by recompute
when KV blocks run out."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from mvllm.engine.block_manager import BlockManager
from mvllm.engine.sequence import PENDING, Sequence, Status


@dataclass(slots=True)
class Batch:
    """One step. `prefill` computes the tokens [start, end) of `chunks` of each of its requests; `decode` one
    token each. `sampled`: the requests whose step ends in a sampled token (a prompt's last chunk, and every
    decode), in `seqs` order; `admitted`: the requests this step admitted."""
    prefill: list[Sequence] = field(default_factory=list)
    decode: list[Sequence] = field(default_factory=list)
    chunks: list[tuple[int, int]] = field(default_factory=list)
    sampled: list[Sequence] = field(default_factory=list)
    admitted: list[Sequence] = field(default_factory=list)

    @property
    def seqs(self) -> list[Sequence]:
        return self.prefill + self.decode

    @property
    def spans(self) -> list[tuple[int, int]]:
        """Each request's tokens computed in this step, in `seqs` order."""
        return self.chunks + [(len(s) - 1, len(s)) for s in self.decode]

    @property
    def num_tokens(self) -> int:
        return sum(b - a for a, b in self.chunks) + len(self.decode)

    def add_chunk(self, seq: Sequence, start: int, end: int) -> None:
        self.prefill.append(seq)
        self.chunks.append((start, end))

    def seal(self) -> Batch:
        self.sampled = [s for s, (_, end) in zip(self.prefill, self.chunks) if end == len(s)] + self.decode
        return self

    def __bool__(self) -> bool:
        return bool(self.prefill or self.decode)


class Scheduler:
    def __init__(self, blocks: BlockManager, max_active: int, max_model_len: int, eos_token_ids: list[int],
                 max_step_tokens: int | None = None):
        self.blocks = blocks
        self.max_active = max_active
        self.max_model_len = max_model_len
        self.max_step_tokens = max_step_tokens or max_model_len
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
        batch, budget = Batch(), self.max_step_tokens
        for seq in list(self.running):  # decodes first, a token each (max_step_tokens >= max_active)
            if seq.status is not Status.RUNNING or self._prefilling(seq):
                continue  # preempted below to make room for an earlier request, or a prompt not done
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
                budget -= 1
        for seq in self.running:  # then the prompts partly prefilled: their next chunks
            if budget > 0 and self._prefilling(seq):
                start = seq.num_computed_tokens
                end = min(len(seq), start + budget)
                batch.add_chunk(seq, start, end)
                budget -= end - start
        while self.waiting and budget > 0 and len(self.running) < self.max_active:
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
            start = seq.num_computed_tokens
            end = min(len(seq), start + budget)
            batch.add_chunk(seq, start, end)
            batch.admitted.append(seq)
            budget -= end - start
        return batch.seal()

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.free(seq)
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def postprocess(self, batch: Batch, tokens: list[int], now: float,
                    errors: dict[str, Exception] | None = None) -> list[Sequence]:
        """Append each sampled token (`tokens`: one per `batch.sampled`); return the sequences that finished
        (their blocks already freed)."""
        index = [len(s) for s in batch.sampled]
        self.launched(batch)
        return self.land(batch.sampled, index, tokens, now, errors)

    def launched(self, batch: Batch) -> None:
        """The batch's step is running: its tokens count as computed; each sequence that samples holds a PENDING
        token where the step's sampled one will go, and a chunk that does not publishes its full blocks."""
        for seq, (_, end) in zip(batch.prefill, batch.chunks):
            seq.num_computed_tokens = end
            if end < len(seq):
                self.blocks.commit(seq)
            else:
                seq.token_ids.append(PENDING)
        for seq in batch.decode:
            seq.num_computed_tokens = len(seq)
            seq.token_ids.append(PENDING)

    def land(self, seqs: list[Sequence], index: list[int], tokens: list[int], now: float,
             errors: dict[str, Exception] | None = None) -> list[Sequence]:
        """A step's sampled tokens reached the host (`seqs`: its batch's `sampled`): each goes to token_ids[index]
        of its sequence (unless it ended meanwhile: aborted, or finished by the step before in overlap); returns
        those that finished.
        `errors`: request id -> why its token could not be sampled. Such a sequence, and one whose landing
        raises (its exception added to `errors`), ends with finish_reason "error" and is returned too; the
        others land as if it were not there."""
        errors = {} if errors is None else errors
        finished = []
        for seq, i, token in zip(seqs, index, tokens):
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

    @staticmethod
    def _prefilling(seq: Sequence) -> bool:
        """More than its last token left to compute: a prompt (or a preempted request's tokens) in chunks. With
        one left, its step is a decode's."""
        return seq.num_computed_tokens < len(seq) - 1

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
