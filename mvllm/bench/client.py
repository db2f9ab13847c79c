"""The async streaming client: open-loop replay against an OpenAI-compatible /v1/completions.

Each request is sent at its scheduled time on the clock (no request waits for an earlier one),
every received chunk is stamped before it is parsed, and a failing request is recorded as failed
while the others go on.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable

import httpx

from mvllm.bench.metrics import RequestRecord
from mvllm.bench.workload import Request


def payload(model: str | None, req: Request) -> dict:
    body = {"prompt": req.prompt, "max_tokens": req.output_tokens, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    if model:
        body["model"] = model
    return body


def _error_text(status: int, body: bytes) -> str:
    try:
        msg = json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        msg = body.decode(errors="replace").strip()[:200]
    return f"HTTP {status}: {msg}"


def _has_tokens(choice: dict) -> bool:
    """mvllm sends token_ids with every chunk and closes with an empty chunk that only carries the
    finish reason; other servers' chunks carry text (vLLM's bench counts every choice chunk)."""
    if "token_ids" in choice and choice["token_ids"] is not None:
        return bool(choice["token_ids"])
    delta = choice.get("delta") or {}
    return bool(choice.get("text") or delta.get("content")) or choice.get("finish_reason") is None


def _take(rec: RequestRecord, data: dict, stamp: float) -> None:
    if not rec.backend and isinstance(data.get("backend"), str):
        rec.backend = data["backend"]
    if data.get("choices") and _has_tokens(data["choices"][0]):
        if rec.first_token is None:
            rec.first_token = stamp
        rec.chunks.append(stamp)
    usage = data.get("usage")
    if usage:
        rec.prompt_tokens = usage.get("prompt_tokens") or rec.prompt_tokens
        rec.output_tokens = usage.get("completion_tokens") or 0
        details = usage.get("prompt_tokens_details") or {}
        if details.get("cached_tokens") is not None:
            rec.cached_tokens = details["cached_tokens"]


async def send(http: httpx.AsyncClient, url: str, model: str | None, req: Request, t0: float,
               rec: RequestRecord) -> None:
    delay = t0 + req.arrival - time.perf_counter()
    if delay > 0:
        await asyncio.sleep(delay)
    rec.sent = time.perf_counter() - t0
    done = usage = False
    try:
        async with http.stream("POST", f"{url}/v1/completions", json=payload(model, req)) as resp:
            rec.backend = resp.headers.get("x-mvllm-backend", "")
            if resp.status_code != 200:
                rec.error = _error_text(resp.status_code, await resp.aread())
                return
            buf = b""
            async for piece in resp.aiter_bytes():
                stamp = time.perf_counter() - t0
                buf += piece
                *lines, buf = buf.split(b"\n")
                for line in lines:
                    line = line.strip()
                    if not line.startswith(b"data:"):
                        continue
                    body = line[5:].strip()
                    if body == b"[DONE]":
                        done = True
                        continue
                    data = json.loads(body)
                    if "error" in data:
                        rec.error = f"server error: {data['error'].get('message', data['error'])}"
                        return
                    _take(rec, data, stamp)
                    usage = usage or bool(data.get("usage"))
        if not done:
            rec.error = "the stream ended before data: [DONE]"
        elif rec.first_token is None:
            rec.error = "the stream carried no tokens"
    except (httpx.HTTPError, OSError, ValueError) as e:
        rec.error = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
    finally:
        if not rec.backend and not rec.error:
            rec.backend = "server"  # a server that does not say which backend served the request
        if rec.chunks:
            rec.finish = rec.chunks[-1]
            if not usage:
                rec.output_tokens = len(rec.chunks)
        if rec.error:
            rec.finish = rec.finish if rec.finish is not None else time.perf_counter() - t0


async def replay(url: str, model: str | None, requests: list[Request], timeout: float,
                 on_done: Callable[[RequestRecord], None] | None = None) -> tuple[list[RequestRecord], float, float]:
    """Replay `requests` open loop; returns the records, the replay's wall time in seconds, and the
    wall-clock time (time.time()) of its start, to line client times up with the server's logs."""
    records = [RequestRecord(r.id, r.arrival, prompt_tokens=len(r.prompt)) for r in requests]
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout, connect=30.0), limits=limits) as http:
        t0, t0_wall = time.perf_counter(), time.time()

        async def one(req: Request, rec: RequestRecord) -> None:
            await send(http, url, model, req, t0, rec)
            if on_done is not None:
                on_done(rec)

        await asyncio.gather(*(one(r, rec) for r, rec in zip(requests, records, strict=True)))
        duration = time.perf_counter() - t0
    return records, duration, t0_wall


def served_model(url: str) -> str | None:
    """The first model id an OpenAI-compatible server lists, or None where it lists none."""
    try:
        r = httpx.get(f"{url}/v1/models", timeout=10.0)
        if r.status_code == 200:
            data = r.json().get("data") or []
            return data[0].get("id") if data else None
    except (httpx.HTTPError, ValueError, AttributeError):
        pass
    return None
