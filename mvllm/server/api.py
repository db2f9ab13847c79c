"""An API process of `serve --api-servers N` (server/core.py): the HTTP app over a link to the core's Cluster.

`CoreLink` answers the calls the app and its streams make of a Cluster (submit, leave, the endpoints' calls, the
request metrics), over the Unix socket to the core (server/wire.py). The core sends, per turn of its loop, one
message with this process's requests' new tokens; they go to the requests' mailboxes here as the Cluster delivers
a step's tokens in one process. This process imports no torch.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import signal

import uvicorn

from mvllm.engine.params import SamplingParams
from mvllm.errors import MvllmError
from mvllm.server.cluster import Pushes, Stream
from mvllm.server.wire import Outbox, port_socket, raise_error, read_frame

GONE = "the server's core process stopped"


class CoreLink:
    """The Cluster as an API process sees it."""

    def __init__(self, index: int, path: str, snapshots: dict[str, dict], names: list[str]):
        self.index, self.path, self.snapshots, self.backend_names = index, path, snapshots, names
        self.streams: dict[str, Stream] = {}
        self.pending: dict[int, asyncio.Future] = {}
        self.calls = itertools.count()
        self.pushes = Pushes()
        self.outbox: Outbox | None = None
        self.ready: asyncio.Future | None = None
        self.on_gone = lambda: None  # the server stops serving once the core has gone

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self.pushes.loop, self.ready = loop, loop.create_future()
        self.outbox = Outbox(loop)
        self.task = loop.create_task(self._run())

    async def _run(self) -> None:
        try:
            reader, self.outbox.writer = await asyncio.open_unix_connection(self.path)
            self.outbox.send(("hello", self.index))
            self.ready.set_result(None)
            while True:
                for message in await read_frame(reader):
                    self._on(message)
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            if not self.ready.done():
                self.ready.set_exception(MvllmError(GONE))
            for fut in self.pending.values():
                if not fut.done():
                    fut.set_exception(MvllmError(GONE))
            for stream in self.streams.values():
                stream.end(error=GONE)
            self.on_gone()

    def _on(self, message: tuple) -> None:
        kind = message[0]
        if kind == "tokens":
            self._tokens(message[1])
        elif kind == "submitted":
            _, call_id, rid, backend = message
            self.streams[rid] = Stream()  # before any of its tokens: they follow this message
            fut = self.pending.pop(call_id)
            if fut.done():  # its client went away while it was routed
                self.leave(rid, False)
            else:
                fut.set_result((rid, backend))
        elif kind == "reply":
            _, call_id, ok, value = message
            fut = self.pending.pop(call_id)
            if fut.done():
                return
            if ok:
                fut.set_result(value)
            else:
                try:
                    raise_error(value)
                except MvllmError as e:
                    fut.set_exception(e)
        elif kind == "exit":
            self.on_gone()
        else:
            raise TypeError(f"the core sent {message!r}")

    def _tokens(self, batch: list[tuple]) -> None:
        """One message's news, in one loop, as Cluster._tokens delivers a step's tokens."""
        streams, push = self.streams, self.pushes.add
        for rid, tokens, ended, reason, error, cached, backend in batch:
            stream = streams.get(rid)
            if stream is None or stream.ended:
                continue
            if cached is not None:
                stream.cached_tokens = cached
            if backend is not None:
                stream.backend = backend
            if tokens:
                stream.tokens += tokens
                if stream.push is not None:
                    push(stream)
                elif not ended:
                    stream.wake()
            if ended:
                stream.end(reason, error)

    async def _ask(self, kind: str, *args):
        """Send a call (its id first) and wait for its answer."""
        await self.ready
        call_id = next(self.calls)
        fut = self.pending[call_id] = self.ready.get_loop().create_future()
        self.outbox.send((kind, call_id, *args))
        return await fut

    # what the app and its streams call
    async def submit(self, token_ids: list[int], params: SamplingParams, arrival: float | None = None,
                     prefix: str = "cmpl") -> tuple[str, str]:
        return await self._ask("submit", token_ids, params, arrival, prefix)

    def leave(self, rid: str, done: bool) -> None:
        self.streams.pop(rid, None)
        self.outbox.send(("leave", rid, done))

    def observe_request(self, *args) -> None:
        self.outbox.send(("observe", *args))

    async def health(self) -> tuple[int, dict]:
        return await self._ask("call", "health", ())

    async def render_metrics(self) -> bytes:
        return await self._ask("call", "render_metrics", ())

    async def snapshot_all(self) -> list[dict]:
        return await self._ask("call", "snapshot_all", ())

    async def warm(self, token_ids: list[int], backend: str | None = None) -> dict[str, int]:
        return await self._ask("call", "warm", (token_ids, backend))

    async def reset_prefix_cache(self) -> dict[str, bool]:
        return await self._ask("call", "reset_prefix_cache", ())

    async def set_policy(self, policy: str, slo: dict | None) -> str:
        return await self._ask("call", "set_policy", (policy, slo))


def api_main(index: int, path: str, host: str, port: int, model: str, vocab_size: int, context: int,
             snapshots: dict[str, dict], names: list[str]) -> None:
    """An API process: serve HTTP on the core's port until the core says exit or goes."""
    from mvllm.model.loader import load_tokenizer, resolve
    from mvllm.model.tokenizer import Tokenizer
    from mvllm.server.app import build_app
    from mvllm.server.stream import direct_send

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the core drains, then says exit
    tokenizer = Tokenizer(load_tokenizer(resolve(model)), model)
    link = CoreLink(index, path, snapshots, names)
    app = build_app(link, tokenizer, model, vocab_size, None, context)
    config = uvicorn.Config(direct_send(tagged(app, index)), log_level="warning", timeout_graceful_shutdown=5,
                            timeout_keep_alive=30)
    server = ApiServer(config)

    def stop() -> None:
        server.should_exit = True

    link.on_gone = stop
    server.run(sockets=[port_socket(host, port, listen=True)])


def tagged(app, index: int):
    """`app`, its every response naming this API process (header x-mvllm-api-server)."""
    header = (b"x-mvllm-api-server", str(index).encode())

    async def asgi(scope, receive, send):
        if scope["type"] != "http":
            return await app(scope, receive, send)

        async def tag(message):
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", ()), header]
            await send(message)

        await app(scope, receive, tag)

    return asgi


class ApiServer(uvicorn.Server):
    """uvicorn's server without its signal handlers: the core decides when this process stops."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield
