"""The client's own health: a result measured on a saturated client must say so.

Each client process records its event loop's lag (how late a 10 ms sleep wakes: time the loop spent on other
work before it could run a callback that was due) and its CPU time; each request records its send lag (sent
minus scheduled). A run's client is `saturated` when its loop's p99 lag exceeds 5 ms or 5% of the median TTFT
(beyond that the stamps the latencies come from are late by a share that matters), or when a worker kept 90% of
a core busy. The send lag alone does not mark it: requests scheduled at one instant (a burst) go out one after
another, and that spread is the schedule's, not a late loop's; a loop that is late for its sends is late for its
timer too.
"""

from __future__ import annotations

import asyncio
import time

from mvllm.bench.metrics import RequestRecord, percentile

PERIOD = 0.01  # seconds between two loop-lag samples
LIMIT_MS = 5.0
LIMIT_TTFT = 0.05
BUSY = 0.9  # a worker's CPU, as a share of one core, past which it cannot keep its schedule


class Health:
    """One process's loop lag and CPU, from `watch()` to `result()`."""

    def __init__(self) -> None:
        self.lags: list[float] = []
        self.cpu0 = time.process_time()
        self.wall0 = time.perf_counter()

    def watch(self) -> asyncio.Task:
        self.cpu0, self.wall0 = time.process_time(), time.perf_counter()

        async def sample() -> None:
            while True:
                due = time.perf_counter() + PERIOD
                await asyncio.sleep(PERIOD)
                self.lags.append(max(time.perf_counter() - due, 0.0))

        return asyncio.ensure_future(sample())

    def result(self) -> dict:
        """Plain data, to cross a process boundary: the loop lags (s), CPU and wall seconds."""
        return {"lags": self.lags, "cpu_s": time.process_time() - self.cpu0, "wall_s": time.perf_counter() - self.wall0}


def quantiles_ms(values_s: list[float]) -> dict:
    if not values_s:
        return {"p50": None, "p99": None, "max": None}
    ms = [1000.0 * v for v in values_s]
    return {"p50": percentile(ms, 50), "p99": percentile(ms, 99), "max": max(ms)}


def summarize_client(records: list[RequestRecord], workers: list[dict], median_ttft_ms: float | None) -> dict:
    """The `client` block of summary.json: workers, send lag and loop lag (ms), CPU per worker (share of
    one core), and whether the client was saturated (`limit_ms`: the lag it was held to)."""
    send = quantiles_ms([r.sent - r.arrival for r in records if r.sent is not None])
    loop = quantiles_ms([x for w in workers for x in w["lags"]])
    lag = loop["p99"] or 0.0
    limit = LIMIT_MS if median_ttft_ms is None else min(LIMIT_MS, LIMIT_TTFT * median_ttft_ms)
    cpu = [round(w["cpu_s"] / w["wall_s"], 3) if w["wall_s"] > 0 else None for w in workers]
    busiest = max((c for c in cpu if c is not None), default=0.0)
    return {"workers": len(workers), "send_lag_ms": send, "loop_lag_ms": loop, "cpu": cpu,
            "p99_lag_ms": lag, "limit_ms": limit, "saturated": lag > limit or busiest > BUSY}


def warning(client: dict) -> str | None:
    """One line for a saturated client, else None."""
    if not client or not client.get("saturated"):
        return None
    cpu = max((c for c in client.get("cpu") or [] if c is not None), default=0.0)
    return (f"warning: the benchmark client lagged (its loop's p99 lag {client['p99_lag_ms']:.1f} ms, limit "
            f"{client['limit_ms']:.1f} ms; busiest of its {client['workers']} worker(s) at {100 * cpu:.0f}% of a "
            "core): latencies include its own delay; use more --client-workers or a lighter load")
