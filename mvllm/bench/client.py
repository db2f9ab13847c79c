"""The async streaming client: open-loop replay against an OpenAI-compatible /v1/completions.

Each request is sent at its scheduled time on the clock (no request waits for an earlier one),
every received chunk is stamped before it is parsed, and a failing request is recorded as failed
while the others go on. One process runs `replay`; bench/loadgen.py spreads a load over several.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable

import httpx

from mvllm.bench.health import Health
from mvllm.bench.http import Exchange, Pool, ProtocolError, ResponseParser
from mvllm.bench.metrics import RequestRecord
from mvllm.bench.workload import Request, full_prompt, reply_tokens
from mvllm.errors import MvllmError


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


try:
    from orjson import dumps, loads
except ImportError:  # the stdlib's, where orjson is not installed
    def dumps(obj) -> bytes:
        return json.dumps(obj).encode()

    loads = json.loads


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
            rec.chunk_tokens.append(n)
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


class Cut(Exception):
    """The client stops reading: a hidden length reached (stop = "disconnect"), or an error chunk."""


async def send(pool: Pool, model: str | None, req: Request, t0: float, rec: RequestRecord,
               prompt: list[int] | None = None, stop: str = "field", reply: list[int] | None = None,
               timeout: float = 600.0) -> None:
    """One request, sent at rec.arrival (seconds after t0). `prompt`: the tokens to send (a follow-up turn's
    whole prompt); `reply` receives the token ids the server streams back. stop = "disconnect": a hidden-length
    request is read up to its true length and the connection closed (finish_reason "disconnect"). Every read
    is stamped on receipt, before its chunks are parsed; `timeout`: the most seconds between two reads."""
    delay = t0 + rec.arrival - time.perf_counter()
    if delay > 0:
        await asyncio.sleep(delay)
    rec.sent = time.perf_counter() - t0
    rec.max_tokens, rec.target_tokens, rec.parent = req.cap, req.output_tokens, req.parent
    reply = [] if reply is None else reply
    cut = req.output_tokens if (not req.told and stop == "disconnect") else None
    body = pool.request("/v1/completions", dumps(payload(model, req, prompt, stop)))
    state = {"stamp": 0.0, "got": 0, "done": False, "usage": False}

    def on_read(stamp: float) -> None:
        state["stamp"] = stamp - t0

    def on_data(data: bytes) -> None:
        if data == b"[DONE]":
            state["done"] = True
            return
        chunk = loads(data)
        if "error" in chunk:
            err = chunk["error"]
            rec.error = f"server error: {err.get('message', err) if isinstance(err, dict) else err}"
            raise Cut
        state["got"] += _take(rec, chunk, state["stamp"], reply)
        state["usage"] = state["usage"] or bool(chunk.get("usage"))
        if cut is not None and state["got"] >= cut:
            raise Cut

    try:
        parser = await _exchange(pool, body, on_data, on_read, timeout)
        rec.backend = rec.backend or parser.headers.get("x-mvllm-backend", "")
        if parser.status != 200:
            rec.error = _error_text(parser.status, bytes(parser.body))
        elif not state["done"]:
            rec.error = "the stream ended before data: [DONE]"
        elif rec.first_token is None:
            rec.error = "the stream carried no tokens"
    except Cut:
        if not rec.error:  # the hidden length reached: leaving closed the connection
            state["usage"], rec.finish_reason, rec.output_tokens = True, "disconnect", cut
            del reply[cut:]
    except (OSError, ProtocolError, ValueError, asyncio.TimeoutError) as e:
        rec.error = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
    finally:
        if not rec.backend and not rec.error:
            rec.backend = "server"  # a server that does not say which backend served the request
        if rec.chunks:
            rec.finish = rec.chunks[-1]
            if not state["usage"]:
                rec.output_tokens = sum(rec.chunk_tokens)
        if rec.error:
            rec.finish = rec.finish if rec.finish is not None else time.perf_counter() - t0


async def _exchange(pool: Pool, request: bytes, on_data, on_read, timeout: float) -> ResponseParser:
    """Send on a kept-alive connection (once more on a new one if the kept one was closed before any reply)
    and wait for the whole response."""
    for attempt in (0, 1):
        ex = await pool.get()
        reused = ex.idle_since > 0
        ex.start(request, on_data, on_read)
        try:
            parser = await _wait(ex, timeout)
        except (OSError, ProtocolError):
            ex.close()
            if reused and ex.reads == 0 and attempt == 0:
                continue
            raise
        except BaseException:
            ex.close()
            raise
        pool.put(ex, parser.reusable)
        return parser
    raise ProtocolError("unreachable")


async def _wait(ex: Exchange, timeout: float) -> ResponseParser:
    """The response, once whole; a gap of `timeout` s with no read ends it."""
    while True:
        left = ex.last_read + timeout - time.perf_counter()
        if left <= 0:
            raise asyncio.TimeoutError(f"no data from the server for {timeout:g} s")
        try:
            return await asyncio.wait_for(asyncio.shield(ex.ended), left)
        except asyncio.TimeoutError:
            if ex.ended.done():
                return ex.ended.result()


async def replay(url: str, model: str | None, requests: list[Request], timeout: float,
                 on_done: Callable[[RequestRecord], None] | None = None, stop: str = "field",
                 vocab: int = 32000, t0: float | None = None, health: Health | None = None,
                 ) -> tuple[list[RequestRecord], float, float]:
    """Replay `requests` open loop in this process; returns the records, the replay's wall time in seconds,
    and the wall-clock time (time.time()) of its start, to line client times up with the server's logs. A
    follow-up turn waits for its parent's reply, then its think time; its prompt is the parent's whole
    prompt, the reply (the ids the server streamed, else the stand-in of its length) and its own tokens. A
    turn whose parent failed fails too. `t0`: the start on time.perf_counter's clock (a later one waits);
    `health` collects the client's own lag and CPU. A load of several processes: bench/loadgen.py."""
    records = {r.id: RequestRecord(r.id, r.arrival, prompt_tokens=len(r.prompt)) for r in requests}
    ended = {r.id: asyncio.Event() for r in requests}
    prompts: dict[int, list[int]] = {}
    replies: dict[int, list[int]] = {}
    pool = Pool(url)
    if t0 is not None and t0 > time.perf_counter():
        await asyncio.sleep(t0 - time.perf_counter())
    t0 = time.perf_counter() if t0 is None else t0
    t0_wall = time.time() - (time.perf_counter() - t0)
    watch = (health or Health()).watch()

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
            await send(pool, model, req, t0, rec, prompts[req.id], stop, replies[req.id], timeout)
        finally:
            ended[req.id].set()
        if on_done is not None:
            on_done(rec)

    try:
        await asyncio.gather(*(one(r) for r in requests))
    finally:
        pool.close()
        watch.cancel()
    duration = time.perf_counter() - t0
    return [records[r.id] for r in requests], duration, t0_wall


def check_reachable(url: str) -> None:
    """One clear line, before anything runs, for a server that does not answer."""
    try:
        httpx.get(f"{url}/v1/models", timeout=10.0)
    except httpx.HTTPError as e:
        raise MvllmError(f"cannot reach the server at {url}: {type(e).__name__}"
                         f"{': ' + str(e) if str(e) else ''}") from None


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
