"""A backend without a model: a worker process that emits tokens on a clock (spec `NAME=null/step_ms=10`).

It speaks worker.py's protocol over the same pipes (Ready, Scheduled, Step, Aborted and a Reply for each Call),
so the server's Cluster, Router, app and SSE path run unchanged over it; what it leaves out is the engine. Every
step_ms it admits waiting requests first come, first served up to max_active, and gives every running request one
token: the prompt's tokens again in order (valid ids of the model's vocabulary), until max_tokens ("length") or a
benchmark length ("stop"). It caches nothing (every look-up finds 0 tokens) and imports no torch.
"""

from __future__ import annotations

import os
import signal
import time
from collections import deque
from dataclasses import dataclass

from mvllm.backends.events import Abort, Aborted, Call, Ready, Reply, Scheduled, Shutdown, Step, Submit
from mvllm.backends.spec import NULL_STEP_MS, BackendSpec
from mvllm.errors import MvllmError


@dataclass(slots=True)
class Job:
    rid: str
    prompt: list[int]
    end: int  # tokens it makes
    reason: str  # why it ends there
    made: int = 0


class Clock:
    """The null backend's scheduler: FCFS admission up to max_active, one token a running request a step."""

    def __init__(self, max_active: int):
        self.max_active = max_active
        self.waiting: deque[Job] = deque()
        self.running: dict[str, Job] = {}

    def submit(self, rid: str, token_ids: list[int], params: dict) -> None:
        cap, told = params["max_tokens"], params.get("stop_at")
        end, reason = (told, "stop") if told is not None and told <= cap else (cap, "length")
        self.waiting.append(Job(rid, token_ids, end, reason))

    def abort(self, rid: str) -> Job | None:
        job = self.running.pop(rid, None)
        if job is None:
            job = next((j for j in self.waiting if j.rid == rid), None)
            if job is not None:
                self.waiting.remove(job)
        return job

    def busy(self) -> bool:
        return bool(self.running or self.waiting)

    def step(self) -> tuple[list[tuple[str, int]], list[tuple[str, int, str | None]]]:
        """(admitted with 0 cached tokens, tokens as Step carries them)."""
        admitted = []
        while self.waiting and len(self.running) < self.max_active:
            job = self.waiting.popleft()
            self.running[job.rid] = job
            admitted.append((job.rid, 0))
        tokens = []
        for job in self.running.values():
            token = job.prompt[job.made % len(job.prompt)]
            job.made += 1
            tokens.append((job.rid, token, job.reason if job.made >= job.end else None))
        for rid, _, reason in tokens:
            if reason is not None:
                del self.running[rid]
        return admitted, tokens

    def load(self) -> dict:
        return {"running": len(self.running), "waiting": len(self.waiting), "free_blocks": 0, "kv_usage": 0.0,
                "prefix_queries": 0, "prefix_hits": 0, "preemptions": 0}


def snapshot(clock: Clock, spec: BackendSpec, step_s: float) -> dict:
    return {"name": spec.name, "device": spec.device, "dtype": None, "quant": None, "max_active": clock.max_active,
            "max_step_tokens": None, "num_blocks": 0, "block_size": None, "max_model_len": None, "overlap": False,
            "step_ms": 1000 * step_s, "pid": os.getpid(), **clock.load()}


def null_main(spec_dict: dict, model: str, commands, events) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the server stops us
    spec = BackendSpec(**spec_dict)
    step_s = (spec.step_ms or NULL_STEP_MS) / 1000
    clock = Clock(spec.max_active)
    events.send(Ready({**snapshot(clock, spec, step_s), "ready_s": 0.0}))
    try:
        serve(clock, spec, step_s, commands, events)
    except (EOFError, OSError):  # the server is gone: stop too
        return


def serve(clock: Clock, spec: BackendSpec, step_s: float, commands, events) -> None:
    next_at = 0.0
    while True:
        if not commands.poll(max(next_at - time.monotonic(), 0.0) if clock.busy() else None):
            admitted, tokens = clock.step()
            if admitted:
                events.send(Scheduled(admitted))
            events.send(Step(tokens, clock.load()))
            next_at = max(next_at + step_s, time.monotonic())
            continue
        match commands.recv():
            case Submit(rid, token_ids, params, _):
                if not clock.busy():
                    next_at = time.monotonic()  # an idle backend steps at once
                clock.submit(rid, token_ids, params)
            case Abort(rid):
                if (job := clock.abort(rid)) is not None:
                    events.send(Aborted(rid, job.made, time.time()))
            case Call(call_id, "cached_prefix_len" | "warm"):
                events.send(Reply(call_id, 0))
            case Call(call_id, "snapshot"):
                events.send(Reply(call_id, snapshot(clock, spec, step_s)))
            case Call(call_id, "reset_prefix_cache"):
                events.send(Reply(call_id, not clock.busy()))
            case Call(call_id, method):
                events.send(Reply(call_id, MvllmError(f"backend {spec.name} has no call {method!r}")))
            case Shutdown():
                return
