"""A backend in its own process, as the server sees it: one small transport over two pipes.

The worker (worker.py) starts (backends/start.py) with `worker_entry`, which imports the engine, and with it
torch, in the worker only: the server's process routes and streams, and imports neither. A null backend's worker
(null.py) imports no engine at all.
"""

from __future__ import annotations

import asyncio
import itertools
import threading

from mvllm.backends.base import OnEvent
from mvllm.backends.events import Abort, Call, Command, Dead, Failed, Method, Ready, Reply, Shutdown, Submit
from mvllm.backends.spec import BackendSpec
from mvllm.backends.start import context
from mvllm.engine.params import SamplingParams
from mvllm.errors import MvllmError


def worker_entry(spec_dict: dict, model: str, commands, events) -> None:
    """The worker process's target: an engine's worker, or the null backend's (no model, no torch)."""
    if spec_dict["device"] == "null":
        from mvllm.backends.null import null_main

        return null_main(spec_dict, model, commands, events)
    from mvllm.backends.worker import worker_main

    worker_main(spec_dict, model, commands, events)


class ProcessBackend:
    """The server's handle on one backend worker process (a `Backend`)."""

    def __init__(self, spec: BackendSpec, model: str):
        ctx = context(torch=not spec.null)
        self.spec, self.name = spec, spec.name
        cmd_recv, self._commands = ctx.Pipe(duplex=False)
        self._events, evt_send = ctx.Pipe(duplex=False)
        self.process = ctx.Process(target=worker_entry, args=(spec.as_dict(), model, cmd_recv, evt_send),
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
