"""A stub OpenAI-compatible server that streams pre-made chunks: what the load generator's ceiling is
measured against (`mvllm bench --selftest`), and what its tests replay on.

It answers POST /v1/completions with `benchmark_length` (else `max_tokens`, else 16) chunks in mvllm's form
(one token id each, token i of a reply is i), then the finish chunk, the usage chunk and [DONE]; GET
/v1/models lists "stub". Chunks go out as fast as the socket takes them, a stream at a time in turn, or
`every` seconds apart. `cut`: every cut-th request (1-based, per process) stops after half its tokens, the
connection closed mid-stream. Several processes share the port (SO_REUSEPORT) where the system spreads
connections over them (Linux).
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing as mp
import signal
import socket
import sys
import time

from mvllm.bench.loadgen import run_loop

MODEL = "stub"
HEAD = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n"
        b"x-mvllm-backend: stub\r\n\r\n")


def _event(body: dict) -> bytes:
    return b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n"


def _frame(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def _token(i: int) -> bytes:
    return _frame(_event({"id": "cmpl-stub", "object": "text_completion", "created": 0, "model": MODEL,
                          "choices": [{"index": 0, "text": "", "logprobs": None, "finish_reason": None,
                                       "token_ids": [i]}], "backend": "stub"}))


class Stub(asyncio.Protocol):
    tokens: list[bytes] = []  # pre-made: the frame of token i
    served = 0

    def __init__(self, every: float, cut: int):
        self.every, self.cut = every, cut
        self.buf = b""
        self.transport = None
        self.writable = asyncio.Event()
        self.writable.set()
        self.task: asyncio.Task | None = None

    def connection_made(self, transport) -> None:
        self.transport = transport

    def pause_writing(self) -> None:
        self.writable.clear()

    def resume_writing(self) -> None:
        self.writable.set()

    def connection_lost(self, exc) -> None:
        if self.task is not None:
            self.task.cancel()

    def data_received(self, data: bytes) -> None:
        self.buf += data
        end = self.buf.find(b"\r\n\r\n")
        if end < 0 or self.task is not None and not self.task.done():
            return
        head = self.buf[:end].decode("latin-1")
        length = 0
        for line in head.split("\r\n")[1:]:
            name, _, value = line.partition(":")
            if name.strip().lower() == "content-length":
                length = int(value)
        if len(self.buf) < end + 4 + length:
            return
        body, self.buf = self.buf[end + 4:end + 4 + length], self.buf[end + 4 + length:]
        method, path = head.split(" ", 2)[:2]
        if method == "GET" and path == "/v1/models":
            self._json(200, {"object": "list", "data": [{"id": MODEL, "object": "model"}]})
        elif method == "POST" and path == "/v1/completions":
            try:
                req = json.loads(body)
                n = int(req.get("benchmark_length") or req.get("max_tokens") or 16)
            except (ValueError, TypeError, AttributeError):
                self._json(400, {"error": {"message": "bad request", "type": "invalid_request_error"}})
                return
            Stub.served += 1
            cut = n // 2 if self.cut and Stub.served % self.cut == 0 else None
            self.task = asyncio.ensure_future(self.stream(n, cut, req.get("prompt") or []))
        else:
            self._json(404, {"error": {"message": "not found", "type": "not_found_error"}})

    def _json(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.transport.write(b"HTTP/1.1 %d X\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                             % (status, len(data), data))

    async def stream(self, n: int, cut: int | None, prompt) -> None:
        t = self.transport
        t.write(HEAD)
        tokens = Stub.tokens
        for i in range(n if cut is None else cut):
            t.write(tokens[i % len(tokens)])
            if self.every:
                await asyncio.sleep(self.every)
            else:
                await asyncio.sleep(0)  # the other streams' turn
            if not self.writable.is_set():
                await self.writable.wait()
        if cut is not None:
            t.close()
            return
        prompt_tokens = len(prompt) if isinstance(prompt, list) else 1
        end = {"id": "cmpl-stub", "object": "text_completion", "created": 0, "model": MODEL, "backend": "stub"}
        t.write(_frame(_event(end | {"choices": [{"index": 0, "text": "", "logprobs": None, "finish_reason": "length",
                                                  "token_ids": []}]})))
        t.write(_frame(_event(end | {"choices": [], "usage": {
            "prompt_tokens": prompt_tokens, "completion_tokens": n, "total_tokens": prompt_tokens + n,
            "prompt_tokens_details": {"cached_tokens": 0}}})))
        t.write(_frame(b"data: [DONE]\n\n") + b"0\r\n\r\n")


async def serve(port: int, every: float = 0.0, cut: int = 0, reuse_port: bool = False, ready=None) -> None:
    Stub.tokens = [_token(i) for i in range(4096)]
    server = await asyncio.get_running_loop().create_server(lambda: Stub(every, cut), "127.0.0.1", port,
                                                            reuse_port=reuse_port or None, backlog=4096)
    if ready is not None:
        ready.set()
    async with server:
        await server.serve_forever()


def _main(port, every, cut, reuse_port, ready) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    run_loop(serve(port, every, cut, reuse_port, ready))


class StubServer:
    """`with StubServer(processes=4) as stub:` ... stub.url; stopped at the end."""

    def __init__(self, processes: int = 1, every: float = 0.0, cut: int = 0):
        if processes > 1 and not sys.platform.startswith("linux"):
            processes = 1  # only Linux spreads one port's connections over processes
        self.processes, self.every, self.cut = processes, every, cut
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.procs: list = []

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> StubServer:
        ctx = mp.get_context("spawn")
        for _ in range(self.processes):
            ready = ctx.Event()
            p = ctx.Process(target=_main, args=(self.port, self.every, self.cut, self.processes > 1, ready),
                            daemon=True, name="mvllm-stub")
            p.start()
            self.procs.append(p)
            if not ready.wait(60):
                self.__exit__()
                raise RuntimeError("the stub server did not start")
        time.sleep(0.05)
        return self

    def __exit__(self, *exc) -> None:
        for p in self.procs:
            p.terminate()
        for p in self.procs:
            p.join(5)
