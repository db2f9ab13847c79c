"""A backend in its own process, and the one small transport the server uses to talk to it.

Child side: `worker_main` owns an Engine; a control thread answers look-ups at once (cached prefix, load
snapshot) and queues submit/abort/warm/shutdown for the engine loop, which steps while there is work and
blocks (no busy waiting) while there is none. The engine loop sends the prefix cache's changes (KV events)
with each step, and before the reply of a call that made them, so the server's index of the worker's cache
is up to date whenever it sees a step or a reply. Parent side: `ProcessBackend`. The messages are events.py's.
"""

from __future__ import annotations

import asyncio
import itertools
import multiprocessing as mp
import os
import queue
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable

from mvllm.backends.base import OnEvent
from mvllm.backends.events import (
    Abort,
    Aborted,
    Call,
    Command,
    Dead,
    Error,
    Failed,
    FromWorker,
    KvEvents,
    Method,
    Ready,
    Reply,
    Scheduled,
    Shutdown,
    Step,
    Submit,
)
from mvllm.backends.spec import BackendSpec
from mvllm.engine.engine import Engine
from mvllm.engine.params import SamplingParams
from mvllm.errors import MvllmError


def load(engine: Engine) -> dict:
    """What changes step to step; sent with every step's tokens."""
    s, b = engine.scheduler, engine.blocks
    return {"running": len(s.running), "waiting": len(s.waiting), "free_blocks": b.num_free,
            "kv_usage": round(b.usage(), 4), "prefix_queries": b.queries, "prefix_hits": b.hits,
            "preemptions": s.num_preemptions}


def snapshot(engine: Engine, spec: BackendSpec) -> dict:
    """The backend's settings and its load now."""
    b = engine.blocks
    return {"name": spec.name, "device": spec.device, "dtype": str(engine.dtype).removeprefix("torch."),
            "quant": spec.quant, "max_active": engine.scheduler.max_active, "num_blocks": b.num_blocks,
            "block_size": b.block_size, "max_model_len": engine.max_model_len, "overlap": engine.config.overlap,
            "pid": os.getpid(), **load(engine)}


def worker_main(spec_dict: dict, model: str, commands, events) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the server stops us
    spec = BackendSpec(**spec_dict)
    lock = threading.Lock()

    def send(msg: FromWorker) -> None:
        with lock:
            events.send(msg)

    start = time.perf_counter()
    try:
        engine = Engine(spec.engine_config(model))
    except Exception as e:  # reported to the server as one line
        send(Failed(f"{type(e).__name__}: {e}" if not isinstance(e, MvllmError) else str(e)))
        return
    inbox: queue.Queue = queue.Queue()

    def control() -> None:
        while True:
            try:
                cmd: Command = commands.recv()
            except (EOFError, OSError):  # the server is gone: stop too
                inbox.put(Shutdown())
                return
            match cmd:
                case Call(call_id, "cached_prefix_len", (token_ids,)):
                    send(Reply(call_id, engine.cached_prefix_len(token_ids)))
                case Call(call_id, "snapshot"):
                    send(Reply(call_id, snapshot(engine, spec)))
                case Shutdown():
                    inbox.put(cmd)
                    return
                case _:  # for the engine loop, between two steps
                    inbox.put(cmd)

    threading.Thread(target=control, name="control", daemon=True).start()

    def on_schedule(batch) -> None:  # admissions only: a decode-only step sends nothing here
        if batch.prefill:
            send(Scheduled([(s.request_id, s.num_cached_tokens) for s in batch.prefill]))

    engine.on_schedule = on_schedule
    engine.blocks.record_events()  # from an empty cache, as the server's index of it starts at Ready
    send(Ready({**snapshot(engine, spec), "ready_s": round(time.perf_counter() - start, 1)}))
    while True:
        try:
            cmd = inbox.get(block=not engine.has_unfinished())
            while True:
                if isinstance(cmd, Shutdown):
                    return
                _handle(engine, spec, cmd, send)
                cmd = inbox.get_nowait()
        except queue.Empty:
            pass
        if engine.has_unfinished():
            _step(engine, spec, send)


def _handle(engine: Engine, spec: BackendSpec, cmd: Submit | Abort | Call, send: Callable) -> None:
    match cmd:
        case Submit(rid, token_ids, params, arrival):
            try:
                engine.add_request(token_ids, SamplingParams(**params), rid, arrival)
            except MvllmError as e:
                send(Error(rid, str(e)))
            return
        case Abort(rid):
            seq = engine.abort(rid)
            _send_kv(engine, send)
            if seq is not None:
                send(Aborted(rid, seq.num_output_tokens, time.time()))
            return
        case Call(call_id, "reset_prefix_cache"):
            value = engine.reset_prefix_cache()
        case Call(call_id, "warm", (token_ids,)):
            try:
                value = engine.warm(token_ids)
            except MvllmError as e:
                value = e
        case Call(call_id, method):
            value = MvllmError(f"backend {spec.name} has no call {method!r}")
    _send_kv(engine, send)
    send(Reply(call_id, value))


def _send_kv(engine: Engine, send: Callable) -> None:
    if (kv := engine.blocks.take_events()) is not None:
        send(KvEvents(*kv))


_reported: set[tuple] = set()  # the errors whose traceback this worker printed


def _report(name: str, error: Exception, rids: list[str]) -> str:
    """One line on stderr for an error that ended `rids` (its traceback too, the first time this error is
    seen: same type, raised at the same place); returns the message their clients get (one line too)."""
    message = f"backend {name} failed: {_describe(error)}"
    tb = traceback.extract_tb(error.__traceback__)
    where = (tb[-1].filename, tb[-1].lineno) if tb else None
    if (type(error), where) not in _reported:
        _reported.add((type(error), where))
        traceback.print_exception(error, file=sys.stderr)
    shown = ", ".join(rids[:4]) + (f" and {len(rids) - 4} more" if len(rids) > 4 else "")
    ended = f"ended request{'s' if len(rids) > 1 else ''} {shown}" if rids else "no request was in flight"
    print(f"{message} ({ended})", file=sys.stderr, flush=True)
    return message


def _describe(error: Exception) -> str:
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__


def _step(engine: Engine, spec: BackendSpec, send: Callable) -> None:
    try:
        outs = engine.step()
    except Exception as e:  # the engine ends the requests of a failing step itself; this is a failure outside
        rids = list(engine.requests)  # any one step (its state is unknown): end them all, not the backend
        message = _report(spec.name, e, rids)
        for rid in rids:
            engine.abort(rid)
            send(Error(rid, message))
        _send_kv(engine, send)
        return
    if not outs:
        _send_kv(engine, send)  # no token, yet it may have evicted blocks (overlap: the first step of a run)
        return
    tokens = [(o.seq.request_id, o.token, o.seq.finish_reason if o.finished else None)
              for o in outs if o.error is None]
    send(Step(tokens, load(engine), engine.blocks.take_events()))  # even with no token: it shows the blocks freed
    errors: dict[str, tuple[Exception, list[str]]] = {}  # one log line per distinct error of the step
    for o in outs:
        if o.error is not None:
            errors.setdefault(_describe(o.error), (o.error, []))[1].append(o.seq.request_id)
    for error, rids in errors.values():
        message = _report(spec.name, error, rids)
        for rid in rids:
            send(Error(rid, message))


class ProcessBackend:
    """The server's handle on one backend worker process (a `Backend`)."""

    def __init__(self, spec: BackendSpec, model: str):
        ctx = mp.get_context("spawn")
        self.spec, self.name = spec, spec.name
        cmd_recv, self._commands = ctx.Pipe(duplex=False)
        self._events, evt_send = ctx.Pipe(duplex=False)
        self.process = ctx.Process(target=worker_main, args=(spec.as_dict(), model, cmd_recv, evt_send),
                                   name=f"mvllm-backend-{spec.name}", daemon=True)
        self.process.start()
        cmd_recv.close()
        evt_send.close()
        self.alive = False
        self.info: dict = {}
        self._calls = itertools.count()
        self._pending: dict[int, asyncio.Future] = {}
        self._loop: asyncio.AbstractEventLoop | None = None

    def wait_ready(self, timeout: float) -> None:
        """Block until the worker has loaded its model (and captured its graphs)."""
        if not self._events.poll(timeout):
            raise MvllmError(f"backend {self.name} did not become ready within {timeout:.0f} s")
        try:
            msg = self._events.recv()
        except EOFError:
            raise MvllmError(f"backend {self.name} exited while loading (exit code {self.process.exitcode})") from None
        match msg:
            case Ready(info):
                self.alive, self.info = True, info
            case Failed(message):
                raise MvllmError(f"backend {self.name} failed to start: {message}")
            case _:
                raise MvllmError(f"backend {self.name} failed to start: it sent {msg!r} first")

    def listen(self, loop: asyncio.AbstractEventLoop, on_event: OnEvent) -> None:
        """Forward every event to `on_event(name, event)` on the event loop; Dead() when the process ends."""
        self._loop = loop

        def read() -> None:
            try:
                while True:
                    try:
                        msg = self._events.recv()
                    except (EOFError, OSError):
                        loop.call_soon_threadsafe(on_event, self.name, Dead())
                        return
                    if isinstance(msg, Reply):
                        loop.call_soon_threadsafe(self._resolve, msg.call_id, msg.value)
                    else:
                        loop.call_soon_threadsafe(on_event, self.name, msg)
            except RuntimeError:  # the event loop closed: the server is shutting down
                return

        threading.Thread(target=read, name=f"events-{self.name}", daemon=True).start()

    def _resolve(self, call_id: int, value) -> None:
        fut = self._pending.pop(call_id, None)
        if fut and not fut.done():
            fut.set_exception(value) if isinstance(value, Exception) else fut.set_result(value)

    def mark_dead(self) -> None:
        self.alive = False
        self.process.join(0)  # it has ended (its end of the pipe closed): reap it
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(MvllmError(f"backend {self.name} is down"))
        self._pending.clear()

    def _send(self, msg: Command) -> None:
        try:
            self._commands.send(msg)
        except (BrokenPipeError, OSError):
            raise MvllmError(f"backend {self.name} is down") from None

    async def call(self, method: Method, *args, timeout: float = 600.0):
        if not self.alive:
            raise MvllmError(f"backend {self.name} is down")
        call_id = next(self._calls)
        fut = self._loop.create_future()
        self._pending[call_id] = fut
        self._send(Call(call_id, method, args))
        return await asyncio.wait_for(fut, timeout)

    def submit(self, request_id: str, token_ids: list[int], params: SamplingParams, arrival: float) -> None:
        p = {f: getattr(params, f) for f in params.__slots__}
        self._send(Submit(request_id, token_ids, p, arrival))

    def abort(self, request_id: str) -> None:
        if self.alive:
            self._send(Abort(request_id))

    def health(self) -> dict:
        return {}  # alive and restarts say it all

    def shutdown(self, timeout: float = 5.0) -> None:
        try:
            self._commands.send(Shutdown())
        except (BrokenPipeError, OSError):
            pass
        self.process.join(timeout)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(2)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
