"""The messages between the core process and its API processes (`serve --api-servers N`): each frame is a 4-byte
length and a pickled list of messages, so whatever one side has to say in one turn of its loop goes in one write.

API process -> core:
    ("hello", index)                                         the first message: which API process this is
    ("submit", call_id, token_ids, params, arrival, prefix)  route and submit a request (params: SamplingParams)
    ("leave", rid, done)                                     its response is over (not done: abort it)
    ("observe", backend, prompt, cached, generated, ttft, e2e)  a finished request, for /metrics
    ("call", call_id, method, args)                          one of CALLS, answered by a reply
core -> API process:
    ("submitted", call_id, rid, backend)                     a submit's answer: before any of its tokens
    ("reply", call_id, ok, value)                            value: the result, or (error class name, message, param)
    ("tokens", [(rid, tokens, ended, finish_reason, error, cached_tokens, backend), ...])  one per engine step
    ("exit",)                                                the core drained: stop serving
"""

from __future__ import annotations

import asyncio
import pickle
import socket
import struct

from mvllm.errors import InvalidRequestError, MvllmError
from mvllm.server.cluster import ShuttingDownError

HEADER = struct.Struct("!I")
CALLS = ("health", "render_metrics", "snapshot_all", "warm", "reset_prefix_cache", "set_policy")


def frame(messages: list) -> bytes:
    body = pickle.dumps(messages, protocol=pickle.HIGHEST_PROTOCOL)
    return HEADER.pack(len(body)) + body


async def read_frame(reader: asyncio.StreamReader) -> list:
    """The next frame's messages; IncompleteReadError once the other side has gone."""
    size, = HEADER.unpack(await reader.readexactly(HEADER.size))
    return pickle.loads(await reader.readexactly(size))


class Outbox:
    """One end of a socket: the messages of one turn of the loop go out in one frame, one write."""

    def __init__(self, loop: asyncio.AbstractEventLoop, writer: asyncio.StreamWriter | None = None):
        self.loop, self.writer = loop, writer
        self.out: list = []
        self.due = False

    def send(self, message: tuple) -> None:
        self.out.append(message)
        self.due_now()

    def due_now(self) -> None:
        if not self.due:
            self.due = True
            self.loop.call_soon(self.flush)

    def flush(self) -> None:
        self.due = False
        if self.out and self.writer is not None and not self.writer.is_closing():
            self.writer.write(frame(self.out))
        self.out = []


def error_value(e: Exception) -> tuple[str, str, str | None]:
    return type(e).__name__, str(e), getattr(e, "param", None)


def raise_error(value: tuple[str, str, str | None]) -> None:
    """Raise, in the API process, the error the core raised: a bad request stays a 400, the rest a 503."""
    kind, message, param = value
    if kind == "InvalidRequestError":
        raise InvalidRequestError(message, param)
    if kind == "ShuttingDownError":
        raise ShuttingDownError(message)
    raise MvllmError(message)


def port_socket(host: str, port: int, listen: bool) -> socket.socket:
    """A socket bound to host:port with SO_REUSEPORT, so that several bind it; listening (an API process's), or
    only holding the port (the core's: that one first checks that nothing holds it yet, or a second server started
    on the same port would share the first one's connections)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    if not listen:
        with socket.socket(family, socket.SOCK_STREAM) as probe:  # no SO_REUSEPORT: fails where any socket is bound
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            _bind(probe, host, port)
            port = probe.getsockname()[1]  # port 0: the one the system gave
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        _bind(sock, host, port)
    except MvllmError:
        sock.close()
        raise
    if listen:
        sock.listen(2048)
    return sock


def _bind(sock: socket.socket, host: str, port: int) -> None:
    try:
        sock.bind((host, port))
    except OSError as e:
        raise MvllmError(f"cannot listen on {host}:{port}: {e.strerror}") from None
