"""`mvllm profile --serving`: the serving overheads of each backend, measured through a real `mvllm serve`.

After the in-process measurements, the same backends are started as `mvllm serve` starts them (a
subprocess, like bench's), and requests go over HTTP with streaming, as bench sends them. Each backend is
pinned in turn by the router's `<role>-only` policy while every other backend decodes a full batch of long
requests (that is how serving runs: the backends share the host's cores, the server and the client).
Per backend:
- step_ms: host work each decode step gains while serving, the mean over batch 1 and max_active of the
  served inter-token time (per request, while all b requests decode; median over requests) minus the
  profiled decode step_ms at that batch, clamped at 0;
- step_ms_alone: the same with every other backend idle, at most step_ms (the simulator prices a step by it
  while no other backend has work: on a small host, the others' threads are most of step_ms);
- request_ms: the time a request spends outside the backend (HTTP, routing, pipes, the first chunk back):
  the median served TTFT of a lone request of 20 new tokens after a cached prefix (3 x repeats of them, at
  least 5), minus what the timing model prices for it in-process (its prefill, then one decode step) and
  minus step_ms, clamped at 0; so eta and the simulator (mvllm/routing/eta.py) predict that served TTFT.
"""

from __future__ import annotations

import asyncio
import math
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from mvllm.backends.spec import BackendSpec, split_device
from mvllm.bench.client import send
from mvllm.bench.http import Pool
from mvllm.bench.metrics import RequestRecord
from mvllm.bench.process import ServerProcess
from mvllm.bench.workload import Request
from mvllm.errors import MvllmError
from mvllm.profile.plan import DECODE_NEW, DECODE_PREFIX, WARM_CACHED, WARM_NEW  # as the profile's own steps
from mvllm.routing.eta import Timing

RULE = " ".join(__doc__.split("\n\n")[1].split())
ROLES = ("gpu", "cpu")  # the names a policy can pin: gpu-only, cpu-only (mvllm/routing/policies/only.py)
LOAD_PROMPT = 16


class ServingError(MvllmError):
    pass


def roles(names: list[str]) -> dict[str, str]:
    """Profile name -> the name it is served under, so that a policy can pin it: gpu and cpu keep their
    names, other names take a free one of them in order; a backend left without one is served under its
    own name (it loads the host like the others) and not measured."""
    free = [r for r in ROLES if r not in names]
    out = {}
    for n in names:
        out[n] = n if n in ROLES else (free.pop(0) if free else n)
    return out


def served_backends(specs: list[BackendSpec], text: str, names: dict[str, str]) -> str:
    """The --backends text of the local backends, renamed by `names`, with max_active as profiled."""
    parts = {p.split("=", 1)[0]: p for p in (p.strip() for p in text.split(",")) if p.strip()}
    out = []
    for s in specs:
        head, options = split_device(parts[s.name].split("=", 1)[1])
        options = [o for o in options if o.partition("=")[0] != "max_active"] + [f"max_active={s.max_active}"]
        out.append("/".join([f"{names[s.name]}={head}", *options]))
    return ",".join(out)


class Client:
    def __init__(self, url: str, model: str, http: httpx.AsyncClient, tokens):
        self.url, self.model, self.http, self.tokens = url, model, http, tokens
        self.pool = Pool(url)
        self.ids = 0

    async def post(self, path: str, body: dict) -> dict:
        r = await self.http.post(f"{self.url}{path}", json=body)
        if r.status_code != 200:
            raise ServingError(f"serving overheads: {path} answered HTTP {r.status_code}: {r.text[:300]}")
        return r.json()

    async def pin(self, role: str) -> None:
        await self.post("/v1/policy", {"policy": f"{role}-only"})

    def start(self, prompt: list[int], max_tokens: int) -> tuple[RequestRecord, asyncio.Task]:
        self.ids += 1
        req = Request(self.ids, prompt, max_tokens, 0.0)
        rec = RequestRecord(req.id, 0.0, prompt_tokens=len(prompt))
        return rec, asyncio.ensure_future(send(self.pool, self.model, req, time.perf_counter(), rec))

    async def run(self, prompts: list[list[int]], max_tokens: int, role: str) -> list[RequestRecord]:
        started = [self.start(p, max_tokens) for p in prompts]
        await asyncio.gather(*(t for _, t in started))
        recs = [r for r, _ in started]
        for r in recs:
            if r.error or r.backend != role:
                raise ServingError(f"serving overheads: a request pinned to {role} "
                                   f"{'failed: ' + r.error if r.error else 'ran on ' + repr(r.backend)}")
        return recs


class Load:
    """Every other backend decoding a full batch of long requests until the phase ends."""

    def __init__(self, client: Client, others: dict[str, BackendSpec], tokens: int):
        self.client, self.others, self.tokens = client, others, tokens
        self.running: list[tuple[RequestRecord, asyncio.Task]] = []

    async def __aenter__(self) -> Load:
        for role, spec in self.others.items():
            await self.client.pin(role)
            batch = [self.client.start(self.client.tokens(LOAD_PROMPT), self.tokens) for _ in range(spec.max_active)]
            while any(r.first_token is None and not t.done() for r, t in batch):  # decoding: routed, prefilled
                await asyncio.sleep(0.005)
            for r, t in batch:
                if t.done() and (r.error or r.backend != role):
                    raise ServingError(f"serving overheads: the load on {role} did not start: {r.error or r.backend}")
            self.running += batch
        return self

    def busy(self) -> bool:
        return all(not t.done() for _, t in self.running)

    async def __aexit__(self, *exc) -> None:
        for _, t in self.running:
            t.cancel()  # the server aborts a request whose client hangs up
        await asyncio.gather(*(t for _, t in self.running), return_exceptions=True)


def decode_gap_s(recs: list[RequestRecord]) -> float:
    """Median over requests of the mean time between tokens while all of them decode (from the last one's
    first token to the first one's last token), so chunks read together do not count as a 0 and a 2x gap. A
    request whose tokens there all came at one instant (a starved client read them at once) tells nothing."""
    lo, hi = max(r.first_token for r in recs), min(r.chunks[-1] for r in recs)
    gaps = []
    for r in recs:
        inside = [t for t in r.chunks if lo <= t <= hi]
        if len(inside) >= 2 and inside[-1] > inside[0]:
            gaps.append((inside[-1] - inside[0]) / (len(inside) - 1))
    if not gaps:
        raise ServingError("serving overheads: the requests of a batch never decoded together")
    return statistics.median(gaps)


async def measure_one(client: Client, role: str, spec: BackendSpec, entry: dict, others: dict[str, BackendSpec],
                      load_steps: dict[str, float], repeats: int, steps: int, max_len: int) -> dict:
    timing = Timing.from_profile({k: v for k, v in entry.items() if k != "serving"})
    step_ms = {d["batch"]: d["step_ms"] for d in entry["decode"]}
    top = max(b for b in step_ms if b <= spec.max_active)

    def load_tokens(phase_s: float) -> int:
        """Enough tokens for every other backend to outlast a phase estimated at phase_s (x4, + 3 s)."""
        slowest = min(load_steps[r] for r in others) if others else 1.0
        return max(8, min(max_len - LOAD_PROMPT - 1, math.ceil((4 * phase_s + 3) / slowest)))

    await client.pin(role)
    warm_prefix, decode_prefix = client.tokens(WARM_CACHED), client.tokens(DECODE_PREFIX)
    server_name = role
    for prefix in (warm_prefix, decode_prefix):
        await client.post("/v1/warm", {"prompt": prefix, "backend": server_name})
    await client.run([client.tokens(WARM_NEW)], 2, role)  # a fresh server's first request pays a warm-up

    lone, uncached, busy = [], [], []
    n = max(3 * repeats, 5)  # cheap (a 20-token prefill each), and TTFT is the noisier of the two
    est = n * (timing.prefill_s(WARM_NEW) + timing.step_s[0] + 0.05)
    async with Load(client, others, load_tokens(est)) as load:
        await client.pin(role)
        for _ in range(n):
            (rec,) = await client.run([warm_prefix + client.tokens(WARM_NEW)], 1, role)
            lone.append(rec.ttft)
            uncached.append(rec.prompt_tokens - (rec.cached_tokens or 0))
        busy.append(load.busy())
    # between a batch's admissions: HTTP, routing and the other backends' steps, with room for a loaded host
    stagger = 0.3 + 4 * max((load_steps[r] for r in others), default=0.0)

    async def served_gaps(loaded: dict[str, BackendSpec]) -> dict[int, float]:
        """The served decode gap (ms) at batch 1 and max_active while the `loaded` backends decode."""
        gaps = {}
        for b in sorted({1, top}):
            for attempt in range(3):  # a loaded host may admit a batch's requests too far apart: longer each time
                length = min(steps + 4 + math.ceil((2 ** attempt) * stagger / (step_ms[b] / 1000)),
                             max_len - DECODE_PREFIX - DECODE_NEW - 1)
                async with Load(client, loaded, load_tokens(length * step_ms[b] / 1000 * 2 + 0.2)) as load:
                    await client.pin(role)
                    recs = await client.run([decode_prefix + client.tokens(DECODE_NEW) for _ in range(b)], length,
                                            role)
                    if loaded:
                        busy.append(load.busy())
                try:
                    gaps[b] = 1000 * decode_gap_s(recs)
                    break
                except ServingError:
                    if attempt == 2:
                        raise
        return gaps

    gaps = await served_gaps(others)
    alone = await served_gaps({}) if others else gaps  # the same with every other backend idle
    host = {b: gaps[b] - step_ms[b] for b in gaps}
    step = max(0.0, statistics.mean(host.values()))
    step_alone = min(step, max(0.0, statistics.mean(alone[b] - step_ms[b] for b in alone)))
    tokens = round(statistics.median(uncached))
    in_process = 1000 * (timing.prefill_s(tokens) + timing.step_s[0])
    ttft = 1000 * statistics.median(lone)
    return {"request_ms": round(max(0.0, ttft - in_process - step), 3), "step_ms": round(step, 3),
            "step_ms_alone": round(step_alone, 3), "rule": RULE,
            "measured": {"ttft_ms": [round(1000 * t, 3) for t in lone], "ttft_median_ms": round(ttft, 3),
                         "uncached_tokens": tokens, "in_process_ms": round(in_process, 3),
                         "served_gap_ms": {str(b): round(g, 3) for b, g in gaps.items()},
                         "served_gap_alone_ms": {str(b): round(g, 3) for b, g in alone.items()},
                         "profiled_step_ms": {str(b): round(step_ms[b], 3) for b in gaps},
                         "host_ms": {str(b): round(h, 3) for b, h in host.items()},
                         "others_busy": sorted(others), "others_stayed_busy": all(busy),
                         "served_as": server_name}}


async def measure_all(url: str, model: str, specs: list[BackendSpec], entries: dict[str, dict],
                      names: dict[str, str], tokens, repeats: int, steps: int, max_len: int, progress) -> dict:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0, connect=30.0), limits=limits) as http:
        client = Client(url, model, http, tokens)
        pinned = {names[s.name]: s for s in specs if names[s.name] in ROLES}
        load_steps = {names[s.name]: max(d["step_ms"] for d in entries[s.name]["decode"]
                                         if d["batch"] <= s.max_active) / 1000 for s in specs}
        out = {}
        for role, spec in pinned.items():
            progress(f"{spec.name}: serving overheads over HTTP, the other backends busy")
            others = {r: s for r, s in pinned.items() if r != role}
            out[spec.name] = await measure_one(client, role, spec, entries[spec.name], others, load_steps, repeats,
                                               steps, max_len)
        return out


def measure_serving(model: str, text: str, specs: list[BackendSpec], profile: dict, tokens, repeats: int,
                    steps: int, max_len: int, progress, ready_timeout: float = 600.0) -> dict[str, dict]:
    """Each local backend's `serving` block, measured through one `mvllm serve` of all the local backends."""
    local = [s for s in specs if not s.remote and profile["backends"].get(s.name, {}).get("decode")]
    if not local:
        return {}
    names = roles([s.name for s in local])
    with tempfile.TemporaryDirectory(prefix="mvllm-serving-") as tmp:
        server = ServerProcess(["--model", model, "--backends", served_backends(local, text, names),
                                "--policy", "gpu-only" if "gpu" in names.values() else "cpu-only"],
                               Path(tmp) / "serve.log")
        progress(f"serving overheads: starting mvllm serve with {', '.join(s.name for s in local)}")
        with server:
            server.wait_ready(ready_timeout)
            return asyncio.run(measure_all(server.url, model, local, profile["backends"], names, tokens, repeats,
                                           steps, max_len, progress))
