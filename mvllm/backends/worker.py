"""The child side of a backend in its own process (the parent side, in the server, is process.py).

`worker_main` owns an Engine; a control thread answers look-ups at once (cached prefix, load
snapshot) and queues submit/abort/warm/shutdown for the engine loop, which steps while there is work and
blocks (no busy waiting) while there is none. The engine loop sends the prefix cache's changes (KV events)
with each step, and before the reply of a call that made them, so the server's index of the worker's cache
is up to date whenever it sees a step or a reply. Parent side: `ProcessBackend`. The messages are events.py's.
"""

from __future__ import annotations

import os
import queue
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable

from mvllm.backends.events import (
    Abort,
    Aborted,
    Call,
    Command,
    Error,
    Failed,
    FromWorker,
    KvEvents,
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
            "quant": spec.quant, "max_active": engine.scheduler.max_active,
            "max_step_tokens": engine.scheduler.max_step_tokens, "num_blocks": b.num_blocks,
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

    def on_schedule(batch) -> None:  # admissions only: a step that admits none sends nothing here
        if batch.admitted:
            send(Scheduled([(s.request_id, s.num_cached_tokens) for s in batch.admitted]))

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
