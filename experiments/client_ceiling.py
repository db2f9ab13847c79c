"""The benchmark client's ceiling against its predecessor, in one run: the same stub server, the same burst.

    python experiments/client_ceiling.py [--streams 256] [--tokens 256] [--workers 1,2] --out FILE

The peer is the single-process client bench used before (httpx streaming, json.loads per chunk, one asyncio
loop); then today's client (bench/loadgen.py) at each worker count. Streamed tokens/s each, and the ratio to
the peer.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402

from mvllm.bench.loadgen import generate  # noqa: E402
from mvllm.bench.request import Request  # noqa: E402
from mvllm.bench.stub import MODEL, StubServer  # noqa: E402


async def httpx_peer(url: str, streams: int, tokens: int) -> float:
    """Tokens/s read by one process on httpx, parsing every chunk with json.loads (the old client's loop)."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    got = 0

    async def one(http: httpx.AsyncClient) -> None:
        nonlocal got
        body = {"model": MODEL, "prompt": [1, 2, 3, 4], "max_tokens": tokens, "stream": True}
        async with http.stream("POST", f"{url}/v1/completions", json=body) as resp:
            buf = b""
            async for piece in resp.aiter_bytes():
                time.perf_counter()  # the stamp each read took
                buf += piece
                *lines, buf = buf.split(b"\n")
                for line in lines:
                    line = line.strip()
                    if line.startswith(b"data:") and line[5:].strip() != b"[DONE]":
                        data = json.loads(line[5:])
                        if data.get("choices"):
                            got += len(data["choices"][0].get("token_ids") or [])

    async with httpx.AsyncClient(timeout=60.0, limits=limits) as http:
        t0 = time.perf_counter()
        await asyncio.gather(*(one(http) for _ in range(streams)))
        return got / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--workers", default="1,2")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    reqs = [Request(i, [1, 2, 3, 4], args.tokens, 0.0) for i in range(args.streams)]
    result = {"command": " ".join(["python", *sys.argv]), "cores": os.cpu_count(), "streams": args.streams,
              "tokens": args.tokens}
    with StubServer() as stub:
        result["httpx_one_process"] = asyncio.run(httpx_peer(stub.url, args.streams, args.tokens))
        for w in (int(x) for x in args.workers.split(",")):
            records, duration, _, _ = generate(stub.url, MODEL, reqs, 60.0, w)
            tps = sum(r.output_tokens for r in records if r.ok) / duration
            result[f"loadgen_{w}_workers"] = tps
            result[f"loadgen_{w}_workers_over_httpx"] = tps / result["httpx_one_process"]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
