"""A small HTTP/1.1 client for streamed responses, on asyncio protocols: the load generator's hot path.

A general client (httpx on h11) parses every chunk in pure Python and wakes a coroutine per read; here the
transport's `data_received` stamps the read, splits the chunked body into server-sent-event `data:` lines and
hands them to a callback, with no coroutine in between. Only what an OpenAI-compatible server sends is
understood: a status line, headers, then a chunked, sized or close-delimited body.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections.abc import Callable
from urllib.parse import urlsplit

HEAD_LIMIT = 64 * 1024


class ProtocolError(Exception):
    pass


class ResponseParser:
    """Feed bytes as they arrive; `on_data(payload)` gets each SSE `data:` line's payload (bytes, stripped).
    After `done`: status, headers (lower-case names), `body` (the bytes of a non-streamed answer) and
    `reusable` (the connection may carry another request)."""

    def __init__(self, on_data: Callable[[bytes], None]):
        self.on_data = on_data
        self.status = 0
        self.headers: dict[str, str] = {}
        self.done = False
        self.reusable = False
        self.body = bytearray()
        self.streaming = False  # text/event-stream with status 200: data lines go to on_data
        self._head = b""
        self._buf = b""  # bytes of the body not yet framed (chunked) or not yet split into lines
        self._mode = ""  # "chunked", "length" or "close"
        self._left = 0  # the rest of the current chunk (chunked) or of the body (length)
        self._lines = b""
        self._state = "head"  # head, size, data, crlf, trailer

    def feed(self, data: bytes) -> None:
        if self.done:
            return
        if self._state == "head":
            self._head += data
            end = self._head.find(b"\r\n\r\n")
            if end < 0:
                if len(self._head) > HEAD_LIMIT:
                    raise ProtocolError("the response headers are too long")
                return
            self._start(self._head[:end])
            data, self._head = self._head[end + 4:], b""
        if self._mode == "chunked":
            self._chunked(data)
        elif self._mode == "length":
            take = data[:self._left]
            self._left -= len(take)
            self._body(take)
            if self._left == 0:
                self._finish(True)
        else:
            self._body(data)

    def eof(self) -> None:
        """The server closed the connection: a close-delimited body ends; anything else was cut."""
        if self.done:
            return
        if self._state != "head" and self._mode == "close":
            self._finish(False)
            return
        raise ProtocolError("the server closed the connection mid-response")

    def _start(self, head: bytes) -> None:
        lines = head.decode("latin-1").split("\r\n")
        parts = lines[0].split(" ", 2)
        if len(parts) < 2 or not parts[0].startswith("HTTP/1."):
            raise ProtocolError(f"not an HTTP/1.x response: {lines[0][:80]!r}")
        self.status = int(parts[1])
        for line in lines[1:]:
            name, _, value = line.partition(":")
            self.headers[name.strip().lower()] = value.strip()
        self.streaming = self.status == 200 and "event-stream" in self.headers.get("content-type", "")
        keep = self.headers.get("connection", "").lower() != "close" and parts[0] == "HTTP/1.1"
        if "chunked" in self.headers.get("transfer-encoding", "").lower():
            self._mode, self._state = "chunked", "size"
        elif "content-length" in self.headers:
            self._mode, self._left, self._state = "length", int(self.headers["content-length"]), "data"
            if self._left == 0:
                self._finish(keep)
        else:
            self._mode, self._state = "close", "data"
        self.reusable = keep

    def _chunked(self, data: bytes) -> None:
        buf = self._buf + data if self._buf else data
        at = 0
        while not self.done:
            if self._state == "size":
                end = buf.find(b"\r\n", at)
                if end < 0:
                    break
                self._left = int(buf[at:end].split(b";", 1)[0], 16)
                at = end + 2
                self._state = "data" if self._left else "trailer"
            elif self._state == "data":
                take = buf[at:at + self._left]
                if not take:
                    break
                at += len(take)
                self._left -= len(take)
                self._body(take)
                if self._left == 0:
                    self._state = "crlf"
            elif self._state == "crlf":
                if len(buf) - at < 2:
                    break
                at += 2
                self._state = "size"
            else:  # trailer: lines until an empty one
                end = buf.find(b"\r\n", at)
                if end < 0:
                    break
                if end == at:
                    self._finish(self.reusable)
                at = end + 2
        self._buf = buf[at:]

    def _body(self, data: bytes) -> None:
        if not self.streaming:
            self.body += data
            return
        lines = self._lines + data if self._lines else data
        start = 0
        while True:
            end = lines.find(b"\n", start)
            if end < 0:
                break
            line = lines[start:end]
            start = end + 1
            if line.startswith(b"data:"):
                self.on_data(line[5:].strip())
        self._lines = lines[start:]

    def _finish(self, reusable: bool) -> None:
        if self._lines.startswith(b"data:"):  # a last line without its newline
            self.on_data(self._lines[5:].strip())
        self._lines = b""
        self.done, self.reusable = True, reusable


class Exchange(asyncio.Protocol):
    """One connection; carries one request at a time. `start(request, on_data, on_read)` sends it; `ended`
    resolves when the response is complete (or fails). `on_read(stamp)` runs at each read, before parsing."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.parser: ResponseParser | None = None
        self.ended: asyncio.Future | None = None
        self.on_read: Callable[[float], None] | None = None
        self.closed = False
        self.idle_since = 0.0
        self.reads = 0
        self.last_read = 0.0

    def connection_made(self, transport) -> None:
        self.transport = transport

    def start(self, request: bytes, on_data: Callable[[bytes], None], on_read: Callable[[float], None]) -> None:
        self.parser = ResponseParser(on_data)
        self.on_read = on_read
        self.ended = asyncio.get_running_loop().create_future()
        self.ended.add_done_callback(lambda f: f.cancelled() or f.exception())  # a failure nobody awaits
        self.reads, self.last_read = 0, time.perf_counter()
        self.transport.write(request)

    def data_received(self, data: bytes) -> None:
        if self.parser is None or self.ended.done():
            return
        self.last_read = time.perf_counter()
        self.reads += 1
        self.on_read(self.last_read)
        try:
            self.parser.feed(data)
        except (ProtocolError, ValueError) as e:
            self._fail(e)
            return
        except Exception as e:  # the caller's on_data failed: end this request, keep the client running
            self._fail(e)
            return
        if self.parser.done:
            self.ended.set_result(self.parser)

    def eof_received(self):
        self.closed = True
        if self.parser is not None and not self.ended.done():
            try:
                self.parser.eof()
                self.ended.set_result(self.parser)
            except ProtocolError as e:
                self.ended.set_exception(e)
        return False

    def connection_lost(self, exc) -> None:
        self.closed = True
        if self.ended is not None and not self.ended.done():
            self.ended.set_exception(exc or ProtocolError("the server closed the connection mid-response"))

    def _fail(self, e: Exception) -> None:
        self.ended.set_exception(e)
        self.close()

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()


class Pool:
    """Keep-alive connections to one server. An idle connection is dropped after `expiry` seconds, before a
    server's keep-alive ends (uvicorn's default: 5 s), so no request goes out on a connection being closed."""

    def __init__(self, url: str, connect_timeout: float = 30.0, expiry: float = 2.0):
        u = urlsplit(url)
        if u.scheme not in ("http", "https") or not u.hostname:
            raise ValueError(f"not an http(s) URL: {url!r}")
        self.host, self.tls = u.hostname, u.scheme == "https"
        self.port = u.port or (443 if self.tls else 80)
        self.base = u.path.rstrip("/")
        self.authority = u.netloc
        self.connect_timeout, self.expiry = connect_timeout, expiry
        self.idle: list[Exchange] = []

    def request(self, path: str, body: bytes) -> bytes:
        return (f"POST {self.base}{path} HTTP/1.1\r\nHost: {self.authority}\r\nContent-Type: application/json\r\n"
                f"Accept: text/event-stream\r\nContent-Length: {len(body)}\r\n\r\n").encode() + body

    async def get(self) -> Exchange:
        now = time.monotonic()
        while self.idle:
            ex = self.idle.pop()
            if not ex.closed and now - ex.idle_since < self.expiry:
                return ex
            ex.close()
        loop = asyncio.get_running_loop()
        ctx = ssl.create_default_context() if self.tls else None
        _, ex = await asyncio.wait_for(loop.create_connection(Exchange, self.host, self.port, ssl=ctx),
                                       self.connect_timeout)
        return ex

    def put(self, ex: Exchange, reusable: bool) -> None:
        if reusable and not ex.closed:
            ex.parser = None
            ex.idle_since = time.monotonic()
            self.idle.append(ex)
        else:
            ex.close()

    def close(self) -> None:
        for ex in self.idle:
            ex.close()
        self.idle.clear()
