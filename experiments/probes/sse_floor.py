"""The floor under the API process's CPU per streamed token: a bare ASGI app on uvicorn (no FastAPI, no router, no
backend) that gives every open stream one token a step and writes it as one server-sent event shaped like
mvllm's, driven by the bench client as experiments/api_cost.py drives `mvllm serve`.

    python experiments/probes/sse_floor.py                 # each stream's task wakes and sends through ASGI
    python experiments/probes/sse_floor.py --direct        # the step's loop writes to each socket itself

With --direct the ticker writes each event to the stream's transport (uvicorn's, reached through its send):
no task wakes, no ASGI send; what is left is one socket write a token and the event loop around it.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import orjson

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def event(ids: list[int], finish: str | None = None) -> bytes:
    return b"data: " + orjson.dumps({"choices": [{"index": 0, "text": "", "finish_reason": finish,
                                                  "token_ids": ids}]}) + b"\n\n"


def serve(port: int, step_s: float, direct: bool) -> None:
    import uvicorn

    streams: dict[int, list] = {}  # id -> [tokens owed, waiter, transport, written, wanted]

    async def tick() -> None:
        while True:
            await asyncio.sleep(step_s)
            for s in list(streams.values()):
                if s[2] is not None:
                    data = event([5])
                    s[2].write(b"%x\r\n" % len(data) + data + b"\r\n")
                    s[3] += 1
                    if s[3] == s[4]:
                        s[1].set_result(None)
                    continue
                s[0] += 1
                if s[1] is not None and not s[1].done():
                    s[1].set_result(None)

    async def app(scope, receive, send):
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                app.ticker = asyncio.ensure_future(tick())
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        body = b""
        while True:
            m = await receive()
            body += m.get("body", b"")
            if not m.get("more_body"):
                break
        n = orjson.loads(body)["max_tokens"]
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})
        loop, me = asyncio.get_running_loop(), [0, None, None, 0, n]
        if direct:
            me[1], me[2] = loop.create_future(), send.__self__.transport
            streams[id(me)] = me
            await me[1]
        else:
            streams[id(me)] = me
            sent = 0
            while sent < n:
                while not me[0]:
                    me[1] = loop.create_future()
                    await me[1]
                    me[1] = None
                k, me[0] = min(me[0], n - sent), 0
                sent += k
                await send({"type": "http.response.body", "body": event([5] * k), "more_body": True})
        del streams[id(me)]
        tail = event([], "length") + orjson.dumps({"usage": {"completion_tokens": n}}).join([b"data: ", b"\n\n"])
        await send({"type": "http.response.body", "body": tail + b"data: [DONE]\n\n", "more_body": False})

    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--direct", action="store_true")
    ap.add_argument("--concurrency", type=int, default=128)
    ap.add_argument("--output", type=int, default=256)
    ap.add_argument("--step-ms", type=float, default=10.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--serve", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve is not None:
        return serve(args.serve, args.step_ms / 1000, args.direct)
    from mvllm.bench.loadgen import generate
    from mvllm.bench.process import free_port
    from mvllm.bench.request import Request

    port = free_port()
    server = subprocess.Popen([sys.executable, __file__, "--serve", str(port), "--step-ms", str(args.step_ms)]
                              + (["--direct"] if args.direct else []))
    try:
        url = f"http://127.0.0.1:{port}"
        time.sleep(2.0)
        reqs = [Request(i, [100 + i], args.output, 0.0) for i in range(args.concurrency)]
        generate(url, None, reqs[:8], 60.0, 1)
        for _ in range(args.repeats):
            c0 = cpu_seconds(server.pid)
            records, _, _, _ = generate(url, None, reqs, 120.0, 1)
            api = cpu_seconds(server.pid) - c0
            tokens = sum(r.output_tokens for r in records if r.ok)
            chunks = sum(len(r.chunks) for r in records if r.ok)
            print(f"{'direct' if args.direct else 'asgi'}: {1e6 * api / tokens:.2f} us API CPU a token, {tokens} tokens, "
                  f"{tokens / chunks:.2f} a chunk, {sum(not r.ok for r in records)} failed", flush=True)
    finally:
        server.terminate()
        server.wait()


if __name__ == "__main__":
    main()
