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
from mvllm.bench.workload import Request, full_prompt, reply_tokens


def payload(model: str | None, req: Request, prompt: list[int] | None = None, stop: str = "field") -> dict:
    """What a client sends. Lengths told (the reference): max_tokens = the length. Hidden: the workload's cap
    (or none), and the true length only as `benchmark_length` (stop = "field", mvllm servers: the engine ends
    the sequence there; nothing that routes reads it); with stop = "disconnect" the client stops reading there.
    EOS is ignored either way, so every request ends at the workload's length."""
    body = {"prompt": req.prompt if prompt is None else prompt, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    if req.cap is not None:
        body["max_tokens"] = req.cap
    if not req.told and stop == "field":
        body["benchmark_length"] = req.output_tokens
    if model:
        body["model"] = model
    return body


def _error_text(status: int, body: bytes) -> str:
    try:
        msg = json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        msg = body.decode(errors="replace").strip()[:200]
    return f"HTTP {status}: {msg}"


def _tokens_in(choice: dict) -> int:
    """Tokens a chunk carries: mvllm sends token_ids with every chunk and closes with an empty chunk that only
    carries the finish reason; other servers' chunks carry text, one token each (vLLM's bench counts every
    choice chunk)."""
    if "token_ids" in choice and choice["token_ids"] is not None:
        return len(choice["token_ids"])
    delta = choice.get("delta") or {}
    return int(bool(choice.get("text") or delta.get("content")) or choice.get("finish_reason") is None)


def _take(rec: RequestRecord, data: dict, stamp: float, reply: list[int]) -> int:
    """Record one chunk; returns the tokens it carried."""
    if not rec.backend and isinstance(data.get("backend"), str):
        rec.backend = data["backend"]
    n = 0
    if data.get("choices"):
        choice = data["choices"][0]
        n = _tokens_in(choice)
        if n:
            if rec.first_token is None:
                rec.first_token = stamp
            rec.chunks.append(stamp)
            reply.extend(choice.get("token_ids") or [])
        rec.finish_reason = choice.get("finish_reason") or rec.finish_reason
    usage = data.get("usage")
    if usage:
        rec.prompt_tokens = usage.get("prompt_tokens") or rec.prompt_tokens
        rec.output_tokens = usage.get("completion_tokens") or 0
        details = usage.get("prompt_tokens_details") or {}
        if details.get("cached_tokens") is not None:
            rec.cached_tokens = details["cached_tokens"]
    return n


async def send(http: httpx.AsyncClient, url: str, model: str | None, req: Request, t0: float,
               rec: RequestRecord, prompt: list[int] | None = None, stop: str = "field",
               reply: list[int] | None = None) -> None:
    """One request, sent at rec.arrival (seconds after t0). `prompt`: the tokens to send (a follow-up turn's
    whole prompt); `reply` receives the token ids the server streams back. stop = "disconnect": a hidden-length
    request is read up to its true length and the connection closed (finish_reason "disconnect")."""
    delay = t0 + rec.arrival - time.perf_counter()
    if delay > 0:
        await asyncio.sleep(delay)
    rec.sent = time.perf_counter() - t0
    rec.max_tokens, rec.target_tokens, rec.parent = req.cap, req.output_tokens, req.parent
    reply = [] if reply is None else reply
    cut = req.output_tokens if (not req.told and stop == "disconnect") else None
    done = usage = False
    got = 0
    try:
        async with http.stream("POST", f"{url}/v1/completions", json=payload(model, req, prompt, stop)) as resp:
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
                    got += _take(rec, data, stamp, reply)
                    usage = usage or bool(data.get("usage"))
                    if cut is not None and got >= cut:
                        break
                if cut is not None and got >= cut:  # leaving the block closes the connection
                    done, usage, rec.finish_reason, rec.output_tokens = True, True, "disconnect", cut
                    del reply[cut:]
                    break
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
                 on_done: Callable[[RequestRecord], None] | None = None, stop: str = "field",
                 vocab: int = 32000) -> tuple[list[RequestRecord], float, float]:
    """Replay `requests` open loop; returns the records, the replay's wall time in seconds, and the
    wall-clock time (time.time()) of its start, to line client times up with the server's logs. A follow-up
    turn waits for its parent's reply, then its think time; its prompt is the parent's whole prompt, the reply
    (the ids the server streamed, else the stand-in of its length) and its own tokens. A turn whose parent
    failed fails too."""
    records = {r.id: RequestRecord(r.id, r.arrival, prompt_tokens=len(r.prompt)) for r in requests}
    ended = {r.id: asyncio.Event() for r in requests}
    prompts: dict[int, list[int]] = {}
    replies: dict[int, list[int]] = {}
    # an idle connection is dropped after 2 s, before a server's keep-alive ends (uvicorn's default: 5 s): a
    # request sent on a connection the server is closing fails with ReadError (one did on the H200 trace runs)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None, keepalive_expiry=2.0)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout, connect=30.0), limits=limits) as http:
        t0, t0_wall = time.perf_counter(), time.time()

        async def one(req: Request) -> None:
            rec = records[req.id]
            try:
                if req.parent is not None:
                    await ended[req.parent].wait()
                    parent = records[req.parent]
                    if not parent.ok:
                        rec.arrival = rec.finish = time.perf_counter() - t0
                        rec.error = f"its parent request {req.parent} failed"
                        return
                    reply = replies.get(req.parent) or []
                    if len(reply) != parent.output_tokens:  # a server that streams text: the stand-in reply
                        reply = reply_tokens(req.parent, parent.output_tokens, vocab)
                    rec.arrival = parent.finish + req.arrival
                    prompts[req.id] = full_prompt(req, prompts[req.parent], reply)
                else:
                    prompts[req.id] = req.prompt
                rec.prompt_tokens = len(prompts[req.id])
                replies[req.id] = []
                await send(http, url, model, req, t0, rec, prompts[req.id], stop, replies[req.id])
            finally:
                ended[req.id].set()
            if on_done is not None:
                on_done(rec)

        await asyncio.gather(*(one(r) for r in requests))
        duration = time.perf_counter() - t0
    return [records[r.id] for r in requests], duration, t0_wall


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
