"""A load of several client processes sharing one schedule (as AIPerf and inference-perf generate load).

The requests are dealt to `workers` processes by conversation (a follow-up turn goes where its first turn
went: it needs its parent's reply); all of them start on one instant of the machine's monotonic clock, which
every process reads alike (time.perf_counter), so their stamps share one origin. Finished records come back
in batches while the load runs (the progress display) and each worker's health at its end. A worker that
dies fails the run with one line naming it; nothing is returned half-made.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import queue
import signal
import time
from collections.abc import Callable

from mvllm.bench.client import replay
from mvllm.bench.health import Health
from mvllm.bench.metrics import RequestRecord
from mvllm.bench.workload import Request
from mvllm.errors import MvllmError

FLUSH_S = 0.2  # how often a worker sends its finished records
START_S = 60.0  # the most a worker process may take to start


class ClientError(MvllmError):
    pass


def auto_workers() -> int:
    """A quarter of the cores, 1 to 8: the rest is the server's."""
    return max(1, min(8, (os.cpu_count() or 1) // 4))


def run_loop(coro):
    """asyncio.run on uvloop where it is installed (its transports cost less a read). Ctrl-C ends it with
    KeyboardInterrupt, also where the coroutine went on: asyncio's runner makes the signal a cancellation of the
    main task, and one that returns through it (a wait that catches CancelledError; Python 3.11's wait_for where
    its wait finished at that moment) would lose the interrupt."""

    async def main():
        result = await coro
        cancelling = getattr(asyncio.current_task(), "cancelling", None)  # (Python 3.11 on)
        if cancelling is not None and cancelling():  # cancelled on Ctrl-C, and it went on: the runner re-raises it
            raise asyncio.CancelledError
        return result

    top = main()
    try:
        try:
            import uvloop
        except ImportError:
            return asyncio.run(top)
        return uvloop.run(top)
    finally:  # where Ctrl-C came before they ran: closed, not reported as never awaited when collected
        top.close()
        coro.close()


def deal(requests: list[Request], workers: int) -> list[list[Request]]:
    """Conversations round-robin over the workers, in send order; each keeps its requests' order."""
    root: dict[int, int] = {}
    shards: list[list[Request]] = [[] for _ in range(workers)]
    turn = 0
    for r in requests:
        if r.parent is None:
            root[r.id], turn = turn % workers, turn + 1
        else:
            root[r.id] = root[r.parent]
        shards[root[r.id]].append(r)
    return shards


def generate(url: str, model: str | None, requests: list[Request], timeout: float, workers: int = 1,
             on_done: Callable[[RequestRecord], None] | None = None, stop: str = "field", vocab: int = 32000,
             ) -> tuple[list[RequestRecord], float, float, list[dict]]:
    """Replay `requests` over `workers` client processes (1: this one). Returns the records in the requests'
    order, the replay's wall time, its start (time.time()) and each worker's health (health.Health.result)."""
    if workers < 1:
        raise ClientError(f"--client-workers must be at least 1, got {workers}")
    if workers == 1:
        health = Health()
        records, duration, start = run_loop(replay(url, model, requests, timeout, on_done, stop, vocab,
                                                   health=health))
        return records, duration, start, [health.result()]
    return _processes(url, model, deal(requests, workers), timeout, on_done, stop, vocab, [r.id for r in requests])


def _processes(url, model, shards, timeout, on_done, stop, vocab, order):
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    go, origin = ctx.Event(), ctx.Value("d", 0.0)
    procs = [ctx.Process(target=_worker, args=(i, url, model, shard, timeout, stop, vocab, out, go, origin),
                         name=f"mvllm-client-{i}", daemon=True) for i, shard in enumerate(shards)]
    for p in procs:
        p.start()
    records: dict[int, RequestRecord] = {}
    ends: dict[int, tuple[dict, float]] = {}
    try:
        ready, deadline = 0, time.monotonic() + START_S
        while ready < len(procs):
            kind, i, *_ = _next(out, procs, ends, deadline)
            ready += kind == "ready"
        origin.value = time.perf_counter() + 0.02  # every worker waits for the same instant
        t0_wall = time.time() + 0.02
        go.set()
        while len(ends) < len(procs):
            kind, i, *body = _next(out, procs, ends, None)
            if kind == "done":
                for rec in body[0]:
                    records[rec.id] = rec
                    if on_done is not None:
                        on_done(rec)
            elif kind == "end":
                ends[i] = (body[0], body[1])
            elif kind == "error":
                raise ClientError(f"client worker {i} failed: {body[0]}")
    finally:
        for p in procs:
            if p.is_alive() and p.pid is not None and len(ends) < len(procs):
                p.terminate()
        for p in procs:
            p.join(5)
    if len(records) != len(order):
        raise ClientError(f"the client workers returned {len(records)} of {len(order)} requests")
    duration = max(d for _, d in ends.values())
    return [records[i] for i in order], duration, t0_wall, [ends[i][0] for i in sorted(ends)]


def _next(out, procs, ends, deadline):
    """The next message from a worker; a worker that died without its end is the run's failure."""
    while True:
        try:
            return out.get(timeout=0.5)
        except queue.Empty:
            pass
        for i, p in enumerate(procs):
            if not p.is_alive() and i not in ends and out.empty():
                raise ClientError(f"client worker {i} (pid {p.pid}) died with exit code {p.exitcode}")
        if deadline is not None and time.monotonic() > deadline:
            raise ClientError(f"the client workers did not start within {START_S:g} s")


def _worker(index, url, model, shard, timeout, stop, vocab, out, go, origin) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the group: the parent ends us
    out.put(("ready", index))
    go.wait()
    try:
        run_loop(_serve(index, url, model, shard, timeout, stop, vocab, out, origin.value))
    except Exception as e:  # noqa: BLE001 -- reported to the parent as one line
        out.put(("error", index, f"{type(e).__name__}: {e}"))


async def _serve(index, url, model, shard, timeout, stop, vocab, out, t0) -> None:
    finished: list[RequestRecord] = []

    async def flush() -> None:
        while True:
            await asyncio.sleep(FLUSH_S)
            if finished:
                out.put(("done", index, finished[:]))
                finished.clear()

    health = Health()
    task = asyncio.ensure_future(flush())
    try:
        _, duration, _ = await replay(url, model, shard, timeout, finished.append, stop, vocab, t0=t0,
                                      health=health)
    finally:
        task.cancel()
    if finished:
        out.put(("done", index, finished[:]))
    out.put(("end", index, health.result(), duration))
