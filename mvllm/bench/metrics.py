"""Per-request records and the run summary, with `vllm bench serve`'s key names and definitions.

All times are seconds from the start of the replay, taken on the client. A request's latency counts
from its scheduled send time (`arrival`), so a late client cannot hide queueing:
ttft = first_token - arrival, e2el = finish - arrival, tpot = (e2el - ttft) / (output_tokens - 1),
itl = the gaps between streamed chunks, pooled over requests. Percentiles interpolate linearly
between ranks (numpy's default, as vLLM). max_send_delay_ms: how late the client sent its latest
request against the schedule (a check that the client kept up).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

PERCENTILES = (95, 99)


@dataclass(slots=True)
class RequestRecord:
    id: int
    arrival: float
    prompt_tokens: int = 0
    sent: float | None = None
    first_token: float | None = None
    finish: float | None = None
    backend: str = ""
    cached_tokens: int | None = None
    output_tokens: int = 0
    chunks: list[float] = field(default_factory=list)
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.error and self.finish is not None and self.first_token is not None

    @property
    def ttft(self) -> float:
        return self.first_token - self.arrival

    @property
    def e2el(self) -> float:
        return self.finish - self.arrival

    @property
    def tpot(self) -> float | None:
        return (self.e2el - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else None

    @property
    def itl(self) -> list[float]:
        return [b - a for a, b in zip(self.chunks, self.chunks[1:], strict=False)]


def percentile(values: list[float], p: float) -> float:
    """Linear interpolation between closest ranks (numpy.percentile's default)."""
    xs = sorted(values)
    if not xs:
        raise ValueError("percentile of no values")
    k = (len(xs) - 1) * p / 100.0
    lo = math.floor(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def stats(name: str, values_s: list[float]) -> dict:
    """mean/median/std/p95/p99 of one metric, in ms; None where there are no values."""
    ms = [1000.0 * v for v in values_s]
    out: dict = {}
    if not ms:
        for key in ("mean", "median", "std", *(f"p{p}" for p in PERCENTILES)):
            out[f"{key}_{name}_ms"] = None
        return out
    mean = sum(ms) / len(ms)
    out[f"mean_{name}_ms"] = mean
    out[f"median_{name}_ms"] = percentile(ms, 50)
    out[f"std_{name}_ms"] = math.sqrt(sum((x - mean) ** 2 for x in ms) / len(ms))
    for p in PERCENTILES:
        out[f"p{p}_{name}_ms"] = percentile(ms, p)
    return out


def summarize(records: list[RequestRecord], duration: float | None = None) -> dict:
    """The run summary. `duration` is the replay's wall time (start to the last response, done or
    failed); makespan is the batch completion time: first send to the last completed response."""
    done = [r for r in records if r.ok]
    ends = [r.finish if r.finish is not None else r.arrival for r in records]
    if duration is None:
        duration = max(ends, default=0.0)
    start = min((r.arrival for r in records), default=0.0)
    makespan = max((r.finish for r in done), default=start) - start
    out_tokens = sum(r.output_tokens for r in done)
    in_tokens = sum(r.prompt_tokens for r in done)
    per = duration if duration > 0 else float("nan")
    s = {
        "duration": duration,
        "completed": len(done),
        "failed": len(records) - len(done),
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": len(done) / per,
        "output_throughput": out_tokens / per,
        "total_token_throughput": (in_tokens + out_tokens) / per,
        "makespan": makespan,
        "max_send_delay_ms": 1000.0 * max((r.sent - r.arrival for r in records if r.sent is not None), default=0.0),
    }
    s.update(stats("ttft", [r.ttft for r in done]))
    s.update(stats("tpot", [t for r in done if (t := r.tpot) is not None]))
    s.update(stats("itl", [x for r in done for x in r.itl]))
    s.update(stats("e2el", [r.e2el for r in done]))
    s["backend_requests"] = dict(sorted(Counter(r.backend for r in done).items()))
    cached: dict[str, int] = {}
    for r in done:
        cached[r.backend] = cached.get(r.backend, 0) + (r.cached_tokens or 0)
    s["backend_cached_tokens"] = dict(sorted(cached.items()))
    s["total_cached_tokens"] = sum(cached.values())
    return {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in s.items()}
