"""The messages between the Cluster and its backends, one class each.

A worker process (worker.py) sends Ready or Failed once, when its engine has loaded or could not, then
Scheduled, Step, KvEvents, Error, Aborted and a Reply for each Call; its parent adds Dead when the process ends.
A remote server (remote.py) has no process: its RemoteBackend makes the same events from the HTTP streams,
and Done, Lost, Load and Up besides. The Cluster receives every event but Ready, Failed and Reply (those are
answered by the backend itself) through `Backend.listen`, and matches on the classes.

Commands go the other way, to a worker only: Submit, Abort, Call and Shutdown. Everything here crosses a
multiprocessing Pipe (the spawn context pickles it): module-level dataclasses, fields of plain data.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

Method = Literal["cached_prefix_len", "snapshot", "warm", "reset_prefix_cache"]  # what `Backend.call` answers


# --- start-up: a worker's first message ------------------------------------------------------------------


@dataclass(slots=True, frozen=True)
class Ready:
    """The engine has loaded (and captured its graphs): its settings and load (worker.snapshot), and ready_s."""

    info: dict


@dataclass(slots=True, frozen=True)
class Failed:
    """The engine could not load; the message is one line."""

    message: str


# --- events: a backend to the Cluster --------------------------------------------------------------------


@dataclass(slots=True, frozen=True)
class Scheduled:
    """Requests admitted to a batch, each with how many of its prompt tokens were cached (a remote: one,
    when it has finished, with the count its usage reported)."""

    admitted: list[tuple[str, int]]


@dataclass(slots=True, frozen=True)
class Step:
    """One step's tokens, (request id, token, finish reason or None), and the backend's load after it (sent
    even with no token: the load shows the blocks freed); kv: its prefix cache's changes (as KvEvents')."""

    tokens: list[tuple[str, int, str | None]]
    load: dict
    kv: tuple[list[tuple[int, tuple[int, ...]]], list[int]] | None = None


@dataclass(slots=True, frozen=True)
class KvEvents:
    """A worker's prefix cache changed outside a step (a warm, a reset): the blocks now cached, (hash, tokens),
    and the hashes gone (BlockManager.take_events). Sent before the Reply of the call that changed it."""

    stored: list[tuple[int, tuple[int, ...]]]
    removed: list[int]


@dataclass(slots=True, frozen=True)
class Error:
    """The request ended with an error; the message is what its client gets."""

    rid: str
    message: str


@dataclass(slots=True, frozen=True)
class Aborted:
    """The request was aborted on the backend: the tokens it had made and the wall time (time.time) then."""

    rid: str
    generated: int = 0
    at: float = 0.0


@dataclass(slots=True, frozen=True)
class Done:
    """A remote's request ended after its last token (a worker's last Step carries the finish reason)."""

    rid: str
    reason: str


@dataclass(slots=True, frozen=True)
class Lost:
    """A remote's request failed on the way while the remote still answers its health probe: the Cluster
    sends it elsewhere if it had not started, else ends it with `why`."""

    rid: str
    why: str


@dataclass(slots=True, frozen=True)
class Load:
    """An mvllm remote's load, and how many requests it runs for other clients."""

    load: dict
    external: int


@dataclass(slots=True, frozen=True)
class Up:
    """A remote that was down answers its probe again: its snapshot now."""

    snapshot: dict


@dataclass(slots=True, frozen=True)
class Dead:
    """The backend is gone: its worker process ended, or the remote failed its health probe."""


BackendEvent = Scheduled | Step | KvEvents | Error | Aborted | Done | Lost | Load | Up | Dead


# --- commands: the parent to a worker, and the worker's replies ------------------------------------------


@dataclass(slots=True, frozen=True)
class Submit:
    rid: str
    token_ids: list[int]
    params: dict  # SamplingParams' fields
    arrival: float


@dataclass(slots=True, frozen=True)
class Abort:
    rid: str


@dataclass(slots=True, frozen=True)
class Call:
    """A call that gets a Reply with the same call_id: cached_prefix_len and snapshot are answered at once
    by the worker's control thread, warm and reset_prefix_cache between two engine steps."""

    call_id: int
    method: Method
    args: tuple = ()


@dataclass(slots=True, frozen=True)
class Shutdown:
    pass


Command = Submit | Abort | Call | Shutdown


@dataclass(slots=True, frozen=True)
class Reply:
    """The answer to Call `call_id`: its value, or the MvllmError it raised (raised again by the caller)."""

    call_id: int
    value: Any


FromWorker = Ready | Failed | Scheduled | Step | KvEvents | Error | Aborted | Reply  # what a worker process sends
