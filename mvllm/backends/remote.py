"""A backend that is another OpenAI-compatible server (another `mvllm serve`, vLLM, SGLang, llama.cpp's
server), reached over HTTP. It is a `Backend` (base.py) as ProcessBackend is, sending the same events
(events.py), so the Cluster and the Router never know which they hold.

Each request goes to the remote's /v1/completions as token ids, streamed, and every chunk's tokens are
passed on as they arrive: the ids the remote sends (`token_ids`, or llama.cpp's `tokens`), else its text
tokenized by the router's own tokenizer (a text-only server: llama.cpp's /v1/completions, SGLang; see
relay.py), and /health shows which ("relay": "token_ids" or "text"). Cached prefixes come from a shadow
index of what was sent there (shadow.py); load is the router's own bookings, and for an mvllm remote also
the requests its /v1/backends shows that came from elsewhere (Load events). A request that fails before
its first token is re-routed by the Cluster; a failure triggers a health probe, and a failed probe marks
the remote down, to be probed again with back-off.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Awaitable, Callable

import httpx

from mvllm.backends.base import OnEvent, spawn
from mvllm.backends.events import BackendEvent, Dead, Done, Error, Load, Lost, Method, Scheduled, Step, Up
from mvllm.backends.relay import TextIds, chunk_ids, completion_body, load_text_ids, remote_message
from mvllm.backends.shadow import ShadowIndex
from mvllm.backends.spec import BackendSpec
from mvllm.engine.block_manager import BLOCK_SIZE
from mvllm.engine.params import SamplingParams
from mvllm.errors import MvllmError

DEFAULT_BLOCKS = 4096  # shadow index size when the remote does not report its KV cache
POLL_S = 1.0
BACKOFF_S = (0.5, 30.0)


class RemoteError(MvllmError):
    pass


class RemoteRefused(RemoteError):
    """The remote answers, but not as a server we can use (credentials, model, protocol): waiting won't help."""


class RemoteBackend:
    def __init__(self, spec: BackendSpec, model: str):
        self.spec, self.name, self.model_spec = spec, spec.name, model
        self.base = spec.device.removesuffix("/").removesuffix("/v1")
        self.model = spec.model
        self.alive = False
        self.info: dict = {}
        self.mvllm = False
        self.relay: str | None = None  # "token_ids" or "text", once a chunk with text has come
        self.text_ids: TextIds | None = None
        self.text_tokens = {"remote": 0, "relayed": 0}  # completion tokens of text-relayed requests
        self.shadow = ShadowIndex(spec.num_blocks or DEFAULT_BLOCKS)
        self.tasks: dict[str, asyncio.Task] = {}
        self.started: set[str] = set()
        self.finished = self.hits = 0
        self.remote_load: dict = {}
        self.down_since: float | None = None
        self.last_error: str | None = None
        self.next_probe: float | None = None
        self.closed = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._on_event: OnEvent | None = None
        self._client: httpx.AsyncClient | None = None
        self._probing: asyncio.Task | None = None
        self._background: set[asyncio.Task] = set()
        # what `call` answers: at once from what is known here, or by asking the remote
        self._answers: dict[str, Callable[..., object]] = {
            "cached_prefix_len": self._cached_prefix_len, "snapshot": self._snapshot}
        self._requests: dict[str, Callable[..., Awaitable[object]]] = {
            "warm": self._warm, "reset_prefix_cache": self._reset_prefix_cache}

    def headers(self) -> dict[str, str]:
        env = self.spec.api_key_env
        return {"Authorization": f"Bearer {os.environ[env]}"} if env and os.environ.get(env) else {}

    def timeout(self) -> httpx.Timeout:
        return httpx.Timeout(self.spec.timeout, connect=5.0)

    # start-up (blocking, before the event loop runs)

    def wait_ready(self, timeout: float) -> None:
        """Wait until the remote answers /v1/models, learn the model it serves, its context length and,
        from an mvllm remote, its KV cache size."""
        deadline, why = time.monotonic() + timeout, "no answer"
        with httpx.Client(base_url=self.base, headers=self.headers(), timeout=self.timeout()) as client:
            while True:
                try:
                    self._discover(client.get("/v1/models"), client.get("/v1/backends"))
                    if not self.mvllm:  # it may stream text only: load the tokenizer now, not in the event loop
                        self.text_ids = load_text_ids(self.model_spec)
                    self.alive = True
                    return
                except httpx.HTTPError as e:
                    why = f"{type(e).__name__}"
                except RemoteRefused:
                    raise
                except RemoteError as e:
                    why = str(e)
                if time.monotonic() > deadline:
                    raise RemoteError(f"backend {self.name}: {self.base} did not answer within {timeout:g} s "
                                      f"({why})")
                time.sleep(0.5)

    def _discover(self, models: httpx.Response, backends: httpx.Response | None) -> None:
        if models.status_code in (401, 403):
            raise RemoteRefused(f"backend {self.name}: {self.base} refused the credentials "
                              f"({remote_message(models)}); set api_key_env=VAR")
        if models.status_code == 404:
            raise RemoteRefused(f"backend {self.name}: {self.base} has no /v1/models; is it an "
                              "OpenAI-compatible server?")
        if models.status_code != 200:
            raise RemoteError(remote_message(models))
        try:
            served = [m for m in models.json()["data"] if isinstance(m, dict) and "id" in m]
        except (ValueError, KeyError, TypeError):
            raise RemoteRefused(f"backend {self.name}: {self.base}/v1/models is not an OpenAI model "
                              "list") from None
        ids = [m["id"] for m in served]
        if self.model is None and ids:
            self.model = ids[0]
        if self.model not in ids:
            raise RemoteRefused(f"backend {self.name}: {self.base} serves {', '.join(ids) or 'no model'}, "
                              f"not {self.model!r}; set model=NAME")
        entry = served[ids.index(self.model)]
        self.info = {"name": self.name, "device": self.spec.device, "remote_model": self.model,
                     "max_active": self.spec.max_active, "max_model_len": entry.get("max_model_len"),
                     "block_size": self.shadow.block_size, "num_blocks": self.shadow.capacity, "pid": None,
                     "mvllm": False, "relay": self.relay}
        self._read_backends(backends)
        self.info.update(self.load())

    def _read_backends(self, response: httpx.Response | None) -> None:
        """An mvllm remote lists its backends: their KV sizes bound the shadow index, their load refines ours."""
        try:
            rows = response.json() if response is not None and response.status_code == 200 else None
        except ValueError:
            rows = None
        if not (isinstance(rows, list) and rows and all(isinstance(r, dict) and "num_blocks" in r for r in rows)):
            return
        self.mvllm = self.info["mvllm"] = True
        live = [r for r in rows if r.get("alive", True)]
        if self.spec.num_blocks is None:
            self.shadow.resize(sum(int(r["num_blocks"]) for r in rows), int(rows[0].get("block_size", BLOCK_SIZE)))
            self.info.update(num_blocks=self.shadow.capacity, block_size=self.shadow.block_size)
        self.remote_load = {"running": sum(r.get("running", 0) for r in live),
                            "waiting": sum(r.get("waiting", 0) for r in live),
                            "kv_usage": max((r.get("kv_usage", 0.0) for r in live), default=0.0)}

    # the transport

    def listen(self, loop: asyncio.AbstractEventLoop, on_event: OnEvent) -> None:
        self._loop, self._on_event = loop, on_event
        self._client = httpx.AsyncClient(base_url=self.base, headers=self.headers(), timeout=self.timeout(),
                                         limits=httpx.Limits(max_connections=None, max_keepalive_connections=64))
        spawn(self._background, self._poll(), f"poll {self.name}", loop)

    def emit(self, event: BackendEvent) -> None:
        if self._loop is not None and not self.closed:
            self._loop.call_soon(self._on_event, self.name, event)

    def load(self) -> dict:
        """Our own view (requests in flight here), replaced by the remote's where an mvllm remote reports it."""
        own = {"running": len(self.started), "waiting": len(self.tasks) - len(self.started),
               "free_blocks": self.shadow.capacity - len(self.shadow.blocks), "kv_usage": round(self.shadow.usage(), 4),
               "prefix_queries": self.finished, "prefix_hits": self.hits, "preemptions": 0}
        return own | self.remote_load

    def submit(self, request_id: str, token_ids: list[int], params: SamplingParams, arrival: float) -> None:
        if not self.alive or self._loop is None:
            raise MvllmError(f"backend {self.name} is down")
        self.tasks[request_id] = self._loop.create_task(self._stream(request_id, token_ids, params))

    def abort(self, request_id: str) -> None:
        """Close the request's connection: the remote sees the client go and aborts it."""
        task = self.tasks.pop(request_id, None)
        self.started.discard(request_id)
        if task is not None:
            task.cancel()

    def _ids(self, chunk: dict, choice: dict, first: bool) -> tuple[list[int], bool]:
        """The choice's token ids, and whether they come from its text (RemoteRefused: they can't)."""
        ids, text = chunk_ids(chunk, choice), choice.get("text")
        if ids:
            self.relay = self.info["relay"] = "token_ids"
        if ids is not None or not (text and isinstance(text, str)):
            return ids or [], False
        self.relay = self.info["relay"] = "text"
        if self.text_ids is None:
            self.text_ids = load_text_ids(self.model_spec)
        if self.text_ids is None:
            raise RemoteRefused(f"backend {self.name} sends text without token ids, and model {self.model_spec} "
                                "has no tokenizer to turn it into ids (vLLM sends ids when asked)")
        return self.text_ids.encode(text, first), True

    async def _stream(self, rid: str, token_ids: list[int], params: SamplingParams) -> None:
        out: list[int] = []
        reason = cached = remote_tokens = None
        by_text = False
        try:
            async with self._client.stream("POST", "/v1/completions", json=completion_body(
                    self.model, token_ids, params)) as r:
                if r.status_code != 200:
                    await r.aread()
                    if r.status_code >= 500 or r.status_code in (408, 429):
                        raise RemoteError(remote_message(r))
                    self.emit(Error(rid, f"backend {self.name}: {remote_message(r)}"))
                    return
                async for line in r.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    chunk = json.loads(data)
                    if isinstance(chunk.get("error"), dict):
                        self.emit(Error(rid, f"backend {self.name}: {chunk['error'].get('message')}"))
                        return
                    for choice in chunk.get("choices") or []:
                        try:
                            ids, text = self._ids(chunk, choice, first=not out)
                        except RemoteRefused as e:
                            self.emit(Error(rid, str(e)))
                            return
                        by_text = by_text or text
                        if params.stop_at is not None:
                            ids = ids[:max(params.stop_at - len(out), 0)]
                        if ids and not out:
                            self.started.add(rid)
                            self.shadow.add(token_ids)
                        out += ids
                        if ids:
                            self.emit(Step([(rid, t, None) for t in ids], self.load()))
                        reason = choice.get("finish_reason") or reason
                    usage = chunk.get("usage") or {}
                    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", cached)
                    remote_tokens = usage.get("completion_tokens", remote_tokens)
                    if params.stop_at is not None and len(out) >= params.stop_at:
                        # a server that ignores benchmark_length: stop reading (closing frees its slot)
                        reason = "stop"
                        break
            if reason is None:
                raise RemoteError("the stream ended before its last chunk")
        except asyncio.CancelledError:
            raise
        except (httpx.HTTPError, RemoteError, ValueError) as e:
            why = str(e) if isinstance(e, RemoteError) else f"{type(e).__name__}"
            self.tasks.pop(rid, None)
            self.started.discard(rid)
            await self._failed(rid, why)
            return
        finally:
            if self.tasks.get(rid) is asyncio.current_task():
                del self.tasks[rid]
            self.started.discard(rid)
        self.shadow.add(token_ids + out)
        if by_text and isinstance(remote_tokens, int):
            self.text_tokens["remote"] += remote_tokens
            self.text_tokens["relayed"] += len(out)
        self.finished += 1
        self.hits += bool(cached)
        if cached is not None:
            self.emit(Scheduled([(rid, int(cached))]))
        self.emit(Done(rid, reason))

    async def _failed(self, rid: str, why: str) -> None:
        """A request failed on the way: probe the remote; down, it is marked down (the Cluster re-routes what
        had not started); up, only this request failed (re-routed if it had not started)."""
        self.last_error = why
        if not await self.probe():
            self.go_down(why)
        elif self.alive:
            self.emit(Lost(rid, f"backend {self.name} failed: {why}"))

    def go_down(self, why: str) -> None:
        if self.alive:
            self.alive, self.last_error = False, why
            self.emit(Dead())

    async def probe(self) -> bool:
        """One health probe at a time, shared by every request that failed meanwhile."""
        if self._probing is None or self._probing.done():
            self._probing = asyncio.ensure_future(self._probe_once())
        return await asyncio.shield(self._probing)

    async def _probe_once(self) -> bool:
        try:
            r = await self._client.get("/health", timeout=3.0)
            if r.status_code == 404:
                r = await self._client.get("/v1/models", timeout=3.0)
            if r.status_code == 200:
                return True
            body = r.json() if r.status_code == 503 else {}
            states = body.get("backends", {}) if isinstance(body, dict) else {}
            return body.get("status") == "degraded" and any(s.get("alive") for s in states.values())
        except (httpx.HTTPError, ValueError, AttributeError):
            return False

    def mark_dead(self) -> None:
        """Drop every request in flight (the Cluster has ended or re-routed them) and probe with back-off."""
        self.alive = False
        self.down_since = self.down_since or time.time()
        for task in self.tasks.values():
            task.cancel()
        self.tasks.clear()
        self.started.clear()
        if self._loop is not None and not self.closed:
            spawn(self._background, self._recover(), f"recover {self.name}", self._loop)

    async def _recover(self) -> None:
        delay = BACKOFF_S[0]
        while not self.closed:
            self.next_probe = time.time() + delay
            await asyncio.sleep(delay)
            if await self.probe():
                try:
                    self._discover(await self._client.get("/v1/models"), await self._client.get("/v1/backends"))
                except (httpx.HTTPError, RemoteError):
                    delay = min(2 * delay, BACKOFF_S[1])
                    continue
                self.shadow.clear()  # it may have restarted with an empty cache
                self.alive, self.down_since, self.next_probe = True, None, None
                self.emit(Up(self.info))
                return
            delay = min(2 * delay, BACKOFF_S[1])

    async def _poll(self) -> None:
        """Every second: an mvllm remote's /v1/backends (its load from other clients), else a health probe
        every 5 s; a remote that stopped answering is marked down before a request finds out."""
        tick = 0
        while not self.closed:
            await asyncio.sleep(POLL_S)
            tick += 1
            if not self.alive:
                continue
            if self.mvllm:
                try:
                    r = await self._client.get("/v1/backends", timeout=3.0)
                    if r.status_code == 200:
                        self._read_backends(r)
                        own = len(self.tasks)
                        external = max(0, self.remote_load["running"] + self.remote_load["waiting"] - own)
                        self.emit(Load(self.load(), external))
                        continue
                except httpx.HTTPError:
                    pass
            elif tick % 5:
                continue
            if not await self.probe():
                self.go_down("the health probe failed")

    async def call(self, method: Method, *args, timeout: float = 600.0):
        if not self.alive:
            raise MvllmError(f"backend {self.name} is down")
        if method in self._answers:
            return self._answers[method](*args)
        if method not in self._requests:
            raise MvllmError(f"backend {self.name} has no call {method!r}")
        try:
            return await asyncio.wait_for(self._requests[method](*args), timeout)
        except httpx.HTTPError as e:
            raise MvllmError(f"backend {self.name}: {method} failed: {type(e).__name__}") from None

    def _cached_prefix_len(self, token_ids: list[int]) -> int:
        return self.shadow.cached_prefix_len(token_ids)

    def _snapshot(self) -> dict:
        return dict(self.info, **self.load(), down_since=self.down_since)

    async def _warm(self, token_ids: list[int]) -> int:
        """mvllm: its /v1/warm; any other server: a one-token completion, which leaves the prefix cached."""
        if self.mvllm:
            r = await self._client.post("/v1/warm", json={"prompt": token_ids})
            if r.status_code != 200:
                raise MvllmError(f"backend {self.name}: warming failed: {remote_message(r)}")
            done = max(r.json()["cached_tokens"].values(), default=0)
        else:
            body = completion_body(self.model, token_ids, SamplingParams(max_tokens=1, temperature=0.0)) | {
                "stream": False}
            body.pop("stream_options")
            r = await self._client.post("/v1/completions", json=body)
            if r.status_code != 200:
                raise MvllmError(f"backend {self.name}: warming failed: {remote_message(r)}")
            done = len(token_ids) // self.shadow.block_size * self.shadow.block_size
        self.shadow.add(token_ids)
        return done

    async def _reset_prefix_cache(self) -> bool:
        """The remote's /reset_prefix_cache (mvllm, vLLM); a server without one keeps its cache, unknown to us."""
        r = await self._client.post("/reset_prefix_cache")
        if r.status_code == 400:
            return False
        self.shadow.clear()
        return True

    def health(self) -> dict:
        out = {"url": self.spec.device, "model": self.model, "relay": self.relay}
        if self.relay == "text":  # the remote's completion tokens beside the ids its text was relayed as
            out["text_tokens"] = dict(self.text_tokens, mismatches=self.text_ids.mismatches if self.text_ids else 0)
        if not self.alive:
            out["down_since"] = self.down_since
            out["next_probe_in_s"] = round(max(0.0, (self.next_probe or time.time()) - time.time()), 2)
        if self.last_error:
            out["last_error"] = self.last_error
        return out

    def shutdown(self, timeout: float = 5.0) -> None:
        self.closed, self.alive = True, False
        for task in [*self.tasks.values(), *self._background]:
            task.cancel()
        self.tasks.clear()
