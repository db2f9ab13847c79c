"""One backend's engine as the simulator models it: eta's timing model (routing/eta.py: `Timing`) stepped
through time as engine/scheduler.py steps, over a model of its KV blocks (simulate/kv.py).

Each step first makes room for the running requests' next tokens (a block more every BLOCK_SIZE tokens;
where no block is free, the last running request is preempted as the engine preempts: its blocks freed, it
waits at the front of the queue and is computed again when admitted), then admits waiting requests in FCFS
order while fewer than max_active run and the next one's blocks fit (`can_allocate`); an admitted request's
cached prefix is looked up then. Every step gives one token to each running request, and costs the profile's step at that batch, priced by the
context the batch holds where the profile decoded at several depths (`Timing.at_depth`); a request's first
token comes at the end of the step that admits it, and its prompt's full blocks are published then. A
request ends at its length (`Job.max_tokens`: the workload's true length, within the max_tokens it was sent,
`limit`): finish_reason "length" where it reached `limit`, else "stop". Its blocks are then freed, the full
blocks of its prompt and of its tokens but the last published (the last sampled token's KV is never
computed), its last block first. The steps that change nothing but tokens, while nothing else happens, run
back to back in one call (`coast`): the same steps, without a call of the router for each.

A backend profiled with overlap (CUDA's default) schedules each step as the one before it starts, counting
the tokens in flight: a request that arrives while a step runs joins the step after next, and a slot freed
by a request's last token is filled in the next step as in the plain loop. The engine knows only `limit`,
so a request that stops before it is scheduled into the step after its last token, which runs it in vain (it
counts in that step's batch, and that step's KV of its last token is published).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from mvllm.bench.metrics import RequestRecord
from mvllm.engine.block_manager import BLOCK_SIZE
from mvllm.routing.eta import Timing
from mvllm.routing.router import Router
from mvllm.simulate.kv import KVCache, chain, stand_ins


@dataclass(slots=True, eq=False)
class Job:
    record: RequestRecord
    prompt: list[int]  # the whole prompt
    max_tokens: int  # where the modelled engine ends it: its true length, at most `limit`
    rid: str
    cached: int = 0
    generated: int = 0
    limit: int | None = None  # the max_tokens the engine runs it with (None: max_tokens, lengths told)
    hashes: list | None = None  # its blocks' hash chain, prompt then reply (None: made on admission)
    table: list = field(default_factory=list)
    committed: int = 0  # blocks of the table published
    room: int = 0  # tokens it may generate before its table needs another block
    fresh: bool = False  # admitted, its admission step's token not landed yet
    preempted: bool = False  # waiting again, its blocks freed
    done: bool = False

    def __post_init__(self):
        if self.limit is None:
            self.limit = self.max_tokens


@dataclass
class Backend:
    name: str
    timing: Timing
    kv: KVCache = field(default_factory=KVCache)
    waiting: deque = field(default_factory=deque)
    running: list = field(default_factory=list)
    busy: bool = False
    planned: list = field(default_factory=list)  # overlap: the next step's requests, scheduled as this one began
    planned_prefill: float = 0.0
    preemptions: int = 0

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.planned)

    def start_step(self, router: Router) -> float:
        """Schedule the step, return its duration; the caller ends it with `end_step`. With overlap the step
        runs what was scheduled as the step before it began (if anything was: an idle engine schedules at once),
        and the step after it is scheduled now, without the requests this one ends at their limit."""
        if self.planned:
            self.running, prefill = self.planned, self.planned_prefill
            self.planned, self.planned_prefill = [], 0.0
        else:
            prefill = self.schedule(router, self.running, 0)
        if self.timing.overlap:
            self.planned = [job for job in self.running if not job.done and job.generated + 1 < job.limit]
            self.planned_prefill = self.schedule(router, self.planned, 1)
        self.busy = True
        return self.step_time(prefill)

    def step_time(self, prefill: float, ahead: int = 0) -> float:
        """The running batch's step, admissions' `prefill` included (`ahead`: tokens landed not yet counted)."""
        timing, running = self.timing, self.running
        if timing.depth_s:  # a request admitted into this step is priced by its prefill
            ref = timing.depth_ref
            excess = sum(len(j.prompt) + j.generated + ahead - ref for j in running if not j.fresh)
            return timing.at_depth(len(running), excess) + prefill
        return timing.step_s[len(running) - 1] + prefill

    def coast(self, now: float, until: float, router: Router) -> float:
        """Run the steps that change nothing but tokens, back to back, while each ends before `until` (the next
        event elsewhere); returns the time the last one ended (`now`: none ran). In such a step no request is
        admitted (none waits, or the batch is full), none ends, and each block its requests need is free (no
        preemption); a backend with overlap runs none (its steps are scheduled a step ahead). Each is the step
        start_step and end_step would run, and the router hears their tokens and steps after the last of them
        (`count` tokens of each request: as many of one, routing/router.py): nothing reads it in between."""
        timing, running, kv = self.timing, self.running, self.kv
        if timing.overlap or self.planned or not running or (self.waiting and len(running) < timing.max_active):
            return now
        if now + self.step_time(0.0) >= until:  # (the first ends too late: most often, for the slower backend)
            return now
        last = min(j.max_tokens - j.generated for j in running) - 1  # the step after it ends one of them
        bounded = kv.num_blocks is not None
        room = min(j.room - j.generated for j in running) if bounded else last  # steps before one needs a block
        times, dur = [], None if timing.depth_s else self.step_time(0.0)
        for i in range(last):  # i: the tokens each has made since `now`
            end = now + (self.step_time(0.0, i) if dur is None else dur)
            if end >= until:
                break
            if i > room:  # schedule's room for the next tokens; where it would preempt, start_step does that
                if not self.grow(router, running, i, preempt=False):
                    break
                room = min(j.room - j.generated for j in running)
            now = end
            times.append(now)
        if times:
            n = len(times)
            for job in running:
                job.generated += n
                job.record.chunks.extend(times)
            router.on_step_tokens(self.name, [j.rid for j in running], n)
            router.on_step(self.name, n)
        return now

    def schedule(self, router: Router, into: list, ahead: int) -> float:
        """The engine's schedule(): room for the next token of each request in `into` (`ahead`: tokens in
        flight), then admissions; returns their prefill's extra seconds."""
        if self.kv.num_blocks is not None:
            for job in into:  # (most steps none needs a block: a loop finds that sooner than a list would)
                if job.generated + ahead > job.room:
                    self.grow(router, into, ahead)
                    break
        return self.admit(router, into) if self.waiting and len(into) < self.timing.max_active else 0.0

    def grow(self, router: Router, into: list, ahead: int, preempt: bool = True) -> bool:
        """A block more for each request in `into` whose next token needs one, preempting where none is free;
        without `preempt`, False there instead (the blocks taken before it stay taken)."""
        before = self.preemptions
        for job in [j for j in into if j.generated + ahead > j.room]:
            while job in into and not self.kv.grow(job.table, len(job.prompt) + job.generated + ahead):
                if not preempt:
                    return False
                self.preempt(into[-1], into, ahead)
            job.room = len(job.table) * BLOCK_SIZE - len(job.prompt)
        if self.preemptions > before:
            router.on_preempted(self.name)
        return True

    def preempt(self, job: Job, into: list, ahead: int) -> None:
        into.remove(job)
        self._commit(job, len(job.prompt) + job.generated - 1 + ahead)
        self.kv.release(job.table)
        job.preempted, job.fresh = True, False
        self.waiting.appendleft(job)
        self.preemptions += 1

    def admit(self, router: Router, into: list) -> float:
        """Move waiting requests into `into` while it has room and their blocks fit."""
        prefill, kv, timing, waiting = 0.0, self.kv, self.timing, self.waiting
        while waiting and len(into) < timing.max_active:
            job = waiting[0]
            if job.hashes is None:
                job.hashes = chain(job.prompt)
                job.hashes += stand_ins(job.hashes, job.rid, (len(job.prompt) + job.max_tokens) // BLOCK_SIZE)
            tokens = len(job.prompt) + job.generated  # a preempted request is computed again, its tokens too
            hit = kv.hits(job.hashes, tokens)
            if kv.bounded and ((job.preempted and job in self.running) or not kv.can_allocate(job.hashes, tokens, hit)):
                break  # (in overlap, a request preempted in flight comes back once its token has landed)
            waiting.popleft()
            job.table, hit = kv.allocate(job.hashes, tokens, hit)
            job.room = len(job.table) * BLOCK_SIZE - len(job.prompt)
            job.committed = hit
            if not job.preempted:
                job.cached = hit * BLOCK_SIZE
            job.fresh, job.preempted = True, False
            prefill += timing.priced(tokens - hit * BLOCK_SIZE)
            router.on_scheduled(self.name, job.rid, job.cached)
            into.append(job)
        return prefill

    def _commit(self, job: Job, computed: int) -> None:
        n = computed // BLOCK_SIZE
        if n > job.committed:
            self.kv.commit(job.table, job.hashes, job.committed, n)
            job.committed = n

    def end_step(self, now: float, router: Router) -> list[Job]:
        """The step's tokens land; returns the requests it ended."""
        finished, keep, planned, name, made = [], [], self.planned, self.name, []
        for job in self.running:
            if job.done:
                continue  # overlap: scheduled before its last token landed
            rec = job.record
            if job.fresh:
                job.fresh = False
                self._commit(job, len(job.prompt) + job.generated + (job in planned))
            if job.generated == 0:
                rec.first_token, rec.cached_tokens = now, job.cached
            job.generated += 1
            rec.chunks.append(now)
            made.append(job.rid)
            if job.generated >= job.max_tokens:
                rec.finish, rec.output_tokens = now, job.generated
                rec.finish_reason = "length" if job.generated >= job.limit else "stop"
                if job.preempted:  # overlap: preempted while its last step ran; its blocks went back then
                    self.waiting.remove(job)
                else:
                    self._commit(job, len(job.prompt) + job.generated - 1 + (job in planned))
                    self.kv.release(job.table)
                job.done = True
                router.on_step_tokens(name, made)  # the router hears each token before the finish after it
                made = []
                router.on_finished(name, job.rid, rec.finish_reason)
                finished.append(job)
            elif not job.preempted:
                keep.append(job)
        if made:
            router.on_step_tokens(name, made)
        self.running = keep
        self.busy = False
        router.on_step(name)
        return finished
