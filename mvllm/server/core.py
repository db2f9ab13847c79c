"""`serve --api-servers N`, N > 1: this process is the core, and N API processes serve HTTP.

The core keeps what must be one: the backends, the router, the prefix index its KV events feed, and the metrics. It
serves no HTTP. The N API processes (server/api.py) listen on one port, each on its own socket (SO_REUSEPORT: the
kernel spreads the connections evenly; one shared socket let whichever process woke first take a burst of them
all); the core holds the port with a socket that does not listen, so a restarted API process gets it back. Each
parses, tokenizes, detokenizes and writes its own requests' server-sent events. Between them, one Unix socket per
API process (server/wire.py): an API process sends its requests and its calls; the core sends it, once per turn of
its loop (once per engine step under load), one message with the new tokens of that process's requests only.

An API process that dies takes its requests with it: the core aborts them on their backends (their KV blocks
return to the pool) and starts another in its place. SIGTERM or Ctrl-C drain as with one process: no new requests
(503), running ones finish for up to the shutdown timeout, the rest end with finish_reason "abort"; then every API
process is told to exit, and the core stops the workers.
"""

from __future__ import annotations

import asyncio
import shutil
import signal
import tempfile
import time
from pathlib import Path

from mvllm.backends.base import spawn
from mvllm.engine.params import SamplingParams
from mvllm.errors import MvllmError
from mvllm.server.cluster import Cluster, Stream
from mvllm.server.wire import CALLS, Outbox, error_value, read_frame

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Proxy(Stream):
    """The core's mailbox for a request of an API process: what arrives for it is news for its link."""

    __slots__ = ("rid", "link", "queued")

    def __init__(self, link: Link):
        super().__init__()
        self.rid: str | None = None
        self.link, self.queued = link, False
        self.push = self.wake  # the cluster pushes once the steps in hand are in: one message for all of them

    def wake(self) -> None:
        self.link.news(self)


class Link(Outbox):
    """The core's end of one API process's socket: with the turn's other messages, one "tokens" message holding
    the news of every request of that process that had some."""

    def __init__(self, loop: asyncio.AbstractEventLoop, writer: asyncio.StreamWriter):
        super().__init__(loop, writer)
        self.index: int | None = None
        self.dirty: list[Proxy] = []
        self.held: dict[str, Proxy] = {}  # its requests the core still holds

    def news(self, proxy: Proxy) -> None:
        if not proxy.queued:
            proxy.queued = True
            self.dirty.append(proxy)
            self.due_now()

    def flush(self) -> None:
        if self.dirty:
            batch = []
            for p in self.dirty:
                p.queued = False
                batch.append((p.rid, p.tokens, p.ended, p.finish_reason, p.error, p.cached_tokens, p.backend))
                p.tokens = []
            self.dirty = []
            self.out.append(("tokens", batch))
        super().flush()


class Core:
    def __init__(self, cluster: Cluster, count: int, start_args: dict, console):
        """start_args: what every API process starts with (api.api_main's keyword arguments but its number and
        the core's path)."""
        self.cluster, self.count, self.start_args, self.console = cluster, count, start_args, console
        self.links: dict[int, Link] = {}
        self.procs: dict[int, object] = {}
        self.stop: asyncio.Event | None = None
        self.tasks: set[asyncio.Task] = set()
        self.stopping = False
        self.started = False  # every API process served once
        self.path: Path | None = None  # the Unix socket the API processes connect to, made by run
        self.loop: asyncio.AbstractEventLoop | None = None

    def start_api(self, index: int) -> None:
        import multiprocessing as mp

        from mvllm.server.api import api_main

        proc = mp.get_context("spawn").Process(target=api_main, name=f"mvllm-api-{index}", daemon=True,
                                               args=(index, str(self.path)), kwargs=self.start_args)
        proc.start()
        self.procs[index] = proc

    async def connected(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        link = Link(self.loop, writer)
        try:
            while True:
                for message in await read_frame(reader):
                    self.handle(link, message)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()
            self.lost(link)

    def handle(self, link: Link, message: tuple) -> None:
        kind = message[0]
        if kind == "leave":
            link.held.pop(message[1], None)
            self.cluster.leave(message[1], message[2])
        elif kind == "observe":
            self.cluster.observe_request(*message[1:])
        elif kind == "submit":
            spawn(self.tasks, self.submit(link, *message[1:]), "submit", self.loop)
        elif kind == "call":
            spawn(self.tasks, self.call(link, *message[1:]), "call", self.loop)
        elif kind == "hello":
            link.index = message[1]
            self.links[link.index] = link
        else:
            raise TypeError(f"an API process sent {message!r}")

    async def submit(self, link: Link, call_id: int, token_ids: list[int], params: SamplingParams, arrival: float,
                     prefix: str) -> None:
        proxy = Proxy(link)
        try:
            rid, backend = await self.cluster.submit(token_ids, params, arrival, prefix, proxy)
        except Exception as e:  # noqa: BLE001 -- every refusal is the API process's to answer
            link.send(("reply", call_id, False, error_value(e)))
            return
        proxy.rid = rid
        link.held[rid] = proxy
        link.send(("submitted", call_id, rid, backend))

    async def call(self, link: Link, call_id: int, method: str, args: tuple) -> None:
        try:
            if method not in CALLS:
                raise MvllmError(f"no call {method!r}")
            value = await getattr(self.cluster, method)(*args)
            if method == "health":
                value = self.health(*value)
            link.send(("reply", call_id, True, value))
        except Exception as e:  # noqa: BLE001
            link.send(("reply", call_id, False, error_value(e)))

    def health(self, code: int, body: dict) -> tuple[int, dict]:
        """/health with the API processes: their process ids; 503 until every one serves (at start, or while one
        that died is started again)."""
        body["api_servers"] = {i: p.pid for i, p in sorted(self.procs.items())}
        down = sorted(set(range(self.count)) - set(self.links))
        if down:
            body["status"] = "starting" if not self.started else "degraded"
            body["api_servers_down"] = down
            code = 503
        return code, body

    def lost(self, link: Link) -> None:
        """An API process is gone: its requests are aborted (their blocks return to the pool); unless the
        server is stopping, another takes its place."""
        for rid, proxy in link.held.items():
            self.cluster.leave(rid, proxy.ended)
        link.held.clear()
        if link.index is None or self.links.get(link.index) is not link:
            return
        del self.links[link.index]
        if self.stopping:
            return
        self.procs[link.index].join(0)
        self.console.print(f"[yellow]warning:[/yellow] API process {link.index} exited; starting another",
                           highlight=False)
        self.start_api(link.index)
        spawn(self.tasks, self.watch(link.index), f"start API process {link.index}", self.loop)

    async def watch(self, index: int) -> None:
        """An API process started again that exits before it serves cannot serve: the server stops (starting it
        again would only loop)."""
        proc = self.procs[index]
        while index not in self.links:
            if proc.exitcode is not None:
                self.console.print(f"[red]error:[/red] API process {index} exited before it served (exit code "
                                   f"{proc.exitcode}); stopping", highlight=False)
                self.stop.set()
                return
            await asyncio.sleep(0.1)

    async def run(self, warm_prefix: list[int] | None, ready_timeout: float, shutdown_timeout: float,
                  ready_line: str) -> None:
        self.loop = asyncio.get_running_loop()
        self.path = Path(tempfile.mkdtemp(prefix="mvllm-core-")) / "core.sock"
        self.cluster.start(self.loop)
        if warm_prefix:
            await self.cluster.warm(warm_prefix)
        server = await asyncio.start_unix_server(self.connected, str(self.path))
        stop = self.stop = asyncio.Event()
        signals, main = [], asyncio.current_task()

        def on_signal(sig: int) -> None:
            if signals:  # a second signal: stop now
                for proc in self.procs.values():
                    proc.kill()
                main.cancel()
                return
            signals.append(sig)
            self.cluster.draining = True  # now: a request that comes before the drain begins gets its 503 too
            self.console.print(f"mvllm: {signal.Signals(sig).name}: taking no new requests, letting running ones "
                               f"finish for up to {shutdown_timeout:g} s", highlight=False)
            stop.set()

        for sig in SIGNALS:
            self.loop.add_signal_handler(sig, on_signal, sig)
        try:
            for i in range(self.count):
                self.start_api(i)
            deadline = time.monotonic() + ready_timeout
            while len(self.links) < self.count and not stop.is_set():
                if time.monotonic() > deadline or any(p.exitcode is not None for p in self.procs.values()):
                    raise MvllmError(f"only {len(self.links)} of {self.count} API processes started")
                await asyncio.sleep(0.05)
            self.started = True
            if not stop.is_set():
                self.console.print(ready_line)
            await stop.wait()
            aborted = await self.cluster.drain(shutdown_timeout)
            if aborted:
                self.console.print(f"mvllm: aborted {aborted} request(s) still running", highlight=False)
        finally:
            self.stopping = True
            for link in list(self.links.values()):
                link.send(("exit",))
                link.flush()
            await self.loop.run_in_executor(None, self.join)
            server.close()
            shutil.rmtree(self.path.parent, ignore_errors=True)
            for sig in SIGNALS:
                self.loop.remove_signal_handler(sig)

    def join(self, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        for proc in self.procs.values():
            proc.join(max(deadline - time.monotonic(), 0))
            if proc.is_alive():
                proc.terminate()
                proc.join(2)
