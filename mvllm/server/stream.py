"""A request's response as it streams: its tokens taken from the Cluster's mailbox and turned into text (Run), the
OpenAI bodies (Shape), and the server-sent events written as tokens arrive (EventStream; docs/serving.md)."""

from __future__ import annotations

import asyncio
import time

import orjson
from fastapi import Request
from fastapi.responses import Response

from mvllm.model.tokenizer import Tokenizer
from mvllm.server.cluster import Cluster
from mvllm.server.text import Detokenizer


class Run:
    """One request in flight: takes its tokens from its stream, and turns them into text."""

    def __init__(self, cluster: Cluster, tokenizer: Tokenizer, rid, backend, token_ids, params, arrival):
        self.cluster, self.rid, self.backend, self.params, self.arrival = cluster, rid, backend, params, arrival
        self.stream = cluster.streams[rid]
        self.prompt_tokens = len(token_ids)
        self.detok = Detokenizer(tokenizer, params.stop)
        self.tokens: list[int] = []
        self.cached = 0
        self.first_token: float | None = None
        self.finish_reason: str | None = None
        self.error: str | None = None

    async def next(self) -> tuple[str, list[int]] | None:
        """The text and the token ids that arrived since the last call, all at once (a response that fell behind
        its backend catches up in one chunk); None once the request has ended and everything was taken. An
        ending ends the request's stream (a stop string: abort it on its backend)."""
        if self.finish_reason or self.error:
            return None
        return self.digest(await self.stream.take())

    def poll(self) -> tuple[str, list[int]] | None:
        """next's answer from what the stream holds now, without waiting (None also where it holds nothing)."""
        if self.finish_reason or self.error or not (self.stream.tokens or self.stream.ended):
            return None
        ids, self.stream.tokens = self.stream.tokens, []
        return self.digest(ids)

    def digest(self, ids: list[int]) -> tuple[str, list[int]] | None:
        """The text of these tokens and the ids up to any stop string; at the stream's end, the request's."""
        if self.finish_reason or self.error:  # it ended meanwhile (push took its last tokens)
            return None
        stream = self.stream
        if stream.backend is not None:
            self.backend = stream.backend
        if stream.cached_tokens is not None:
            self.cached = stream.cached_tokens
        text = ""
        if ids:
            self.first_token = self.first_token or time.time()
            last, add = len(ids) - 1, self.detok.add
            ended = stream.ended and stream.error is None
            for i, token in enumerate(ids):
                piece, stopped = add(token, final=ended and i == last)
                text += piece
                if stopped:
                    ids = ids[:i + 1]
                    self.finish_reason = "stop"
                    break
            self.tokens += ids
        if not self.finish_reason and stream.ended:
            if stream.error:
                self.error = stream.error
            else:
                self.finish_reason = stream.finish_reason if stream.finish_reason in ("length", "abort") else "stop"
                if not ids:
                    text += self.detok.flush()
        if self.finish_reason or self.error:
            self.cluster.leave(self.rid, stream.ended)
            if self.finish_reason:
                self._observe()
        return (text, ids) if ids or text else None

    def close(self) -> None:
        """Its response is over: a request that has not ended is aborted (its client went away)."""
        if not (self.finish_reason or self.error):
            self.cluster.leave(self.rid, False)

    def _observe(self) -> None:
        now = time.time()
        ttft = self.first_token - self.arrival if self.first_token else None
        self.cluster.observe_request(self.backend, self.prompt_tokens, self.cached, len(self.tokens),
                                             ttft, now - self.arrival)

    def usage(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": len(self.tokens),
                "total_tokens": self.prompt_tokens + len(self.tokens),
                "prompt_tokens_details": {"cached_tokens": self.cached}}


class Shape:
    """OpenAI response and chunk bodies for completions and chat completions."""

    def __init__(self, rid: str, model: str, backend: str, chat: bool):
        self.rid, self.model, self.backend, self.chat = rid, model, backend, chat
        self.created = int(time.time())
        self.object = "chat.completion" if chat else "text_completion"
        self._pieces: tuple[str, bytes, bytes, bytes] | None = None  # (backend, the bytes around text and ids)

    def _body(self, obj: str, choices: list, **extra) -> dict:
        return {"id": self.rid, "object": obj, "created": self.created, "model": self.model,
                "choices": choices, "backend": self.backend, **extra}

    def whole(self, run: Run) -> dict:
        self.backend = run.backend
        text = run.detok.text
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text},
                      "finish_reason": run.finish_reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": run.finish_reason,
                      "token_ids": run.tokens}
        return self._body(self.object, [choice], usage=run.usage())

    def chunk(self, text: str | None, ids: list[int], finish: str | None, role: bool = False) -> dict:
        obj = self.object + ".chunk" if self.chat else self.object
        if self.chat:
            delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish, "token_ids": ids}
        return self._body(obj, [choice])

    def token_line(self, text: str, ids: list[int]) -> bytes:
        """The SSE event of a chunk of tokens, `line(self.chunk(text, ids, None))`, byte for byte: the bytes around
        the text and the ids are made once (again if the backend changes), so a token costs two small dumps."""
        if self._pieces is None or self._pieces[0] != self.backend:
            empty = b"data: " + orjson.dumps(self.chunk("", [], None)) + b"\n\n"
            if self.chat:
                at = empty.index(b'"delta":{}') + 8
                self._pieces = (self.backend, empty[:at], empty[at + 2:], b"")
            else:
                at, ids_at = empty.index(b'"text":""') + 7, empty.index(b'"token_ids":[]') + 12
                self._pieces = (self.backend, empty[:at], empty[at + 2:ids_at], empty[ids_at + 2:])
        _, head, middle, tail = self._pieces
        if self.chat:
            return head + (b'{"content":' + orjson.dumps(text) + b"}" if text else b"{}") + middle
        return head + orjson.dumps(text) + middle + orjson.dumps(ids) + tail


async def until_done(run: Run, request: Request) -> None:
    """Run a non-streaming request to its end; a client that hangs up aborts it."""

    async def drain():
        while await run.next() is not None:
            pass

    task = asyncio.ensure_future(drain())
    try:
        while not task.done():
            await asyncio.wait([task], timeout=0.5)
            if not task.done() and await request.is_disconnected():
                task.cancel()
                break
        try:
            await task
        except asyncio.CancelledError:
            pass
    finally:
        run.close()


SERVER_SEND = "mvllm.server_send"  # the scope key under which `direct_send` keeps the server's own send


def direct_send(app):
    """The ASGI app `serve` hands uvicorn: `app`, with the server's own `send` kept in each request's scope, so a
    stream writes its chunks to it without passing each through every middleware's wrapper of it."""
    async def asgi(scope, receive, send):
        if scope["type"] == "http":
            scope[SERVER_SEND] = send
        await app(scope, receive, send)

    return asgi


class EventStream(Response):
    """A streamed response (server-sent events): one event for all the tokens that arrived since the last write
    (a response that falls behind its backend catches up in one event, carrying several tokens), then the final
    chunk, usage where asked, and [DONE]. Tokens are written by the step's loop itself (`push`) where the socket
    allows (`Socket`), else by `write`'s task through send. A client that hangs up ends the stream, and aborts its
    request."""

    media_type = "text/event-stream"

    def __init__(self, run: Run, shape: Shape, include_usage: bool, headers: dict):
        self.status_code, self.background = 200, None
        self.init_headers(headers)  # no body: no content-length (chunked)
        self.run, self.shape, self.include_usage = run, shape, include_usage

    async def __call__(self, scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
        body = asyncio.ensure_future(self.write(scope.get(SERVER_SEND, send)))
        gone = asyncio.ensure_future(hung_up(receive))
        try:
            await asyncio.wait((body, gone), return_when=asyncio.FIRST_COMPLETED)
        finally:
            self.run.stream.push = None
            gone.cancel()
            if not body.done():
                body.cancel()
                await asyncio.gather(body, return_exceptions=True)
            self.run.close()
        if not body.cancelled() and body.exception() is not None:
            raise body.exception()

    async def write(self, send) -> None:
        run, shape = self.run, self.shape

        def line(payload: dict) -> dict:
            return {"type": "http.response.body", "body": b"data: " + orjson.dumps(payload) + b"\n\n",
                    "more_body": True}

        if shape.chat:
            await send(line(shape.chunk(None, [], None, role=True)))
        self.socket = Socket.of(send)
        if self.socket is not None:
            run.stream.push = self.push
        while (delta := await run.next()) is not None:
            shape.backend = run.backend
            self.sending = True
            try:
                await send({"type": "http.response.body", "body": shape.token_line(*delta), "more_body": True})
            finally:
                self.sending = False
        run.stream.push = None
        shape.backend = run.backend
        if run.error:
            await send(line({"error": {"message": run.error, "type": "server_error", "param": None,
                                       "code": "backend_failed"}}))
        else:
            await send(line(shape.chunk(None, [], run.finish_reason)))
        if self.include_usage:
            await send(line({**shape._body(shape.object + ".chunk" if shape.chat else shape.object, []),
                             "usage": run.usage()}))
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})

    sending = False  # write is awaiting a send: push leaves the tokens to it (their order)
    socket: Socket | None = None

    def push(self) -> None:
        """Tokens arrived (the step's loop calls this): write them now, straight to the socket, where it takes
        them and no send is under way; else wake write, which sends them (in one event, with any that follow)."""
        run, stream = self.run, self.run.stream
        if self.sending or not self.socket.ready():
            stream.wake()
            return
        try:
            delta = run.poll()
            if delta is not None:
                self.shape.backend = run.backend
                self.socket.write(self.shape.token_line(*delta))
        except Exception:  # noqa: BLE001 -- push stops here; the response's task takes over from what is left
            stream.push = None
        if run.finish_reason or run.error or stream.push is None:
            stream.wake()  # write ends the response


class Socket:
    """A response's socket under uvicorn's httptools server, for writes from the step's loop: the body's chunks
    framed as its send frames them (chunked), written only while the transport takes them (no flow control held
    back) and the client is there. Other servers: None, and every chunk goes through send."""

    __slots__ = ("cycle",)

    def __init__(self, cycle):
        self.cycle = cycle

    @classmethod
    def of(cls, send) -> Socket | None:
        cycle = getattr(send, "__self__", None)
        if (type(cycle).__module__ != "uvicorn.protocols.http.httptools_impl"
                or getattr(cycle, "chunked_encoding", None) is not True
                or not all(hasattr(cycle, a) for a in ("transport", "flow", "disconnected", "response_complete"))):
            return None  # not the server this was written against: every chunk through send
        return cls(cycle)

    def ready(self) -> bool:
        c = self.cycle
        return not (c.flow.write_paused or c.disconnected or c.response_complete)

    def write(self, data: bytes) -> None:
        self.cycle.transport.write(b"%x\r\n%b\r\n" % (len(data), data))


async def hung_up(receive) -> None:
    """Return when the client has disconnected."""
    while (await receive())["type"] != "http.disconnect":
        pass
