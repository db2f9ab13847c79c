"""One backend's engine as the simulator models it: eta's timing model (routing/eta.py: `Timing`) stepped
through time as engine/scheduler.py steps, over a model of its KV blocks (simulate/kv.py).

Each step first makes room for the running requests' next tokens (a block more every BLOCK_SIZE tokens;
where no block is free, the last running request is preempted as the engine preempts: its blocks freed, it
waits at the front of the queue and is computed again when admitted). Then it spends the step's token budget
(the profile's `max_step_tokens`; a profile without one admits each prompt whole, as the engine did before
steps had a budget) as the engine does: the running requests first, in order, a decoding one taking 1 token
and a partly prefilled one its next chunk (what is left of its prompt, at most what is left of the budget; with
nothing left it sits the step out); then the waiting ones in FCFS order while budget is left, fewer than
max_active run and the next one's blocks fit (`can_allocate`, its whole prompt's blocks taken at admission).
An admitted request's cached prefix is looked up then and costs nothing; its first chunk is the rest of its
prompt, at most what is left of the budget. A preempted request's prompt and tokens are computed again
through the same budget. A step costs the profile's decode step at its batch (the requests in it), priced by
the context its decoding requests hold where the profile decoded at several depths (`Timing.at_depth`), plus
each chunk's price (`Timing.chunk_s`: its tokens and the context they read), less `Timing.alone_s` where it
starts while no other backend has work (the profile's served host work with the others idle). Only the chunk that completes a
prompt samples: a request's first token comes at the end of that step; the full blocks of each chunk are
published when its step ends (with overlap, as it is launched), so a later request can hit them before the
prompt is done. A
request ends at its length (`Job.max_tokens`: the workload's true length, within the max_tokens it was sent,
`limit`): finish_reason "length" where it reached `limit`, else "stop". Its blocks are then freed, the full
blocks of its prompt and of its tokens but the last published (the last sampled token's KV is never
computed), its last block first. The steps that change nothing but tokens, while nothing else happens, run
back to back in one call (`coast`): the same steps, without a call of the router for each.

A backend profiled with overlap (CUDA's default) schedules each step as the one before it starts, counting
the tokens in flight: a request that arrives while a step runs joins the step after next, and a slot freed
by a request's last token is filled in the next step as in the plain loop; a partial chunk needs no token to
land, so the prompt's next chunk is scheduled at once. The engine knows only `limit`,
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
    fresh: bool = False  # admitted, its first sampled token not landed yet
    todo: int = 0  # tokens to compute (chunks not yet scheduled) before it samples; 0: decoding
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
    parts: dict = field(default_factory=dict)  # this step's chunks that do not sample: job -> tokens computed after it
    idle: tuple = ()  # running requests that sit this step out (a partial prompt, no budget left)
    planned_parts: dict = field(default_factory=dict)
    planned_idle: tuple = ()
    preemptions: int = 0
    others: tuple = ()  # the other backends: while none has work, a step costs Timing.alone_s less

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.planned)

    def start_step(self, router: Router) -> float:
        """Schedule the step, return its duration; the caller ends it with `end_step`. With overlap the step
        runs what was scheduled as the step before it began (if anything was: an idle engine schedules at once),
        and the step after it is scheduled now, without the requests this one ends at their limit."""
        if self.planned:
            self.running, prefill = self.planned, self.planned_prefill
            self.parts, self.idle = self.planned_parts, self.planned_idle
            self.planned, self.planned_prefill = [], 0.0
        else:
            prefill, self.parts, self.idle = self.schedule(router, self.running, 0)
        if self.timing.overlap:
            parts, idle = self.parts, self.idle
            for job, end in parts.items():  # launched: the engine publishes a partial chunk's blocks now
                self._commit(job, end)
            self.planned = [job for job in self.running if not job.done and (
                job.generated + 1 < job.limit or (parts and job in parts) or (idle and job in idle))]
            self.planned_prefill, self.planned_parts, self.planned_idle = self.schedule(router, self.planned, 1)
        self.busy = True
        return self.step_time(prefill)

    def step_time(self, prefill: float, ahead: int = 0) -> float:
        """The running batch's step, admissions' `prefill` included (`ahead`: tokens landed not yet counted)."""
        timing, running = self.timing, self.running
        batch = len(running) - len(self.idle)
        if timing.depth_s:  # a request prefilling in this step is priced by its chunk
            ref = timing.depth_ref
            excess = sum(len(j.prompt) + j.generated + ahead - ref for j in running if not j.fresh)
            return timing.at_depth(batch, excess) + prefill - self.relief()
        return timing.step_s[batch - 1] + prefill - self.relief()

    def relief(self) -> float:
        """Seconds a step takes less because no other backend has work (Timing.alone_s; 0 while one has)."""
        alone = self.timing.alone_s
        return alone if alone and not any(o.busy or o.has_work for o in self.others) else 0.0

    def coast(self, now: float, until: float, router: Router) -> float:
        """Run the steps that change nothing but tokens, back to back, while each ends before `until` (the next
        event elsewhere); returns the time the last one ended (`now`: none ran). In such a step no request is
        admitted (none waits, or the batch is full), none ends, and each block its requests need is free (no
        preemption); with overlap, the step scheduled ahead is the same requests (`planned`, none admitted),
        and each step schedules the same again, its blocks taken a token ahead. Each is the step start_step and
        end_step would run, and the router hears their tokens and steps after the last of them (`count` tokens
        of each request: as many of one, routing/router.py): nothing reads it in between."""
        timing, running, kv, ahead = self.timing, self.running, self.kv, int(self.timing.overlap)
        if ahead:
            if self.planned != running or self.planned_prefill or self.planned_parts or self.planned_idle:
                return now
        elif self.planned:
            return now
        if not running or (self.waiting and len(running) < timing.max_active):
            return now
        if timing.budget is not None and any(j.todo for j in running):  # a prompt still in chunks
            return now
        if now + self.step_time(0.0) >= until:  # (the first ends too late: most often, for the slower backend)
            return now
        last = min(j.max_tokens - j.generated for j in running) - 1  # the step after it ends one of them
        bounded = kv.num_blocks is not None
        room = min(j.room - j.generated for j in running) if bounded else last  # steps before one needs a block
        times, dur, ref, n = [], None if timing.depth_s else self.step_time(0.0), timing.depth_ref, len(running)
        held = None  # the context the batch holds over the table's: a sum of integers, exact in floats
        if dur is None and float(ref).is_integer():
            held = sum(len(j.prompt) + j.generated for j in running) - n * ref
            relief = self.relief()  # the others change only at events, which end a coast
        for i in range(last):  # i: the tokens each has made since `now`
            if dur is not None:
                end = now + dur
            elif held is not None:  # step_time(0.0, i), summed at once
                end = now + (timing.at_depth(n, held + n * i) - relief)
            else:
                end = now + self.step_time(0.0, i)
            if end >= until:
                break
            if i + ahead > room:  # schedule's room for the next tokens; where it would preempt, start_step does
                if not self.grow(router, running, i + ahead, preempt=False):
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

    def schedule(self, router: Router, into: list, ahead: int) -> tuple[float, dict, tuple]:
        """The engine's schedule(): room for the next token of each decoding request in `into` (`ahead`: tokens
        in flight), the running requests' chunks, then admissions; returns the chunks' extra seconds, the chunks
        that do not sample (job -> tokens computed after it) and the requests that sit the step out."""
        if self.kv.num_blocks is not None:
            for job in into:  # (most steps none needs a block: a loop finds that sooner than a list would)
                if job.generated + ahead > job.room and not job.todo:
                    self.grow(router, into, ahead)
                    break
        budget, prefill, parts, idle = self.timing.budget, 0.0, {}, ()
        if budget is not None:
            filling = [j for j in into if j.todo]
            budget -= len(into) - len(filling)  # the decodes, 1 token each
            for job in filling:  # (in running order: a partial prompt is admitted after the decodes before it)
                if budget <= 0:
                    idle += (job,)
                    continue
                n = min(job.todo, budget)
                done = len(job.prompt) + job.generated - job.todo  # its tokens in the KV, or scheduled
                prefill += self.timing.chunk_s(n, done)
                job.todo -= n
                budget -= n
                if job.todo:
                    parts[job] = done + n
        if self.waiting and len(into) < self.timing.max_active and (budget is None or budget > 0):
            prefill += self.admit(router, into, budget, parts)
        return prefill, parts, idle

    def grow(self, router: Router, into: list, ahead: int, preempt: bool = True) -> bool:
        """A block more for each request in `into` whose next token needs one, preempting where none is free;
        without `preempt`, False there instead (the blocks taken before it stay taken)."""
        before = self.preemptions
        for job in [j for j in into if j.generated + ahead > j.room and not j.todo]:
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
        if not job.todo:  # (a partial prompt's chunks were published as their steps ended)
            self._commit(job, len(job.prompt) + job.generated - 1 + ahead)
        self.kv.release(job.table)
        job.preempted, job.fresh = True, False
        self.waiting.appendleft(job)
        self.preemptions += 1

    def admit(self, router: Router, into: list, budget: int | None, parts: dict) -> float:
        """Move waiting requests into `into` while it has room, budget is left (None: no budget) and their
        blocks fit; returns their first chunks' extra seconds (a chunk that does not sample goes into parts)."""
        prefill, kv, timing, waiting = 0.0, self.kv, self.timing, self.waiting
        while waiting and len(into) < timing.max_active and (budget is None or budget > 0):
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
            uncached = tokens - hit * BLOCK_SIZE
            if budget is None:
                prefill += timing.priced(uncached)
            else:
                n = min(uncached, budget)
                prefill += timing.chunk_s(n, hit * BLOCK_SIZE)
                budget -= n
                job.todo = uncached - n
                if job.todo:
                    parts[job] = hit * BLOCK_SIZE + n
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
        parts, idle = self.parts, self.idle
        for job in self.running:
            if job.done:
                continue  # overlap: scheduled before its last token landed
            if (parts and job in parts) or (idle and job in idle):  # no token: a partial chunk, or none
                if not job.preempted:
                    if job in parts:
                        self._commit(job, parts[job])
                    keep.append(job)
                continue
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
        self.running, self.parts, self.idle = keep, {}, ()
        self.busy = False
        router.on_step(name)
        return finished
