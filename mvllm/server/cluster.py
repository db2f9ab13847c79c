"""The backends behind the server: starts their workers, routes each request through the Router, and
turns backend events (mvllm.backends.events) into per-request streams."""

from __future__ import annotations

import asyncio
import itertools
import secrets
import time
from collections.abc import Callable, Coroutine
from typing import Any

from mvllm.backends.base import Backend, spawn
from mvllm.backends.events import (
    Aborted,
    BackendEvent,
    Dead,
    Done,
    Error,
    KvEvents,
    Load,
    Lost,
    Scheduled,
    Step,
    Up,
)
from mvllm.backends.process import ProcessBackend
from mvllm.backends.remote import RemoteBackend
from mvllm.backends.spec import BackendSpec
from mvllm.engine.block_manager import block_hashes
from mvllm.engine.params import SamplingParams
from mvllm.errors import MvllmError
from mvllm.routing.prefix_index import PrefixIndex
from mvllm.routing.router import Router
from mvllm.server.metrics import Metrics


def make_backend(spec: BackendSpec, model: str) -> Backend:
    """A worker process on this machine, or another server over HTTP: one Backend, two implementations."""
    return RemoteBackend(spec, model) if spec.remote else ProcessBackend(spec, model)


class ShuttingDownError(MvllmError):
    pass


class Stream:
    """A request's mailbox, one slot: the tokens its backend sent since its response last took them, and how the
    request ended. A response that falls behind its backend takes all its tokens at once, in one chunk. `push`,
    where its response sets one, is called once the steps that arrived together have been taken in: it may write
    their tokens at once."""

    __slots__ = ("tokens", "ended", "finish_reason", "error", "cached_tokens", "backend", "waiter", "push", "pushing")

    def __init__(self):
        self.tokens: list[int] = []
        self.ended = False
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.cached_tokens: int | None = None
        self.backend: str | None = None  # the request moved to this backend (its first one died before it began)
        self.waiter: asyncio.Future | None = None
        self.push: Callable[[], None] | None = None
        self.pushing = False  # a push is due (Cluster._push)

    def wake(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    def end(self, finish_reason: str | None = None, error: str | None = None) -> None:
        """The first end counts; tokens sent after it are dropped."""
        if not self.ended:
            self.ended, self.finish_reason, self.error = True, finish_reason, error
            self.wake()

    async def take(self) -> list[int]:
        """The tokens that arrived since the last take, once there is one or the request has ended."""
        while not self.tokens and not self.ended:
            self.waiter = asyncio.get_running_loop().create_future()
            try:
                await self.waiter
            finally:
                self.waiter = None
        tokens, self.tokens = self.tokens, []
        return tokens


class Pushes:
    """The streams with tokens to push once the messages already waiting on the loop are in: one callback writes
    them all (a server that lags its backend merges several steps' tokens into one event a stream)."""

    __slots__ = ("loop", "streams")

    def __init__(self):
        self.loop: asyncio.AbstractEventLoop | None = None
        self.streams: list[Stream] = []

    def add(self, stream: Stream) -> None:
        if not stream.pushing:
            if not self.streams:
                self.loop.call_soon(self.run)
            stream.pushing = True
            self.streams.append(stream)

    def run(self) -> None:
        streams, self.streams = self.streams, []
        for stream in streams:
            stream.pushing = False
            if stream.push is not None:
                stream.push()
            else:
                stream.wake()  # its response no longer pushes: its task takes the tokens


class Cluster:
    """restart: respawn a backend whose worker died, warm it with the prefixes warmed so far, and route to it
    again. A dead backend's requests that have not sent a token yet go to another backend by the policy."""

    def __init__(self, specs: list[BackendSpec], model: str, router: Router, restart: bool = False,
                 ready_timeout: float = 600.0):
        self.model, self.router, self.restart, self.ready_timeout = model, router, restart, ready_timeout
        self.backends: dict[str, Backend] = {s.name: make_backend(s, model) for s in specs}
        router.estimated = {s.name for s in specs if s.remote}  # their cached prefixes are shadow estimates
        self.index = PrefixIndex()  # the workers' cached blocks, from their KV events
        self.streams: dict[str, Stream] = {}
        self.owner: dict[str, str] = {}
        self.unstarted: dict[str, tuple[list[int], SamplingParams, float]] = {}  # no token sent yet
        self.snapshots: dict[str, dict] = {}
        self.metrics = Metrics(list(self.backends))
        self.restarts = {name: 0 for name in self.backends}
        self.restart_error: dict[str, str] = {}
        self.start_errors: dict[str, str] = {}  # backends that failed to start, left out
        self.warmed: list[list[int]] = []
        self.draining = False
        self.loop: asyncio.AbstractEventLoop | None = None
        self.tasks: set[asyncio.Task] = set()  # re-routes and restarts under way
        self.pushes = Pushes()
        self.id_base, self.ids = secrets.token_hex(4), itertools.count()  # request ids: 16 hex digits

    def wait_ready(self, timeout: float) -> None:
        """Wait for every backend. One that fails to start (its worker's error, or no answer within `timeout`)
        is stopped and left out: the server serves on the others, `start_errors` says why (in /health), and
        the router never chooses it. If none starts, every backend's error is raised."""
        for backend in self.backends.values():
            try:
                backend.wait_ready(timeout)
            except MvllmError as e:
                self.start_errors[backend.name] = str(e)
                backend.shutdown()
                self.router.on_dead(backend.name)
                continue
            self.snapshots[backend.name] = backend.info
        if len(self.start_errors) == len(self.backends):
            self.shutdown()
            raise MvllmError("no backend started: " + "; ".join(self.start_errors.values()))

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = self.pushes.loop = loop
        for backend in self.backends.values():
            if backend.name not in self.start_errors:
                backend.listen(loop, self._on_event)

    def serving(self, name: str) -> bool:
        """Up and routed to: a respawned worker counts only once it is warmed again and back in the router."""
        return self.backends[name].alive and self.router.alive[name]

    def healthy(self) -> bool:
        return all(self.serving(n) for n in self.backends)

    @property
    def backend_names(self) -> list[str]:
        return list(self.backends)

    async def health(self) -> tuple[int, dict]:
        """/health's status code and body."""
        states = {n: {"alive": self.serving(n), "restarts": self.restarts[n]} for n in self.backends}
        for n, b in self.backends.items():
            if b.spec.remote:
                states[n].update(b.health())
        for n, why in self.restart_error.items():
            states[n]["restart_error"] = why
        for n, why in self.start_errors.items():
            states[n]["start_error"] = why
        if not self.healthy():
            down = [n for n in self.backends if not self.serving(n)]
            return 503, {"status": "degraded", "down": down, "backends": states}
        return 200, {"status": "ok", "backends": states}

    async def render_metrics(self) -> bytes:
        return self.metrics.render()

    async def set_policy(self, policy: str, slo: dict | None) -> str:
        """Route new requests by another policy; the name it took."""
        self.router.set_policy(policy, slo)
        return self.router.policy.name

    def observe_request(self, backend: str, prompt: int, cached: int, generated: int, ttft: float | None,
                        e2e: float) -> None:
        self.metrics.observe_request(backend, prompt, cached, generated, ttft, e2e)

    def _spawn(self, coro: Coroutine[Any, Any, None], name: str) -> None:
        spawn(self.tasks, coro, name, self.loop)

    def _on_event(self, name: str, event: BackendEvent) -> None:
        match event:
            case Scheduled(admitted):
                for rid, cached in admitted:
                    self.router.on_scheduled(name, rid, cached)
                    if (stream := self.streams.get(rid)) is not None:
                        stream.cached_tokens = cached
                self.metrics.stale_cache.labels(name).set(self.router.stale[name])
            case Step(tokens, load, kv):
                if kv:
                    self.index.apply(name, *kv)
                if load.get("preemptions", 0) > self.snapshots[name].get("preemptions", 0):
                    self.router.on_preempted(name)
                self.snapshots[name].update(load)
                self.metrics.observe_snapshot(name, load)
                if tokens:
                    self._tokens(name, tokens)
            case KvEvents(stored, removed):  # a worker's cache changed outside a step: before the call's reply
                self.index.apply(name, stored, removed)
            case Error(rid, message):
                self._ended(name, rid, error=message)
            case Aborted(rid, generated, at):
                self.router.note({"aborted": rid, "backend": name, "generated": generated, "time": at})
                self._ended(name, rid, "abort")
            case Done(rid, reason):  # a remote's request ended after its last token
                self._done(name, rid, reason)
            case Lost(rid, why):  # a remote's request failed while the remote still answers its health probe
                self._lost(name, rid, why)
            case Load(load, external):  # an mvllm remote's load, with the requests it runs for other clients
                self.snapshots[name].update(load)
                self.metrics.observe_snapshot(name, load)
                self.router.set_external(name, external)
            case Up(snapshot):  # a remote that was down answers its probe again
                self.snapshots[name] = dict(snapshot)
                self.restarts[name] += 1
                self.metrics.restarts.labels(name).inc()
                self.metrics.backend_up.labels(name).set(1)
                self.router.revive(name)
            case Dead():
                self._dead(name)
            case _:
                raise TypeError(f"backend {name} sent {event!r}, which is no event")

    def _tokens(self, name: str, tokens: list[tuple[str, int, str | None]]) -> None:
        """One step's tokens, in one loop: each to its stream (a stream waiting for one wakes once; one that pushes
        does once the steps in hand are in), the router's bookkeeping in one call for the step."""
        streams, unstarted, ended, push = self.streams, self.unstarted, [], self.pushes.add
        for rid, token, reason in tokens:
            stream = streams.get(rid)
            if stream is not None and not stream.ended:
                stream.tokens.append(token)
                if stream.push is not None:
                    push(stream)
                elif not reason and stream.waiter is not None and not stream.waiter.done():
                    stream.waiter.set_result(None)
                if reason:
                    stream.end(reason)
            if reason:
                ended.append((rid, reason))
        if unstarted:
            for rid, _, _ in tokens:
                unstarted.pop(rid, None)
        self.router.on_step(name)
        self.router.on_step_tokens(name, [rid for rid, _, _ in tokens])
        for rid, reason in ended:
            self.router.on_finished(name, rid, reason)

    def _ended(self, name: str, rid: str, reason: str | None = None, error: str | None = None) -> None:
        self.unstarted.pop(rid, None)
        self.router.on_finished(name, rid, reason)
        self._end(rid, reason, error)

    def _dead(self, name: str) -> None:
        """A backend is gone: what had not started goes elsewhere, the rest ends; a worker is restarted."""
        self.backends[name].mark_dead()
        self.index.drop(name)
        self.metrics.backend_up.labels(name).set(0)
        for rid in self.router.on_dead(name):
            if rid in self.unstarted and rid in self.streams and not self.draining:
                self._spawn(self._reroute(rid, name), f"reroute {rid}")
            else:
                self.unstarted.pop(rid, None)
                self._end(rid, error=f"backend {name} stopped while serving this request")
        if self.restart and not self.draining and not self.backends[name].spec.remote:
            self._spawn(self._respawn(name), f"restart {name}")  # a remote comes back by itself: it probes

    def _done(self, name: str, rid: str, reason: str) -> None:
        booking = self.router.bookings[name].get(rid)
        if booking is not None and name in self.router.estimated:
            self.router.note({"request_id": rid, "time": time.time(), "event": "remote_cache", "backend": name,
                              "estimated_cached": booking.estimated_cached, "actual_cached": booking.actual_cached})
        self._ended(name, rid, reason)

    def _lost(self, name: str, rid: str, why: str) -> None:
        """One request failed on a backend that is still up: elsewhere if it had not started, else an error."""
        self.router.on_finished(name, rid)
        if rid in self.unstarted and rid in self.streams and not self.draining:
            self._spawn(self._reroute(rid, name, exclude=(name,)), f"reroute {rid}")
        else:
            self.unstarted.pop(rid, None)
            self._end(rid, error=why)

    async def _reroute(self, rid: str, dead: str, exclude: tuple[str, ...] = ()) -> None:
        """Place a request that had sent nothing yet on a live backend; its client sees no difference."""
        if rid not in self.unstarted:  # its client went away meanwhile
            return
        token_ids, params, arrival = self.unstarted[rid]
        try:
            blocks = list(block_hashes(token_ids)) if self.router.policy.needs_blocks else None
            cached = await self.cached_prefix(token_ids, blocks)
            name = self.route(rid, token_ids, params, cached, exclude, blocks)
            self.backends[name].submit(rid, token_ids, params, arrival)
        except MvllmError as e:
            self.unstarted.pop(rid, None)
            self._end(rid, error=f"backend {dead} stopped before serving this request, and {e}")
            return
        self.owner[rid] = name
        self.metrics.routed.labels(name).inc()
        self.metrics.rerouted.labels(dead).inc()
        if (stream := self.streams.get(rid)) is not None:
            stream.backend = name

    async def _respawn(self, name: str) -> None:
        old = self.backends[name]

        def start() -> ProcessBackend:
            backend = ProcessBackend(old.spec, self.model)
            try:
                backend.wait_ready(self.ready_timeout)
            except MvllmError:
                backend.shutdown()
                raise
            return backend

        try:
            backend = await asyncio.get_running_loop().run_in_executor(None, start)
        except MvllmError as e:
            self.restart_error[name] = str(e)  # shown by /health; the backend stays down
            return
        if self.draining:
            backend.shutdown()
            return
        self.backends[name] = backend
        self.snapshots[name] = backend.info
        self.index.drop(name)  # the new worker's cache starts empty: its events fill the index from here
        backend.listen(self.loop, self._on_event)
        try:
            for ids in self.warmed:
                await self.warm(ids, backend=name)
        except (MvllmError, asyncio.TimeoutError) as e:  # it died again while warming: its Dead event follows
            self.restart_error[name] = str(e)
            return
        self.restart_error.pop(name, None)
        self.restarts[name] += 1
        self.metrics.restarts.labels(name).inc()
        self.metrics.backend_up.labels(name).set(1)
        self.router.revive(name)

    def _end(self, rid: str, finish_reason: str | None = None, error: str | None = None) -> None:
        if (stream := self.streams.get(rid)) is not None:
            stream.end(finish_reason, error)

    async def cached_prefix(self, token_ids: list[int], hashes: list[int] | None = None) -> dict[str, int]:
        """Each live backend's cached prefix of this prompt: a worker's from the index of its KV events, with no
        call; a remote's by a call (its shadow index answers at once). `hashes`: the prompt's block_hashes."""
        local = self.index.cached_prefix_len(token_ids, hashes)
        alive = [b for b in self.backends.values() if b.alive]
        remote = [b for b in alive if b.spec.remote]
        asked = await asyncio.gather(*(b.call("cached_prefix_len", token_ids, timeout=30) for b in remote),
                                     return_exceptions=True) if remote else []
        found = {b.name: v for b, v in zip(remote, asked) if isinstance(v, int)}
        for b in alive:
            if not b.spec.remote:
                found[b.name] = local.get(b.name, 0)
        return {b.name: found[b.name] for b in alive if b.name in found}

    def route(self, rid: str, token_ids: list[int], params: SamplingParams, cached: dict[str, int],
              exclude: tuple[str, ...] = (), blocks: list[int] | None = None) -> str:
        """The router's decision, timed into /metrics (mvllm_routing_decision_seconds). `blocks`: the prompt's
        block hashes where the caller has them (hashed once for the look-up and the policy)."""
        start = time.perf_counter()
        if blocks is None and self.router.policy.needs_blocks:
            blocks = list(block_hashes(token_ids))
        name = self.router.route(rid, len(token_ids), params.max_tokens, cached, exclude, blocks, params.stop_at)
        self.metrics.route_seconds.observe(time.perf_counter() - start)
        return name

    async def submit(self, token_ids: list[int], params: SamplingParams, arrival: float | None = None,
                     prefix: str = "cmpl", stream: Stream | None = None) -> tuple[str, str]:
        """Route and submit one request; returns (request id, backend name). `stream`: its mailbox, where the
        caller brings its own (an API process's, server/core.py)."""
        if self.draining:
            raise ShuttingDownError("the server is shutting down and takes no new requests")
        rid, arrival = f"{prefix}-{self.id_base}{next(self.ids):08x}", arrival or time.time()
        blocks = list(block_hashes(token_ids)) if self.router.policy.needs_blocks else None
        cached = await self.cached_prefix(token_ids, blocks)
        name = self.route(rid, token_ids, params, cached, blocks=blocks)
        self.streams[rid] = stream if stream is not None else Stream()
        self.owner[rid] = name
        self.unstarted[rid] = (token_ids, params, arrival)
        self.metrics.routed.labels(name).inc()
        self.backends[name].submit(rid, token_ids, params, arrival)
        return rid, name

    def leave(self, rid: str, done: bool) -> None:
        """A request's response is over: forget its stream; abort it on its backend unless it had ended (`done`)."""
        self.streams.pop(rid, None)
        self.unstarted.pop(rid, None)
        name = self.owner.pop(rid, None)
        if not done and name is not None:
            self.abort(name, rid)

    def abort(self, name: str, rid: str) -> None:
        self.router.on_finished(name, rid, "abort")
        try:
            self.backends[name].abort(rid)
        except MvllmError:
            pass

    async def drain(self, timeout: float) -> int:
        """Take no new requests, let those in flight finish for up to `timeout` seconds, then abort the
        rest: their streams end with finish_reason "abort". Returns how many were aborted."""
        self.draining = True
        deadline = time.monotonic() + timeout
        while self.streams and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        left = list(self.owner.items())
        for rid, name in left:
            self.abort(name, rid)
            self._end(rid, "abort")
        deadline = time.monotonic() + 2.0  # time for each stream to write its last chunk
        while self.streams and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        return len(left)

    async def warm(self, token_ids: list[int], backend: str | None = None) -> dict[str, int]:
        """Warm one backend or all live ones; a restarted backend is warmed again with every prefix so far."""
        if backend is None and token_ids not in self.warmed:
            self.warmed = (self.warmed + [token_ids])[-8:]
        targets = [self.backends[backend]] if backend else [b for b in self.backends.values() if b.alive]
        done = await asyncio.gather(*(b.call("warm", token_ids) for b in targets))
        return {b.name: n for b, n in zip(targets, done)}

    async def reset_prefix_cache(self) -> dict[str, bool]:
        alive = [b for b in self.backends.values() if b.alive]
        done = await asyncio.gather(*(b.call("reset_prefix_cache", timeout=60) for b in alive))
        if all(done):  # a backend refuses while requests are in flight, and keeps its cache
            self.warmed = []
        return {b.name: ok for b, ok in zip(alive, done)}

    async def snapshot_all(self) -> list[dict]:
        out = []
        for b in self.backends.values():
            snap = dict(self.snapshots.get(b.name, {}), name=b.name, device=b.spec.device, alive=b.alive)
            if b.alive:
                try:
                    snap.update(await b.call("snapshot", timeout=10))
                except (MvllmError, asyncio.TimeoutError):
                    pass
            bookings = [x for r, x in self.router.bookings[b.name].items() if not r.startswith("external-")]
            snap["routed"] = self.router.decisions[b.name]
            snap["booked_queued"] = sum(not x.active for x in bookings)
            snap["booked_active"] = sum(x.active for x in bookings)
            out.append(snap)
        return out

    def shutdown(self) -> None:
        for b in self.backends.values():
            b.shutdown()
        self.router.close()
