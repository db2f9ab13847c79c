"""What the server holds a backend by: a worker process on this machine (process.ProcessBackend) or another
OpenAI-compatible server (remote.RemoteBackend) implement the same `Backend`, so the Cluster and the
Router never know which they hold. The messages it sends are in events.py."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any, Protocol

from mvllm.backends.events import BackendEvent, Method

if TYPE_CHECKING:
    from mvllm.backends.spec import BackendSpec
    from mvllm.engine.params import SamplingParams

log = logging.getLogger("mvllm")

OnEvent = Callable[[str, BackendEvent], None]  # (backend name, event), called on the event loop


class Backend(Protocol):
    name: str
    spec: BackendSpec
    alive: bool  # it takes requests; False once Dead (until a remote is Up again)
    info: dict  # its settings and load when it became ready

    def wait_ready(self, timeout: float) -> None:
        """Block (before the event loop runs) until it serves; MvllmError if it does not within `timeout`."""

    def listen(self, loop: asyncio.AbstractEventLoop, on_event: OnEvent) -> None:
        """From now on, pass every event to `on_event` on `loop`."""

    async def call(self, method: Method, *args: Any, timeout: float = 600.0) -> Any:
        """Ask it something (see events.Method); MvllmError if it is down or the call fails."""

    def submit(self, request_id: str, token_ids: list[int], params: SamplingParams, arrival: float) -> None:
        """Start a request; its tokens and end come as events. MvllmError if it is down."""

    def abort(self, request_id: str) -> None:
        """End a request early (an Aborted event follows if it was still running there)."""

    def mark_dead(self) -> None:
        """The Cluster has handled its Dead event: fail the calls waiting on it, drop what it ran."""

    def health(self) -> dict:
        """What /health shows for it besides alive and restarts."""

    def shutdown(self, timeout: float = 5.0) -> None:
        """Stop it (blocking), waiting up to `timeout` seconds for it to end by itself."""


def spawn(tasks: set[asyncio.Task], coro: Coroutine[Any, Any, Any], name: str,
          loop: asyncio.AbstractEventLoop | None = None) -> asyncio.Task:
    """Run `coro` as a background task, held in `tasks` until it ends (the event loop keeps only a weak
    reference to a task), its exception logged rather than lost."""
    task = (loop or asyncio.get_running_loop()).create_task(coro, name=name)
    tasks.add(task)
    task.add_done_callback(lambda t: _ended(tasks, t))
    return task


def _ended(tasks: set[asyncio.Task], task: asyncio.Task) -> None:
    tasks.discard(task)
    if not task.cancelled() and task.exception() is not None:
        log.error("%s failed", task.get_name(), exc_info=task.exception())
